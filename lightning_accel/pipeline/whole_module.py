"""The whole module on every rank of a pipeline, as after DDP: each stage's tensors sent by the rank that holds them.

While a split module trains, each rank holds its own stages' blocks and the others' as ``meta`` placeholders
(:mod:`lightning_accel.pipeline.placeholders`). Scripts that evaluate, export or inspect the model on every rank after
``fit`` rely on what DDP leaves: the trained module, whole, on every rank. :func:`gather_whole_module` gives it: every
block tensor is broadcast from its stage's rank over the pipeline's group (one tensor at a time, so no rank holds more
than the model and one tensor in flight), and each rank puts the values into its placeholders on the CPU, keeping the
module's own tensor objects where it holds them and tying what was tied. It is done only when it fits: the ranks of each
host together need the placeholders' bytes, which must fit the free host memory (:func:`fits_every_host`); where they
do not, nothing moves and each rank learns how many bytes it would have needed. No Lightning here.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_accel.pipeline.placement import RankLayout
from lightning_accel.stored import is_plain, plain_parts, stored_nbytes

__all__ = ["fits_every_host", "gather_whole_module", "placeholder_bytes"]


def placeholder_bytes(tensors: Sequence[Tensor]) -> int:
    """The bytes the ``meta`` placeholders among ``tensors`` take once filled (as stored: an NF4 weight's codes and
    scalers)."""
    return sum(stored_nbytes(t) for t in tensors if t.is_meta)


def fits_every_host(needed: int, available: int | None) -> bool:
    """Whether every host's ranks together fit the bytes they need (``needed``, this rank's) in its free memory
    (``available``, as this rank sees it; None: unknown, taken to fit). A collective over every rank; all get the same
    answer."""
    views: list[tuple[str, int, int | None]] = [("", 0, None)] * dist.get_world_size()
    dist.all_gather_object(views, (socket.gethostname(), needed, available))
    for host in {h for h, _, _ in views}:
        on_host = [(n, a) for h, n, a in views if h == host]
        known = [a for _, a in on_host if a is not None]
        if known and sum(n for n, _ in on_host) > min(known):
            return False
    return True


@torch.no_grad()
def gather_whole_module(
    module: nn.Module, tensors: Sequence[Tensor], owners: Sequence[int], shared: Sequence[bool], layout: RankLayout
) -> None:
    """Fill ``module``'s placeholders with their stage's values, on the CPU. ``tensors``: every parameter and buffer of
    the module in the order all ranks share, with the pipeline rank that holds each (``owners``) and whether it is
    outside the blocks, on every rank already (``shared``; skipped). Every rank of the pipeline calls it."""
    values: dict[int, Tensor] = {}
    for t, owner, everywhere in zip(tensors, owners, shared):
        if everywhere:
            continue
        received = []
        for part in plain_parts(t.detach()):  # a tensor subclass (a frozen NF4 weight) as its plain codes and scalers
            if layout.pp_rank == owner:
                buf = part.to(layout.device)
            else:
                buf = torch.empty(part.shape, dtype=part.dtype, device=layout.device)
            dist.broadcast(buf, src=layout.pp_global(owner), group=layout.pp_group)
            received.append(buf.cpu())
        if t.is_meta:
            values[id(t)] = _rebuilt(t.detach(), iter(received))
    _fill(module, values)


def _rebuilt(placeholder: Tensor, parts: Iterator[Tensor]) -> Tensor:
    """The tensor ``placeholder`` stands for, from its plain parts in :func:`~lightning_accel.stored.plain_parts`'s
    order (a wrapper subclass rebuilt through its ``__tensor_unflatten__``, the protocol its flattening follows)."""
    if is_plain(placeholder):
        return next(parts)
    names, context = placeholder.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {name: _rebuilt(getattr(placeholder, name), parts) for name in names}
    return type(placeholder).__tensor_unflatten__(inner, context, placeholder.size(), placeholder.stride())  # type: ignore[attr-defined]


def _fill(module: nn.Module, values: dict[int, Tensor]) -> None:
    """Replace each placeholder (by id) with its value; a placeholder two modules share gets one tensor in both."""
    made: dict[int, Tensor] = {}
    for sub in module.modules():
        for key, p in sub._parameters.items():
            if p is not None and id(p) in values:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(values[id(p)], requires_grad=p.requires_grad)
                sub._parameters[key] = made[id(p)]  # type: ignore[assignment]
        for key, b in sub._buffers.items():
            if b is not None and id(b) in values:
                sub._buffers[key] = made.setdefault(id(b), values[id(b)])
