"""Host gradients across data-parallel ranks: each unit's mean, launched as its backward finishes.

``DistributedDataParallel`` all-reduces gradient buckets while the backward pass still
computes the earlier layers. Under L2L offload the gradients land in host memory one unit
(block) at a time, last block first; :class:`HostGradientSync` launches a unit's collective
as soon as its last gradient has landed, on a worker thread (which on CUDA first waits for
that unit's device-to-host copies), so the reduction of block i overlaps the backward of the
blocks before it. :meth:`HostGradientSync.wait` joins them before the optimizer step.

- Replicated (no ``owners``): each unit's gradients are all-reduced; every rank keeps all of
  them and steps every parameter, as DDP does.
- Partitioned (``owners[i]`` steps unit ``i``, :mod:`.partition`): a unit's gradients are
  reduced to its owner only (a reduce-scatter at unit granularity, which gloo can run), and
  the other ranks drop theirs once sent.

Either way the result is the mean over ranks, divided before the sum as DDP's default hook
does; a parameter no rank produced a gradient for keeps none (a flag per parameter rides in
the same buffer), so the optimizer skips it as plain training would.

Ordering: every rank must issue the same collectives in the same order. The worker is the only
thread using the group handed in (give it one of its own), and units are launched in one fixed
order (``order``; default: descending index, the backward's): a unit waits until every unit
before it in that order has been launched, and units whose gradients never all landed (a
parameter unused this step, a unit the executor does not report) go at :meth:`flush`, after
the backward. Nothing here imports Lightning.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass
class PendingMean:
    """One launched collective: the flat buffer it writes, for ``params``; see :func:`launch_mean`."""

    params: list[nn.Parameter]
    flat: Tensor
    work: dist.Work | None
    receives: bool  # this rank gets the result (all-reduce, or the reduce's owner)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def result(self) -> list[tuple[nn.Parameter, Tensor | None]]:
        """Wait, then each parameter's mean gradient (a view of the buffer, in its own dtype),
        or None where no rank had one; ``[]`` on a rank that does not receive."""
        if self.work is not None:
            self.work.wait()
        if not self.receives:
            return []
        out: list[tuple[nn.Parameter, Tensor | None]] = []
        offset, flags = 0, self.flat[-len(self.params):]
        for param, present in zip(self.params, flags.tolist()):
            n = param.numel()
            grad = self.flat[offset : offset + n].view(param.shape) if present else None
            out.append((param, grad if grad is None or grad.dtype == param.dtype else grad.to(param.dtype)))
            offset += n
        return out


@torch.no_grad()
def launch_mean(params: Sequence[nn.Parameter], grads: Sequence[Tensor | None], group: dist.ProcessGroup | None,
                owner: int | None = None) -> PendingMean:
    """Start averaging ``grads`` (one per parameter, None where this rank has none) over ``group``:
    an all-reduce, or with ``owner`` (a rank of ``group``) a reduce to that rank. Returns at once."""
    world = dist.get_world_size(group)
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in params])
    device = next((g.device for g in grads if g is not None), params[0].device)
    parts = [g.reshape(-1) if g is not None else torch.zeros(p.numel(), dtype=dtype, device=device) for p, g in zip(params, grads)]
    flags = torch.tensor([float(g is not None) for g in grads], dtype=dtype, device=device)
    flat = torch.cat([*parts, flags])
    flat[: -len(params)].div_(world)  # DDP divides before the sum; the flags count the ranks that had one
    if owner is None:
        work = dist.all_reduce(flat, group=group, async_op=True)
        return PendingMean(list(params), flat, work, True)
    work = dist.reduce(flat, dst=dist.get_global_rank(group, owner), group=group, async_op=True)
    return PendingMean(list(params), flat, work, dist.get_rank(group) == owner)


class HostGradientSync:
    """Averages each unit's host gradients over a group as the backward pass finishes the unit.

    Args:
        units: the parameters of each unit, by unit index (the executor's block order).
        store: holds the host gradient buffers as ``store.grads`` (a :class:`~.host_store.HostStore`);
            a unit's entries are taken out when its collective launches and the means put back by
            :meth:`wait`. Read through ``store`` each time: the delayed update swaps the dict.
        group: the process group (one only this object's worker uses).
        owners: partitioned: the rank of ``group`` that steps each unit; None: replicated.
        land: called on the worker with a unit's parameters before reading their gradients
            (the streamer's ``finish_grads``, which waits for in-flight device copies).
        order: the unit indices in launch order (default: last unit first).
    """

    def __init__(self, units: Sequence[Sequence[nn.Parameter]], store: Any, group: dist.ProcessGroup | None,
                 owners: Sequence[int] | None = None, land: Callable[[list[nn.Parameter]], None] | None = None,
                 init_worker: Callable[[], None] | None = None, order: Sequence[int] | None = None) -> None:
        self.units = [[p for p in unit if p.requires_grad] for unit in units]
        self.order = list(range(len(self.units) - 1, -1, -1)) if order is None else list(order)
        if sorted(self.order) != list(range(len(self.units))):
            raise ValueError(f"order {self.order} must list each of the {len(self.units)} unit indices once")
        self.store = store
        self.group = group
        self.owners = None if owners is None else list(owners)
        self.land = land
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l2l-grad-sync", initializer=init_worker)
        self._launched: dict[int, Future[PendingMean]] = {}
        self._ready: set[int] = set()
        self._next = len(self.order)  # nothing to launch before begin()
        self.bytes_reduced = 0  # payload of the last synchronised backward's collectives
        self.launched_in_backward = 0  # of those, launched while the backward pass was still running

    def set_units(self, units: Sequence[Sequence[nn.Parameter]], owners: Sequence[int] | None = None) -> None:
        """Between steps: the units' parameters that require grad, and their owners, changed (a backbone unfrozen at
        an epoch's start; the number of units and their order stay). Nothing may be in flight."""
        if self._launched:
            raise RuntimeError("HostGradientSync.set_units during a backward pass: its collectives are still in flight")
        if len(units) != len(self.units):
            raise ValueError(f"{len(units)} units given for the {len(self.units)} this sync was made for")
        self.units = [[p for p in unit if p.requires_grad] for unit in units]
        self.owners = None if owners is None else list(owners)

    def begin(self) -> None:
        """Before a backward pass whose gradients are to be averaged (the last of an accumulation)."""
        self._ready.clear()
        self._launched.clear()
        self._next = 0  # position in ``order`` of the next unit to launch
        self.bytes_reduced = 0

    def ready(self, index: int) -> None:
        """Unit ``index``'s gradients have all landed (main thread, during backward)."""
        self._ready.add(index)
        while self._next < len(self.order) and self.order[self._next] in self._ready:
            self._launch(self.order[self._next])
            self._next += 1

    def flush(self) -> None:
        """After the backward pass: launch every unit not launched yet, in order."""
        self.launched_in_backward = len(self._launched)
        while self._next < len(self.order):
            self._launch(self.order[self._next])
            self._next += 1

    def drain(self) -> None:
        """Wait until every launch handed to the worker has been issued (before the main
        thread lands the remaining gradients itself)."""
        for future in self._launched.values():
            future.result()

    def wait(self) -> None:
        """Join every collective; the means go back into ``grads`` on the ranks that step them."""
        for index in [i for i in self.order if i in self._launched]:
            pending = self._launched[index].result()
            self.bytes_reduced += pending.nbytes
            for param, grad in pending.result():
                if grad is not None:
                    self.store.grads[param] = grad
        self._launched.clear()

    def _launch(self, index: int) -> None:
        if self.units[index]:
            self._launched[index] = self._pool.submit(self._reduce, index)

    def _reduce(self, index: int) -> PendingMean:
        params = self.units[index]
        if self.land is not None:
            self.land(params)
        grads = [self.store.grads.pop(p, None) for p in params]
        owner = None if self.owners is None else self.owners[index]
        return launch_mean(params, grads, self.group, owner)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
