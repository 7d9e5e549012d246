"""``Fabric(strategy="l2l_offload")``: Fabric's API as under Fabric's own single-device strategy (weights equal in
float64 with each option, resume exact, a model built on meta materialized, the module usable after the loop), and
what it cannot honour refused in one line before the first step."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

import lightning_accel  # noqa: F401  (registers the names with Fabric)
from lightning_accel.fabric import L2LOffloadStrategy

from tests.support.fabric_loops import max_difference, weights
from tests.support.offload_nets import Net


def _fabric(strategy: Any = "l2l_offload", precision: str = "32-true", **kwargs: Any) -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision, **kwargs)
    fabric.launch()
    return fabric


def _start() -> nn.Module:
    torch.manual_seed(0)
    return Net(depth=4, width=8).double()


def _data(n: int = 6, dtype: torch.dtype = torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g, dtype=dtype), torch.randn(8, 1, generator=g, dtype=dtype)) for _ in range(n)]


def _train(fabric: L.Fabric, model: Any, optimizer: Any, data: list, accumulation: int = 2, clip: str | None = "norm",
           with_model: bool = False) -> None:
    """A Fabric loop: accumulation under no_backward_sync, clipping, ``fabric.backward(loss[, model=model])``."""
    for i, (x, y) in enumerate(data, start=1):
        accumulating = i % accumulation != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = nn.functional.mse_loss(model(x), y) / accumulation
            fabric.backward(loss, model=model) if with_model else fabric.backward(loss)
        if not accumulating:
            if clip == "norm":
                fabric.clip_gradients(model, optimizer, max_norm=0.05)
            elif clip == "value":
                fabric.clip_gradients(model, optimizer, clip_val=0.01)
            optimizer.step()
            optimizer.zero_grad()


def _run(strategy: Any, start: nn.Module | None = None, precision: str = "32-true", batches: int = 6, **loop: Any) -> tuple[Any, torch.Tensor]:
    """The loop from ``start`` (default :func:`_start`); returns the set-up model and its output on a batch after the
    loop (no grad: inference)."""
    fabric = _fabric(strategy, precision)
    model = start if start is not None else _start()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(fabric, model, optimizer, _data(batches), **loop)
    with torch.no_grad():
        return model, model(_data(1)[0][0])


@functools.lru_cache(maxsize=None)
def _reference(accumulation: int = 2, clip: str | None = "norm") -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model, output = _run("auto", accumulation=accumulation, clip=clip)
    return weights(model), output


OPTIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # strategy arguments, loop arguments
    "no-checkpointing": ({"checkpoint_blocks": False, "prefetch_blocks": 0}, {"clip": "value", "with_model": True}),
    "overlap-step": ({"overlap_step": True}, {"accumulation": 1, "clip": None}),
    "host-budget": ({"host_budget": "1MB", "offload_resident": True}, {}),
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option_trains_as_fabrics_default_strategy_and_infers_after_the_loop(option: str, tmp_path: Path) -> None:
    arguments, loop = OPTIONS[option]
    model, output = _run(L2LOffloadStrategy(**arguments), **loop)
    reference, expected = _reference(loop.get("accumulation", 2), loop.get("clip", "norm"))
    assert max_difference(reference, weights(model)) < 1e-12
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-12)


def test_nvme_tier_trains_as_fabrics_default_strategy_and_saves_what_fabric_loads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fabric = _fabric(L2LOffloadStrategy(nvme_path=str(tmp_path / "tier")))  # without host_budget: every block's state on disk
    model = _start()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(fabric, model, optimizer, _data())
    assert re.search(r"NVMe tier: host .*, disk [1-9][0-9.]* kB", caplog.text), caplog.text  # the plan line: state on disk
    reference, expected = _reference()
    assert max_difference(reference, weights(model)) < 1e-12
    with torch.no_grad():
        torch.testing.assert_close(model(_data(1)[0][0]), expected, rtol=0, atol=1e-12)
    # written by the cache-bounded atomic writer (as under the Trainer), loaded by Fabric's own strategy
    fabric.save(tmp_path / "tier.ckpt", {"model": model, "optimizer": optimizer})
    plain = _fabric("auto")
    loaded = plain.setup(Net(depth=4, width=8).double())
    plain.load(tmp_path / "tier.ckpt", {"model": loaded}, strict=False)
    assert max_difference(weights(model), weights(loaded)) == 0


def test_save_and_load_resume_exactly(tmp_path: Path) -> None:
    data = _data(8)
    whole = _fabric()
    model = whole.setup(_start())
    optimizer = whole.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(whole, model, optimizer, data)

    first = _fabric()
    part = first.setup(_start())
    part_opt = first.setup_optimizers(torch.optim.AdamW(part.parameters(), lr=1e-2))
    _train(first, part, part_opt, data[:4])
    first.save(tmp_path / "state.ckpt", {"model": part, "optimizer": part_opt, "iter_num": 4})

    second = _fabric()
    torch.manual_seed(5)
    resumed = second.setup(Net(depth=4, width=8).double())  # other weights: the checkpoint's must win
    resumed_opt = second.setup_optimizers(torch.optim.AdamW(resumed.parameters(), lr=1e-2))
    state = {"model": resumed, "optimizer": resumed_opt, "iter_num": 0}
    second.load(tmp_path / "state.ckpt", state)
    assert state["iter_num"] == 4
    _train(second, resumed, resumed_opt, data[4:])
    assert max_difference(weights(model), weights(resumed)) == 0


def test_init_module_on_meta_is_materialized_and_loads_raw_weights(tmp_path: Path) -> None:
    torch.save(_start().state_dict(), tmp_path / "weights.pt")
    fabric = _fabric()
    with fabric.init_module(empty_init=True):
        model = Net(depth=4, width=8).double()
    assert all(p.is_meta for p in model.parameters())
    model = fabric.setup(model)
    assert not any(p.is_meta for p in model.parameters())
    fabric.load_raw(tmp_path / "weights.pt", model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(fabric, model, optimizer, _data())
    assert max_difference(_reference()[0], weights(model)) < 1e-12


def test_bf16_mixed_pairs_with_the_offload_precision_and_tracks_fabrics_bf16() -> None:
    initial = weights(_start().float())
    model, output = _run("l2l_offload", start=_start().float(), precision="bf16-mixed", batches=2)
    reference, expected = _run("auto", start=_start().float(), precision="bf16-mixed", batches=2)
    moved = max_difference(weights(reference), initial)
    assert max_difference(weights(reference), weights(model)) < 0.05 * moved  # bf16 device copies: rounding only
    assert output.dtype == expected.dtype


@pytest.mark.parametrize(("build", "match"), [
    (lambda: _fabric(precision="bf16-true"), r"^precision='bf16-true' \(HalfPrecision\): strategy='l2l_offload' keeps fp32 masters"),
    (lambda: _fabric(precision="64-true"), r"^precision='64-true' \(DoublePrecision\): strategy='l2l_offload'"),
    (lambda: L.Fabric(accelerator="cpu", devices=2, strategy="l2l_offload"),
     r"^Fabric\(strategy='l2l_offload'\) trains on one device in one process, but devices=2 asks for more; use devices=1, "
     r"or Fabric\(strategy='l2l_offload_ddp'\)"),
    (lambda: _fabric(L2LOffloadStrategy(delayed_update=True)), r"^Fabric\(strategy='l2l_offload'\): delayed_update=True .*"
                                                               r"use Trainer\(strategy=L2LOffloadStrategy\(delayed_update=True\)\)"),
    (lambda: L2LOffloadStrategy(prefetch_blocks="2"), r"^L2LOffloadStrategy: prefetch_blocks takes an int >= 0 .*; pass prefetch_blocks=2"),
    (lambda: L.Fabric(accelerator="cpu", strategy="gpipe_distributed"),
     r"^Fabric\(strategy='gpipe_distributed'\) is not available: .*use Trainer\(strategy='gpipe_distributed'\)"),
])
def test_what_cannot_be_honoured_is_refused_when_fabric_is_built(build: Any, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        build()


def test_a_second_model_is_refused_and_the_fix_works() -> None:
    fabric = _fabric()
    model = fabric.setup(_start())
    with pytest.raises(ValueError, match=r"^Fabric\(strategy='l2l_offload'\) streams one model, and Net is set up; fabric.setup was "
                                         r"given a second one \(Linear\).*set the other model up with a Fabric of its own"):
        fabric.setup(nn.Linear(4, 1).double())
    teacher = _fabric("auto").setup(nn.Linear(4, 1).double())  # the fix: the second model on a Fabric of its own
    with torch.no_grad():
        assert model(_data(1)[0][0]).shape == teacher(_data(1)[0][0]).shape


@pytest.mark.parametrize(("loop", "match"), [
    ({"accumulation": 1, "clip": "norm"}, r"stepped every block during fabric.backward, before fabric.clip_gradients .*"
                                          r"pass overlap_step=False to clip"),
    ({"accumulation": 2, "clip": None}, r"a second fabric.backward before optimizer.step\(\) .* pass overlap_step=False to accumulate"),
])
def test_overlap_step_refuses_clipping_and_accumulation_at_the_call(loop: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _run(L2LOffloadStrategy(overlap_step=True), **loop)


def test_teardown_leaves_a_module_that_computes_as_before() -> None:
    strategy = L2LOffloadStrategy()
    model, output = _run(strategy, batches=2)
    strategy.teardown()  # the executor detached, the module's own forward back
    assert "forward" not in model.module.__dict__
    with torch.no_grad():
        assert torch.equal(model.module(_data(1)[0][0]), output)
