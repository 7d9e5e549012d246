"""Gradients across ranks: the replicas' mean, the pipeline's sum, clipping by the whole model's norm, one overflow verdict.

The pipeline's ranks each hold part of a model; what plain training computes on one
model's gradients (DDP's mean over replicas, ``clip_grad_norm_``, a ``GradScaler``'s
found-inf check) needs the ranks' parts put together. Each function takes this rank's
tensors and the process group(s), and every rank of the group calls it with the same
parameters in the same order. :func:`set_aside` and :func:`add_gradients` hold a pipeline
step's gradients back until the trainer's own backward adds them. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["add_gradients", "agree_found_inf", "average_gradients", "clip_grad_norm_over", "set_aside", "sum_gradients"]


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
def sum_gradients(params: Sequence[Tensor], group: dist.ProcessGroup | None) -> None:
    """Each gradient becomes its sum over ``group``; a parameter with no gradient on any rank keeps none (as in plain
    training, where an optimizer then skips it). Every rank passes the same parameters, in the same order."""
    if not params or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    present = torch.tensor([float(p.grad is not None) for p in params], device=grads[0].device)
    dist.all_reduce(present, group=group)
    by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, g in enumerate(grads):
        by_kind.setdefault((g.dtype, g.device), []).append(i)
    for indices in by_kind.values():  # one all-reduce per dtype and device
        flat = torch.cat([grads[i].reshape(-1) for i in indices])
        dist.all_reduce(flat, group=group)
        offset = 0
        for i in indices:
            grads[i].copy_(flat[offset : offset + grads[i].numel()].view_as(grads[i]))
            offset += grads[i].numel()
    for p, g, anywhere in zip(params, grads, present.tolist()):
        p.grad = g if anywhere else None


@torch.no_grad()
def clip_grad_norm_over(
    grads: Sequence[Tensor], counted: Sequence[bool], clip_val: float, group: dist.ProcessGroup | None, device: torch.device
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over a model split across ``group``: the squared norms of ``grads`` whose
    ``counted`` flag is set (each tensor counted on one rank: a tensor every rank holds alike, on one of them) are
    summed over the group, and every gradient is scaled by ``clip_val / (norm + 1e-6)`` where that is below 1.
    Returns the total norm."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for g, count in zip(grads, counted):
        if count:
            squares += g.detach().double().pow(2).sum()
    dist.all_reduce(squares, group=group)
    norm = squares.sqrt()
    coef = torch.clamp(clip_val / (norm + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return norm


@torch.no_grad()
def agree_found_inf(found_per_device: Mapping[torch.device, Tensor], device: torch.device) -> None:
    """A ``GradScaler``'s found-inf flags of one optimizer (after ``unscale_``) become 1 on every rank if any rank's
    part overflowed: every rank then skips the step and lowers the scale together (default group: every rank)."""
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for f in found_per_device.values():
        flag += f.to(flag.device)
    dist.all_reduce(flag)
    for f in found_per_device.values():
        f.copy_((flag > 0).to(f.dtype))


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
