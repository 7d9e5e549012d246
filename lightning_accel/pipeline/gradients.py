"""A pipeline's gradients across ranks: the replicas' mean, the sum between a shared weight's users, held back a step.

The pipeline's ranks each hold part of a model; what plain training computes on one
model's gradients (DDP's mean over replicas) needs the ranks' parts put together. Each
collective takes this rank's tensors and the process group(s), and every rank of the group
calls it with the same parameters in the same order. :func:`set_aside` and
:func:`add_gradients` hold a pipeline step's gradients back until the trainer's own backward
adds them. The whole model's norm, clipping by it and the found-inf verdict are
:mod:`lightning_accel.comm.gradients` (shared with L2L's data parallel). No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "add_gradients",
    "average_gradients",
    "gradient_presence",
    "set_aside",
    "sum_over_users",
]


@torch.no_grad()
def average_gradients(params: Sequence[Tensor], group: dist.ProcessGroup | None, bucket_bytes: int = 25 * 2**20) -> None:
    """Replace each gradient by its mean over ``group`` (the data-parallel replicas), as ``DistributedDataParallel`` does.

    Gradients go in flat buckets of one dtype and device, at most ``bucket_bytes`` each (one
    all-reduce per bucket, not per tensor). Every rank of ``group`` must pass the same
    parameters, with a gradient on the same ones (the same stage, in every replica).
    """
    size = dist.get_world_size(group)
    if size == 1:
        return
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[Tensor], int]] = {}
    buckets: list[list[Tensor]] = []
    for g in (p.grad for p in params if p.grad is not None):
        bucket, nbytes = open_buckets.get((g.dtype, g.device), ([], 0))
        if not bucket or nbytes + g.nbytes > bucket_bytes:
            bucket, nbytes = [], 0
            buckets.append(bucket)
        bucket.append(g)
        open_buckets[(g.dtype, g.device)] = (bucket, nbytes + g.nbytes)
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)  # SUM, then divide: gloo has no AVG
        flat.div_(size)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


@torch.no_grad()
def gradient_presence(params: Sequence[Tensor], group: dist.ProcessGroup | None) -> list[list[bool]]:
    """Per rank of ``group`` (group ranks, in order), per parameter: whether that rank holds a gradient of it. Every rank
    passes the same parameters, in the same order (one small all-gather)."""
    mine = [p.grad is not None for p in params]
    if not params or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [mine]
    present = torch.tensor(mine, dtype=torch.float32, device=params[0].device)
    every = [torch.empty_like(present) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, present, group=group)
    return [[bool(v) for v in t.tolist()] for t in every]


@torch.no_grad()
def sum_over_users(
    params: Sequence[Tensor], users: Sequence[tuple[int, ...]], rank: int, group: dist.ProcessGroup | None
) -> int:
    """Each gradient of a parameter with more than one user becomes its sum over exactly those ranks of ``group``
    (``users``: per parameter, the group ranks whose forward used it, ascending; a user without a gradient this step
    adds zeros). A parameter with one user (or none) is left alone: nothing to add. Returns the bytes this rank put
    into sums.

    Why not an all-reduce of every parameter outside the blocks over the whole pipeline: an untied embedding is used by the first stage only, the
    head by the last, so summing them moves vocab x hidden gradients that are zero on every other rank (Megatron sums
    only the word embedding its first and last stage share). Parameters with the same users go in one flat buffer
    per dtype and device: an all-reduce when every rank of ``group`` uses them, else a reduction on the first user,
    in user order, sent back to the others (the same values on every user)."""
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    by_users: dict[tuple[int, ...], dict[tuple[torch.dtype, torch.device], list[int]]] = {}
    for i, (p, who) in enumerate(zip(params, users)):
        if len(who) > 1 and rank in who:
            by_users.setdefault(tuple(who), {}).setdefault((p.dtype, p.device), []).append(i)
    summed = 0
    for who in sorted(by_users):  # every rank walks the same sets in the same order
        for indices in by_users[who].values():
            for i in indices:
                if params[i].grad is None:
                    params[i].grad = torch.zeros_like(params[i])
            grads = [params[i].grad for i in indices]
            flat = torch.cat([g.reshape(-1) for g in grads])  # type: ignore[union-attr]
            if len(who) == size:
                dist.all_reduce(flat, group=group)
            else:
                _sum_between(flat, who, rank, group)
            offset = 0
            for g in grads:
                assert g is not None
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            summed += flat.nbytes
    return summed


def _sum_between(flat: Tensor, users: tuple[int, ...], rank: int, group: dist.ProcessGroup | None) -> None:
    """``flat`` becomes its sum over ``users`` (group ranks): added up on the first, in order, and sent back."""

    def glob(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    root = users[0]
    if rank == root:
        incoming = torch.empty_like(flat)
        for r in users[1:]:
            dist.recv(incoming, src=glob(r), group=group)
            flat.add_(incoming)
        for r in users[1:]:
            dist.send(flat, dst=glob(r), group=group)
    else:
        dist.send(flat, dst=glob(root), group=group)
        dist.recv(flat, src=glob(root), group=group)


@contextmanager
def set_aside(params: Sequence[Tensor]) -> Iterator[list[Tensor | None]]:
    """Inside the block ``params`` start without gradients; afterwards they get their earlier ones back, and the yielded
    list holds what the block computed (a schedule that runs backward itself, before the trainer's backward: gradients
    accumulated over earlier batches must not be rescaled by it)."""
    earlier = [p.grad for p in params]
    for p in params:
        p.grad = None
    computed: list[Tensor | None] = []
    try:
        yield computed
    finally:
        computed[:] = [p.grad for p in params]
        for p, g in zip(params, earlier):
            p.grad = g


@torch.no_grad()
def add_gradients(params: Sequence[Tensor], grads: Sequence[Tensor | None], divide_by: int = 1) -> None:
    """Add ``grads`` (divided by ``divide_by``: gradient accumulation's scaling) to the gradients of ``params``."""
    for p, g in zip(params, grads):
        if g is None:
            continue
        g = g / divide_by if divide_by != 1 else g
        p.grad = g if p.grad is None else p.grad + g
