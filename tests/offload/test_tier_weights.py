"""WeightReads on its own (no Lightning): the masters a block computes on, read from the tier's files ahead of the
compute, are the file's values; a read-ahead never outlives a step that rewrites its unit; more blocks held than the
plan counted add a buffer instead of waiting."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from lightning_accel.offload import make_plan
from lightning_accel.offload.host_step import step_params
from lightning_accel.offload.host_store import HostStore
from lightning_accel.offload.tier import NVMeTier
from lightning_accel.offload.tier_setup import compute_reads, make_tier


def _tiered(tmp_path: Path) -> tuple[nn.Module, torch.optim.Optimizer, NVMeTier, list]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)])
    plan = make_plan(model, "auto")
    store = HostStore(plan.blocks, torch.float32, pin=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tier_plan, tier = make_tier(plan.blocks, store, optimizer, None, str(tmp_path), pin=False,
                                reads=compute_reads(len(plan.blocks), False), prefetch_blocks=1)
    assert tier is not None and tier_plan.weight_buffers == 3
    return model, optimizer, tier, plan.blocks


def test_weights_read_ahead_are_the_masters_in_the_files(tmp_path: Path) -> None:
    model, _, tier, blocks = _tiered(tmp_path)
    reads = tier.weights
    assert all(reads.covers(i) for i in range(6)) and reads.buffer_bytes == tier.plan.buffer_bytes - 3 * tier.plan.step_buffer
    before = tier.counters.read_bytes
    reads.start(0)
    reads.start(1)
    views = reads.take(0)
    for _, param in blocks[0].params:
        assert torch.equal(views[param], param.data) and views[param].data_ptr() != param.data.data_ptr()
    assert tier.counters.read_bytes - before == 2 * 8192  # two units: a 4 KiB weight, then a bias in a 4 KiB page of its own
    reads.drop(0)
    reads.drop(1)
    tier.close()


def test_a_step_drops_the_read_ahead_of_its_unit(tmp_path: Path) -> None:
    model, optimizer, tier, blocks = _tiered(tmp_path)
    tier.weights.start(2)  # read ahead, then the unit steps: its masters change on disk
    params = [p for _, p in blocks[2].params]
    for p in params:
        p.grad = torch.ones_like(p)
    tier.step_unit(2, params, {}, {}, functools.partial(step_params, optimizer, fuse=True))
    tier.finish_step()
    stepped = {p: p.data.clone() for p in params}  # the file's views: the stepped values
    views = tier.weights.take(2)
    assert all(torch.equal(views[p], stepped[p]) for p in params)
    tier.weights.drop(2)
    tier.close()


def test_more_blocks_held_than_buffers_add_a_buffer(tmp_path: Path) -> None:
    _, _, tier, _ = _tiered(tmp_path)
    held = [tier.weights.take(i) for i in range(4)]  # the plan counted 3
    assert tier.weights.grown == 1 and len(held) == 4
    for i in range(4):
        tier.weights.drop(i)
    tier.weights.start(5)  # a freed buffer takes the next read-ahead
    assert tier.weights.take(5)
    tier.close()
