"""A gradient held in parts by different ranks: the whole norm, clipping by it, one overflow verdict.

DDP's ranks all hold the same averaged gradient, so Lightning's ``clip_grad_norm_`` and a
``GradScaler``'s found-inf check on one rank speak for all. Under the strategies that average
gradients themselves they do not: a pipeline rank holds its stages' gradients
(:class:`~lightning_accel.strategies.DistributedGPipeStrategy`), a partitioned L2L rank the
blocks it steps (:class:`~lightning_accel.strategies.L2LOffloadDDPStrategy`). These functions put
the parts together; both strategies use them, through
:class:`~lightning_accel.strategies.ddp_without_wrapper.DDPWithoutWrapper`.

Every rank of ``group`` calls each function, in the same order. ``device`` is where the partial
sums meet and the collective runs: the device of an nccl group, the CPU for gloo (host
gradients). No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["agree_found_inf", "clip_grad_norm_over", "grad_norm_over"]


@torch.no_grad()
def grad_norm_over(
    grads: Sequence[Tensor], counted: Sequence[bool], norm_type: float, group: dist.ProcessGroup | None, device: torch.device
) -> Tensor:
    """The ``norm_type``-norm of a gradient split across ``group`` (float64): the ``grads`` whose ``counted`` flag is set
    (each tensor counted on one rank: a tensor every rank holds alike, on one of them) from every rank, as
    ``torch.nn.utils.get_total_norm`` of the whole model's gradients."""
    inf = norm_type == float("inf")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g, count in zip(grads, counted):
        if count:  # each gradient reduced where it lives, the partial sums gathered on ``device``
            part = g.detach().double().abs()
            total = torch.maximum(total, part.max().to(device)) if inf else total + part.pow(norm_type).sum().to(device)
    dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    return total if inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_over(
    grads: Sequence[Tensor], counted: Sequence[bool], max_norm: float, group: dist.ProcessGroup | None, device: torch.device
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over a gradient split across ``group``: the 2-norm of :func:`grad_norm_over`,
    and every one of ``grads`` (counted here or not) is scaled by ``max_norm / (norm + 1e-6)`` where that is below 1, as
    torch does. The coefficient stays a tensor (no wait for the device). Returns the total norm (float64, on ``device``)."""
    norm = grad_norm_over(grads, counted, 2.0, group, device)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return norm


@torch.no_grad()
def agree_found_inf(flags: Iterable[Tensor], group: dist.ProcessGroup | None, device: torch.device) -> Tensor:
    """A ``GradScaler``'s found-inf flags on this rank (``found_inf_per_device`` of one optimizer, after ``unscale_``)
    become 1 on every rank of ``group`` if any rank found an overflow, else 0: each rank checked only the gradients it
    holds, and every rank must skip the step (and lower the scale) together, as DDP's ranks do on their common gradient.
    Every rank calls it, with or without flags. Returns the verdict (a bool tensor on ``device``; no wait for it)."""
    flags = list(flags)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for flag in flags:
        total += flag.detach().float().sum().to(device)
    dist.all_reduce(total, group=group)
    found = total > 0
    for flag in flags:
        flag.copy_(found.to(flag.dtype))
    return found
