"""The data-parallel pieces of L2L offload without Lightning: the partition plan, the gradient mean with its
presence flags, the weight broadcast and the optimizer-state shards (on a gloo group of 1 here; clipping across ranks
and the found-inf verdict: tests/comm/test_gradients.py; the 2-rank behaviour against DDP is tested in
tests/strategies/test_l2l_offload_ddp.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_accel.offload.grad_sync import HostGradientSync, launch_mean
from lightning_accel.offload.optimizer_state import gather_state, keep_state, param_indices, state_bytes
from lightning_accel.offload.partition import UnitOwners, partition_units
from lightning_accel.offload.weight_sync import broadcast_units


def test_equal_blocks_go_round_robin_and_split_evenly() -> None:
    plan = partition_units([10] * 8, 4)
    assert plan.owners == (0, 1, 2, 3, 0, 1, 2, 3)
    assert plan.shares([10] * 8) == [20] * 4
    assert plan.owned(1) == [1, 5]
    assert "rank 0: 2 units (25%)" in plan.describe([10] * 8)


def test_unequal_units_balance_by_size_and_fewer_units_than_ranks_leave_a_rank_empty() -> None:
    # largest first to the emptiest rank: 7 -> r0, 5 -> r1, 4 -> r1 (5 < 7), 3 -> r0 ... shares 10 and 9
    assert partition_units([3, 7, 4, 5], 2).owners == (0, 0, 1, 1)
    assert partition_units([3, 7, 4, 5], 2).shares([3, 7, 4, 5]) == [10, 9]
    assert partition_units([5], 2).owned(1) == []
    with pytest.raises(ValueError, match="world size must be >= 1, got 0"):
        partition_units([1], 0)


def test_fixed_units_keep_their_rank_and_the_others_go_round_them() -> None:
    # unit 0 (4) stays on rank 1, counted first; then 6 -> r0 (0 < 4), 5 -> r1 (4 < 6), 1 -> r0 (6 < 9)
    assert partition_units([4, 6, 5, 1], 2, fixed={0: 1}).owners == (1, 0, 1, 0)
    assert partition_units([4, 6, 5, 1], 2, fixed={0: 1, 1: 1}).owners == (1, 1, 0, 0)


def test_a_unit_that_trained_keeps_its_owner_when_others_start_training() -> None:
    """Gradual unfreezing over 2 ranks: block 0 trains from the start, blocks 2 and 3 from a later epoch, block 1 never;
    frozen again, block 2 keeps its owner (its optimizer state stays there)."""
    blocks = [[nn.Parameter(torch.zeros(4)) for _ in range(2)] for _ in range(4)]
    for block in blocks[1:]:
        for p in block:
            p.requires_grad_(False)
    owners = UnitOwners(2, partitioned=True)
    owners.update(blocks)
    assert owners.owners is not None and owners.owners[0] == 0 and owners.trained == {0}
    assert owners.stepped_by(0) == blocks[0] and owners.stepped_by(1) == []
    for p in blocks[2] + blocks[3]:
        p.requires_grad_(True)
    assert owners.update(blocks)  # the owners changed
    assert owners.owners[0] == 0 and {owners.owners[2], owners.owners[3]} == {0, 1} and owners.trained == {0, 2, 3}
    kept = owners.owners
    for p in blocks[2]:
        p.requires_grad_(False)
    assert not owners.update(blocks) and owners.owners == kept
    decided, mine = owners.state_ids(kept[2])
    assert {id(p) for p in blocks[2]} <= mine and not {id(p) for p in blocks[1]} & decided  # block 1: nobody's yet
    assert blocks[2][0] in owners.others(1 - kept[2]) and blocks[2][0] not in owners.stepped_by(kept[2])
    replicated = UnitOwners(2, partitioned=False)
    assert not replicated.update(blocks) and replicated.stepped_by(1) == blocks[0] + blocks[3]
    assert replicated.state_ids(0) == (set(), set()) and replicated.others(0) == []


def test_the_sync_takes_new_units_between_steps_only(group_of_one: dist.ProcessGroup) -> None:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2), requires_grad=False)
    sync = HostGradientSync([[a], [b]], SimpleNamespace(grads={}), group_of_one)
    try:
        b.requires_grad_(True)
        sync.set_units([[a], [b]])
        assert sync.units == [[a], [b]]
        with pytest.raises(ValueError, match=r"1 units given for the 2 this sync was made for"):
            sync.set_units([[a, b]])
    finally:
        sync.close()


def test_mean_keeps_no_gradient_where_no_rank_had_one(group_of_one: dist.ProcessGroup) -> None:
    a, b = nn.Parameter(torch.zeros(2, 3, dtype=torch.float64)), nn.Parameter(torch.zeros(4, dtype=torch.float64))
    grad = torch.arange(6.0, dtype=torch.float64).view(2, 3)
    pending = launch_mean([a, b], [grad, None], group_of_one, owner=0)
    (pa, ga), (pb, gb) = pending.result()
    assert pa is a and torch.equal(ga, grad) and pb is b and gb is None
    assert pending.nbytes == (6 + 4 + 2) * 8  # the values and one flag per parameter


def test_units_launch_in_descending_order_whatever_order_they_land(group_of_one: dist.ProcessGroup) -> None:
    params = [nn.Parameter(torch.zeros(3)) for _ in range(3)]
    grads = {p: torch.full((3,), float(i + 1)) for i, p in enumerate(params)}
    landed: list[int] = []
    sync = HostGradientSync([[p] for p in params], SimpleNamespace(grads=grads), group_of_one, owners=[0, 0, 0],
                            land=lambda ps: landed.append(next(i for i, p in enumerate(params) if p is ps[0])))
    sync.begin()
    sync.ready(0)  # unit 0 first: it must wait for units 2 and 1
    sync.ready(2)
    sync.drain()
    assert landed == [2]
    sync.flush()  # unit 1 never landed during the backward
    sync.wait()
    assert landed == [2, 1, 0]
    assert [float(grads[p][0]) for p in params] == [1.0, 2.0, 3.0]
    assert sync.bytes_reduced == 3 * (3 + 1) * 4
    sync.close()


def test_broadcast_units_from_their_owner(group_of_one: dist.ProcessGroup) -> None:
    a, b = torch.ones(2, 2), torch.zeros(3, dtype=torch.float64)
    received, nbytes = broadcast_units([[a, b], []], [0, 0], group_of_one)
    assert received == [] and nbytes == 7 * 8  # the owner receives nothing; one float64 buffer for the unit


def test_optimizer_state_shards_merge_under_plain_indices(group_of_one: dist.ProcessGroup) -> None:
    params = [nn.Parameter(torch.randn(3)) for _ in range(3)]
    opt = torch.optim.AdamW(params)
    for p in params[:2]:  # as on a partitioned rank: only the parameters with a gradient get state
        p.grad = torch.ones(3)
    opt.step()
    assert state_bytes(opt) == 2 * (2 * 3 * 4 + 4) and state_bytes(opt, params[1:]) == 2 * 3 * 4 + 4
    full = opt.state_dict()
    assert param_indices(opt) == {id(p): i for i, p in enumerate(params)}
    kept = keep_state(full, {1})
    assert list(kept["state"]) == [1] and kept["param_groups"] == full["param_groups"]
    merged = gather_state(kept, {1}, group_of_one)
    assert list(merged["state"]) == [1]


def test_an_optimizer_without_per_parameter_state_saves_and_loads_as_it_is(group_of_one: dist.ProcessGroup) -> None:
    """Lightning's stand-in when ``configure_optimizers`` returns None has ``state_dict() == {}`` on every rank: DDP
    checkpoints it, and so must the partitioned strategy (Lightning's test_none_optimizer found a KeyError here)."""
    from lightning.pytorch.core.optimizer import _MockOptimizer

    empty = _MockOptimizer().state_dict()
    assert gather_state(empty, {0}, group_of_one) == empty and keep_state(empty, {0}) == empty


def test_a_unit_reported_late_goes_last_in_the_order_given(group_of_one: dist.ProcessGroup) -> None:
    params = [nn.Parameter(torch.zeros(2)) for _ in range(3)]
    grads = {p: torch.ones(2) for p in params}
    landed: list[int] = []
    # units 0 and 1 are blocks (last first); unit 2 (a streamed resident unit) is never reported ready
    sync = HostGradientSync([[p] for p in params], SimpleNamespace(grads=grads), group_of_one, owners=None, order=[1, 0, 2],
                            land=lambda ps: landed.append(next(i for i, p in enumerate(params) if p is ps[0])))
    sync.begin()
    sync.ready(1)
    sync.ready(0)
    sync.drain()
    assert landed == [1, 0] and sync.launched_in_backward == 0
    sync.flush()
    assert sync.launched_in_backward == 2
    sync.wait()
    assert landed == [1, 0, 2]
    sync.close()
    with pytest.raises(ValueError, match=r"order \[0, 0\] must list each of the 2 unit indices once"):
        HostGradientSync([[params[0]], [params[1]]], SimpleNamespace(grads=grads), group_of_one, order=[0, 0])
