"""NVMeTier on its own (no Lightning): units stepped through its buffers equal the same steps in memory, whatever order
the disk finishes in; a loaded state moves into its files; its views outlive its files."""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_accel.offload import make_plan
from lightning_accel.offload.host_step import step_params
from lightning_accel.offload.host_store import HostStore
from lightning_accel.offload.tier import NVMeTier
from lightning_accel.offload.tier_setup import make_tier


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(8)])


def _tiered(tmp_path: Path) -> tuple[nn.Module, torch.optim.Optimizer, NVMeTier, list]:
    model = _model()
    plan = make_plan(model, "auto")
    store = HostStore(plan.blocks, torch.float32, pin=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _, tier = make_tier(plan.blocks, store, optimizer, None, str(tmp_path), pin=False)
    assert tier is not None and len(tier.files) == 8 and tier.buffers is not None and len(tier.buffers.slots) == 3
    return model, optimizer, tier, plan.blocks


def _grads(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def _slow_writes(tier: NVMeTier, seconds: float) -> None:
    """Every write lands ``seconds`` late, on a thread of its own: steps outrun the disk, as on a slow one."""
    write = tier.io.write_spans

    def late(*args: object) -> Future[None]:
        done: Future[None] = Future()
        inner = write(*args)  # type: ignore[arg-type]

        def land() -> None:
            time.sleep(seconds)
            inner.result()
            done.set_result(None)

        threading.Thread(target=land, daemon=True).start()
        return done

    tier.io.write_spans = late  # type: ignore[method-assign]


@pytest.mark.parametrize("order", ["forward", "backward"])
def test_units_stepped_through_the_buffers_equal_the_steps_in_memory(tmp_path: Path, order: str) -> None:
    reference = _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    model, optimizer, tier, units = _tiered(tmp_path)
    _slow_writes(tier, 0.01)  # the read-ahead must never take the buffer a step waits for (it deadlocked)
    indices = list(range(8)) if order == "forward" else list(range(7, -1, -1))
    for step in range(3):
        _grads(reference, step)
        ref_opt.step()
        _grads(model, step)
        tier.expect(indices)
        for index in indices:
            params = [p for _, p in units[index].params]
            tier.step_unit(index, params, {}, {}, functools.partial(step_params, optimizer, fuse=True))
        tier.finish_step()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
        assert all(torch.equal(ref_opt.state[a][k], optimizer.state[b][k]) for k in ("exp_avg", "exp_avg_sq")), name
    assert tier.counters.read_bytes == 3 * sum(f.size for f in tier.files.values())
    tier.close()


def test_a_loaded_state_moves_into_the_files_and_the_views_outlive_them(tmp_path: Path) -> None:
    model, optimizer, tier, units = _tiered(tmp_path)
    _grads(model, 0)
    for index in range(8):
        tier.step_unit(index, [p for _, p in units[index].params], {}, {}, functools.partial(step_params, optimizer, fuse=True))
    tier.finish_step()
    saved = optimizer.state_dict()  # read through the maps
    snapshot = {i: {k: v.clone() for k, v in s.items()} for i, s in saved["state"].items()}
    optimizer.load_state_dict({**saved, "state": {i: {k: v * 2 for k, v in s.items()} for i, s in snapshot.items()}})
    first = next(iter(model.parameters()))
    assert not tier.on_disk(first) or optimizer.state[first]["exp_avg"] is not tier.files[0].rest[(first, "exp_avg")]
    tier.adopt_state()
    assert optimizer.state[first]["exp_avg"] is tier.files[0].rest[(first, "exp_avg")]
    tier.close()  # the files go
    assert not any(tmp_path.iterdir())
    after = optimizer.state_dict()["state"]
    for i, entries in snapshot.items():
        assert torch.equal(after[i]["exp_avg"], entries["exp_avg"] * 2)
        assert torch.equal(after[i]["step"], entries["step"] * 2)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_step_for_a_chunk_nobody_read_ahead_takes_over_a_read_ahead_buffer(tmp_path: Path) -> None:
    # every buffer holds a read-ahead when a step asks for unit 5 (a streamed resident unit's parameter stepping as its
    # gradient lands does): waiting for a buffer that only those units' steps would free, after unit 5's, never ends
    model, optimizer, tier, units = _tiered(tmp_path)
    buffers = tier.buffers
    assert buffers is not None
    tier.expect(range(8))  # units 0, 1, 2 (a chunk each) read ahead into the three buffers
    assert sorted(s.key for s in buffers.slots) == [(0, 0), (1, 0), (2, 0)]
    slot = buffers.take((5, 0))
    assert slot.key == (5, 0) and slot.taken and len([s for s in buffers.slots if s.key in {(0, 0), (1, 0), (2, 0)}]) == 2
    displaced = buffers._expected[0]
    buffers.freed(slot)  # its chunk did not change: the buffer reads the displaced chunk again, first
    assert any(s.key == displaced for s in buffers.slots)
    _grads(model, 0)
    for index in range(8):  # and every unit still steps through the buffers
        tier.step_unit(index, [p for _, p in units[index].params], {}, {}, functools.partial(step_params, optimizer, fuse=True))
    tier.finish_step()
    tier.close()


def test_a_step_that_raises_leaves_the_unit_as_it_was_and_frees_its_buffer(tmp_path: Path) -> None:
    model, optimizer, tier, units = _tiered(tmp_path)
    first = [p for _, p in units[0].params]
    before = [p.detach().clone() for p in first]
    _grads(model, 0)

    def fails(params: list, shadows: dict, low: dict) -> list:
        for p in params:
            p.data.add_(1.0)  # half done when it raises
        raise ValueError("the user's optimizer failed")

    for _ in range(4):  # more times than there are buffers: each one came back
        with pytest.raises(ValueError, match="the user's optimizer failed"):
            tier.step_unit(0, first, {}, {}, fails)
    assert tier.buffers is not None and all(s.key is None for s in tier.buffers.slots)
    assert all(torch.equal(a, b) for a, b in zip(first, before))  # the views read the file, which the step never reached
    tier.close()
