"""Where a split model's tensors live across a pipeline's ranks, and how they get there.

Each parameter and buffer of a block belongs to the rank of its stage; everything outside
the blocks is on every rank (``shared``). At setup every rank starts from global rank 0's
weights: :func:`send_initial_weights` sends each stage's tensors from the pipeline's first
rank to their owner only, then over the data-parallel replicas. :func:`keep_own_parameters`
gives an optimizer only this rank's parameters and remembers where they sat in the whole
model's optimizer (what :mod:`lightning_accel.pipeline.state_gather` gathers under).
:func:`owners` says which rank holds each tensor; :func:`check_split` refuses a second split
of a module (after ``fit`` it stays split) for another layout. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_accel.pipeline.partition import check_balance, stage_of_block
from lightning_accel.pipeline.schedule import stage_rank
from lightning_accel.stored import plain_parts

__all__ = ["RankLayout", "broadcast_shared", "check_split", "keep_own_parameters", "owners", "send_initial_weights"]


@dataclass(frozen=True)
class RankLayout:
    """This rank on the ``("pp", "dp")`` mesh: its coordinates, the sizes, the two groups, and its device."""

    pp_rank: int
    dp_rank: int
    pp_size: int
    dp_size: int
    pp_group: Any
    dp_group: Any
    device: torch.device

    def pp_global(self, pp_rank: int) -> int:
        """The global rank of ``pp_rank`` in this rank's pipeline."""
        return pp_rank * self.dp_size + self.dp_rank


@torch.no_grad()
def send_initial_weights(tensors: Sequence[Tensor], owners: Sequence[int], shared: Sequence[bool], layout: RankLayout) -> None:
    """Every rank starts from rank 0's weights: in each pipeline, each stage's tensors go from its first rank to their
    owner only (``shared`` ones to every rank); then each stage's rank in replica 0 broadcasts them over the replicas."""
    first = layout.pp_global(0)
    parts = _plain(tensors, owners, shared)
    for t, owner, everywhere in parts:
        if everywhere:
            buf = t.to(layout.device)
            dist.broadcast(buf, src=first, group=layout.pp_group)
            t.copy_(buf)
        elif owner != 0 and layout.pp_rank in (0, owner):
            buf = t.to(layout.device)
            if layout.pp_rank == 0:
                dist.send(buf, dst=layout.pp_global(owner), group=layout.pp_group)
            else:
                dist.recv(buf, src=first, group=layout.pp_group)
                t.copy_(buf)
    if layout.dp_size == 1:
        return
    dp_root = dist.get_global_rank(layout.dp_group, 0)
    for t, owner, everywhere in parts:
        if everywhere or owner == layout.pp_rank:
            buf = t.to(layout.device)
            dist.broadcast(buf, src=dp_root, group=layout.dp_group)
            if layout.dp_rank:
                t.copy_(buf)


def _plain(tensors: Sequence[Tensor], owners: Sequence[int], shared: Sequence[bool]) -> list[tuple[Tensor, int, bool]]:
    """``(tensor, owner, shared)`` per plain tensor holding the data: a tensor subclass (a frozen NF4 weight) goes as
    its codes and scalers, since sending it dequantized would re-quantize it (:mod:`lightning_accel.stored`)."""
    return [(part, owner, everywhere) for t, owner, everywhere in zip(tensors, owners, shared) for part in plain_parts(t.data)]


@torch.no_grad()
def broadcast_shared(tensors: Sequence[Tensor], owners: Sequence[int], shared: Sequence[bool], layout: RankLayout) -> None:
    """The ``shared`` tensors (on every rank) take their owner's values (through the device: after teardown the module
    is on the CPU, which nccl cannot send)."""
    for tensor, owner, everywhere in _plain(tensors, owners, shared):
        if everywhere:
            buf = tensor.to(layout.device)
            dist.broadcast(buf, src=layout.pp_global(owner), group=layout.pp_group)
            tensor.copy_(buf)


def keep_own_parameters(
    optimizer: Optimizer, owner_of: Mapping[int, tuple[int, bool]], pp_rank: int, default: tuple[int, bool],
    start: int = 0, offset: int = 0,
) -> tuple[list[list[int]], list[int]]:
    """Leave in ``optimizer``'s param groups from ``start`` on only the parameters this rank trains (owned by
    ``pp_rank``, or shared); ``owner_of``: parameter id -> (owner, shared), ``default`` for a parameter not in it.
    Returns those groups' indices in the whole model's optimizer (counted from ``offset``, the parameters of the groups
    before ``start``), and this rank's among them."""
    full: list[list[int]] = []
    kept: list[int] = []
    for group in optimizer.param_groups[start:]:
        params = group["params"]
        full.append(list(range(offset, offset + len(params))))
        mine = [owner_of.get(id(p), default)[0] == pp_rank or owner_of.get(id(p), default)[1] for p in params]
        kept.extend(offset + j for j, m in enumerate(mine) if m)
        offset += len(params)
        for p, m in zip(params, mine):
            if not m:
                optimizer.state.pop(p, None)  # an optimizer that made state eagerly
        group["params"] = [p for p, m in zip(params, mine) if m]
    return full, kept


def owners(
    tensors: Sequence[Tensor], blocks: Sequence[nn.Module], balance: Sequence[int], ranks: int, schedule: str = "gpipe"
) -> tuple[list[int], list[bool]]:
    """Per tensor of ``tensors``: the pipeline rank whose stage trains it, and whether it is outside every block (on
    every rank; its owner is then the last stage's rank). ``blocks`` in order, split by ``balance`` over ``ranks``
    ranks (stage ``s`` on rank :func:`~lightning_accel.pipeline.schedule.stage_rank` under ``schedule``: ``s % ranks``,
    or V-wise for ``zbv`` and ``dualpipev``)."""
    stage_of: dict[int, int] = {}
    for k, s in enumerate(stage_of_block(balance)):
        for t in [*blocks[k].parameters(), *blocks[k].buffers()]:
            stage_of.setdefault(id(t), s)
    last = len(balance) - 1
    return [stage_rank(stage_of.get(id(t), last), ranks, schedule) for t in tensors], [id(t) not in stage_of for t in tensors]


def check_split(
    previous: tuple[int, str, tuple[int, ...]] | None,
    ranks: int,
    placement: str,
    schedule: str,
    requested: Sequence[int] | str,
    stages: int,
    num_blocks: int,
    choose: Callable[[], list[int]],
) -> list[int]:
    """The balance of this split: ``previous`` (``(ranks, placement, balance)`` of an earlier split of the same module,
    which must match; ``placement``: :attr:`~lightning_accel.pipeline.schedule.ScheduleSpec.placement`) or ``choose()``;
    checked against ``stages`` and ``num_blocks`` before any weights move."""
    if num_blocks < stages:
        raise ValueError(
            f"schedule {schedule!r} on {ranks} ranks runs {stages} stages ({stages // ranks} per rank) but the model has "
            f"{num_blocks} blocks; give it at least {stages} blocks, run fewer ranks, or choose a schedule with one stage "
            "per rank ('1f1b')"
        )
    balance = choose() if previous is None else list(previous[2])
    if previous is not None and previous != (ranks, placement, tuple(balance)):
        raise ValueError(
            f"this module was split for {previous[0]} ranks with balance {list(previous[2])} by an earlier run; it "
            f"cannot be split again for {ranks} ranks and schedule {schedule!r}; build a fresh model "
            "and load the checkpoint into it"
        )
    if not isinstance(requested, str) and previous is not None and list(requested) != balance:
        raise ValueError(f"balance {list(requested)} differs from {balance}, the split of this module by an earlier run")
    if len(balance) != stages:
        raise ValueError(
            f"schedule {schedule!r} on {ranks} ranks runs {stages} stages but balance has {len(balance)} "
            f"({balance}); give {stages} entries"
        )
    check_balance(balance, num_blocks, stages)
    return balance
