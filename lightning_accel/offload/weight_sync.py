"""Host weights across data-parallel ranks: each unit's masters from the rank that holds them current.

With the host optimizer partitioned (:mod:`.partition`), only a unit's owner steps it; the
others must compute the next step on the same weights, so after the step every unit's fp32
masters go from their owner to every rank, one broadcast per unit, all in flight at once (the
same call sends the starting weights from rank 0 at setup, as DDP does). The masters are
sent, not the low-precision shadows, so every rank holds the same fp32 weights and a
checkpoint written by any rank is the trained model; each rank re-derives its shadows. Nothing
here imports Lightning.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


@torch.no_grad()
def broadcast_units(units: Sequence[Sequence[Tensor]], owners: Sequence[int], group: dist.ProcessGroup | None) -> tuple[list[int], int]:
    """Overwrite each unit's tensors on every rank of ``group`` with its owner's (``owners[i]``, a rank
    of ``group``). Returns the units this rank received and the payload bytes of the broadcasts."""
    rank = dist.get_rank(group)
    launched: list[tuple[int, Tensor, dist.Work | None]] = []
    nbytes = 0
    for index, tensors in enumerate(units):
        if not tensors:
            continue
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
        if owners[index] == rank:
            flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])
        else:
            flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
        src = dist.get_global_rank(group, owners[index])
        launched.append((index, flat, dist.broadcast(flat, src=src, group=group, async_op=True)))
        nbytes += flat.numel() * flat.element_size()
    received = []
    for index, flat, work in launched:
        if work is not None:
            work.wait()
        if owners[index] == rank:
            continue
        offset = 0
        for tensor in units[index]:
            tensor.copy_(flat[offset : offset + tensor.numel()].view(tensor.shape))
            offset += tensor.numel()
        received.append(index)
    return received, nbytes
