"""Streaming units' weights to the device and their gradients back, on a copy stream.

On CUDA every host-to-device weight copy and device-to-host gradient copy runs on a
dedicated copy stream through pinned memory; events order it against the compute stream,
so the copy of block i+1 overlaps the compute of block i. What is pinned is bounded by what
is in flight: weights in pageable memory cross a ring of a few pinned buffers
(:class:`.staging.CopyRing`), gradients land in another (:class:`.staging.GradRing`), each
slot at most the tier's chunk (or the largest parameter); weights the tier read into its own
pinned buffers are copied from there. The CUDA-only operations come from
:mod:`.device_memory`, whose stand-in runs this same path on the CPU device (tests). Device tensors made on the copy
stream are ``record_stream``-ed on the compute stream, so the caching allocator does not
hand their memory out again while a kernel still reads it.

When the "device" is the host itself and the compute dtype is fp32 (CPU runs, CI), a
device copy would be a pointless clone: units are then *aliased* (the module computes on
the masters directly) and only the bookkeeping runs, so the mechanism stays testable
without a cost that a real device would not have. Under the delayed update the store keeps
a separate compute snapshot (shadow) of every parameter; an aliased unit then computes on
its shadows (swapped in, not copied) while the host optimizer rewrites the masters.

Where the NVMe tier put a unit's fp32 masters on disk and the compute runs on them
(:mod:`.tier_weights`, ``Streamer.disk``), a prefetch starts their read from the file into one of the
tier's weight buffers and the acquire takes the buffer's views: the aliased unit computes on them,
a copied one (CUDA) is copied from them, and its buffer is given back once the copy has finished.

Each unit's move carries a ``torch.profiler.record_function`` label, so a profiler
(``Trainer(profiler="pytorch")``) attributes a step's time: ``l2l/fetch`` (a unit's weights
prefetched or acquired, waits included), ``l2l/copy`` (its copies, inside the fetch),
``l2l/release`` and ``l2l/grad_to_host``. Labels go per unit, not per parameter (one costs
~4 us with no profiler running), except the gradients, which autograd hands over one
parameter at a time: theirs is made only while a profiler runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd import profiler as autograd_profiler
from torch.profiler import record_function

from lightning_accel.offload.device_memory import for_device
from lightning_accel.offload.host_store import HostStore
from lightning_accel.offload.staging import DEFAULT_SLOT, CopyRing, GradRing
from lightning_accel.offload.plan import Unit
from lightning_accel.offload.stats import OffloadStats
from lightning_accel.offload.tier_weights import WeightReads
from lightning_accel.stored import is_plain, record_stream, stored_nbytes, to_device


@dataclass
class _OnDevice:
    params: dict[nn.Parameter, Tensor]
    buffers: dict[tuple[int, str], tuple[Tensor, Tensor]]  # (host tensor, device copy)
    ready: torch.cuda.Event | None = None
    nbytes: int = 0
    swapped: bool = False
    from_disk: bool = False  # its masters are read from the tier's files (Streamer.disk): copied or aliased at acquire


class Streamer:
    """Moves units between the host store and the device, and counts what it moved."""

    def __init__(self, store: HostStore, device: torch.device, stats: OffloadStats, alias: bool = True) -> None:
        self.store = store
        self.device = device
        self.stats = stats
        self.cuda = device.type == "cuda"
        self.memory = for_device(device)  # pinning, the copy stream, events (:mod:`.device_memory`)
        # weights and gradients cross the pinned rings (a GPU, or its stand-in on the CPU device)
        self.staged = self.memory.staged
        # alias=False forces real copies even host-to-host (tests of the copy path on CPU)
        self.alias = alias and device.type == "cpu" and store.compute_dtype == torch.float32 and not self.staged
        self.copy_stream = self.memory.new_stream()
        self.on_device: dict[int, _OnDevice] = {}
        self._device_bytes = 0
        slot = self._largest_slot(DEFAULT_SLOT)
        self.grad_ring = GradRing(self.memory, self._land, lambda param: param in store.grads, slot_bytes=slot)
        self.copy_ring = CopyRing(self.memory, slot_bytes=slot)
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA copy intervals
        self.disk: WeightReads | None = None  # the NVMe tier's reads of masters on disk, for the units it covers
        self.disk_keys: dict[int, int] = {}  # this streamer's unit index -> the tier's, where they differ (the resident unit)

    # -- weights, host -> device ------------------------------------------------------
    def prefetch(self, index: int, unit: Unit) -> None:
        """Start copying ``unit``'s weights to the device (no-op if already there)."""
        if index in self.on_device:
            return
        with record_function("l2l/fetch"):
            self._prefetch(index, unit)

    def _prefetch(self, index: int, unit: Unit) -> None:
        if self.disk is not None and self.disk.covers(self.disk_keys.get(index, index)):
            # the read starts now; the copy (or the aliasing) waits for it at acquire, not here: a prefetch must not
            # hold the compute of the block before it
            self.disk.start(self.disk_keys.get(index, index))
            self.on_device[index] = _OnDevice({}, {}, from_disk=True)
            self._track_peak()
            return
        if self.alias:
            # no copy: compute on the host tensors, on the snapshots where the store keeps them
            snapshots = {p: self.store.shadow[p] for _, p in unit.params if self.store.shadow[p] is not self.store.master[p]}
            self.on_device[index] = _OnDevice(snapshots, {})
            self._track_peak()
            return
        self.on_device[index] = self._copy(unit, {})
        self._track_peak()

    def _copy(self, unit: Unit, sources: dict[nn.Parameter, Tensor]) -> _OnDevice:
        """Start copying ``unit``'s weights to the device, from ``sources`` where given (else the store's shadows)."""
        started = time.perf_counter()
        params: dict[nn.Parameter, Tensor] = {}
        buffers: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
        nbytes = 0
        with self.memory.on(self.copy_stream), record_function("l2l/copy"):
            start = self._timing_event()
            for _, param in unit.params:
                src = sources.get(param, self.store.shadow[param])
                if param in self.store.frozen and not self.staged:
                    if param in sources:  # read from the tier's file: compute on the buffer it was read into
                        params[param] = src
                    continue  # the host is the device: compute on the stored tensor itself
                if self.staged and param not in sources and is_plain(src):  # pageable: through the pinned ring
                    dst = self.copy_ring.to_device(src, self.device, self.copy_stream)
                else:  # from the tier's pinned buffers; a quantized subclass (its own .to: waits for pageable parts)
                    dst = to_device(src, self.device, non_blocking=self.cuda and param in sources)
                params[param] = dst
                nbytes += stored_nbytes(dst)
            for owner, name, _ in unit.buffers:
                buf = owner._buffers[name]
                if buf is not None:
                    buffers[(id(owner), name)] = (buf, buf.to(self.device, non_blocking=self.cuda))
            ready = self._timing_event()
            if ready is not None and start is not None:
                self._timed.append((start, ready))
        self.stats.h2d_bytes += nbytes
        if not self.cuda:
            self.stats.copy_seconds += time.perf_counter() - started
        self._device_bytes += nbytes
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self._device_bytes)
        return _OnDevice(params, buffers, ready, nbytes)

    def acquire(self, index: int, unit: Unit) -> None:
        """Make ``unit`` compute on its device copies, waiting for the copy if needed."""
        entry = self.on_device.get(index)
        if entry is not None and entry.swapped:
            return
        with record_function("l2l/fetch"):
            self._acquire(index, unit)

    def _acquire(self, index: int, unit: Unit) -> None:
        if index not in self.on_device:
            self._prefetch(index, unit)
        entry = self.on_device[index]
        if entry.from_disk:
            entry = self.on_device[index] = self._from_disk(index, unit)
        if entry.ready is not None:
            if not entry.ready.query():
                waited = time.perf_counter()
                entry.ready.synchronize()
                self.stats.wait_seconds += time.perf_counter() - waited
            compute = torch.cuda.current_stream(self.device)
            for tensor in (*entry.params.values(), *(dev for _, dev in entry.buffers.values())):
                record_stream(tensor, compute)
        for param, tensor in entry.params.items():
            param.data = tensor
        for owner, name, _ in unit.buffers:
            if (id(owner), name) in entry.buffers:
                owner._buffers[name] = entry.buffers[(id(owner), name)][1]
        entry.swapped = True

    def _from_disk(self, index: int, unit: Unit) -> _OnDevice:
        """``unit``'s masters read from the tier (waiting for the read if late): aliased, they are what it computes on
        until its release; copied, the buffer goes back once the copy has read it."""
        assert self.disk is not None
        waited = time.perf_counter()
        views = self.disk.take(self.disk_keys.get(index, index))
        self.stats.wait_seconds += time.perf_counter() - waited
        if self.alias:
            snapshots = {p: self.store.shadow[p] for _, p in unit.params if self.store.shadow[p] is not self.store.master[p]}
            return _OnDevice({**snapshots, **views}, {}, from_disk=False)
        entry = self._copy(unit, views)
        if self.staged:  # the device copies are the unit's now; on the CPU frozen weights compute on the buffer itself
            if entry.ready is not None:
                entry.ready.synchronize()
            self.disk.drop(self.disk_keys.get(index, index))
        return entry

    def release(self, index: int, unit: Unit) -> None:
        """Point ``unit`` back at its host masters and free the device copies.

        Buffers (e.g. BatchNorm running statistics) are written back first, since the
        forward may have updated them on the device.
        """
        entry = self.on_device.pop(index, None)
        if entry is None:
            return
        with record_function("l2l/release"):
            self._release(index, entry, unit)

    def _release(self, index: int, entry: _OnDevice, unit: Unit) -> None:
        for param in entry.params:
            param.data = self.store.master[param]
        key = self.disk_keys.get(index, index)
        if self.disk is not None and self.disk.covers(key):
            self.disk.drop(key)  # aliased: the block no longer computes on the buffer; not taken: its read-ahead goes
        for owner, name, _ in unit.buffers:
            pair = entry.buffers.get((id(owner), name))
            if pair is not None and entry.swapped:
                host, _ = pair
                host.copy_(owner._buffers[name])  # into the (pinned) host tensor it came from
                owner._buffers[name] = host
        self._device_bytes -= entry.nbytes

    def drop_staging(self, param: nn.Parameter) -> None:
        """``param`` sends no more gradients (frozen again, or gone from its unit): what it has in flight lands."""
        self.grad_ring.finish([param])

    def staging_bytes(self) -> int:
        """Pinned host buffers the copies cross (the two rings' slots made so far; none on the CPU device)."""
        return self.grad_ring.allocated_bytes + self.copy_ring.allocated_bytes

    def size_staging(self, chunk: int) -> None:
        """The rings' slots at most ``chunk`` bytes (the tier's plan: :attr:`.tier_plan.TierPlan.staging_bytes`)."""
        slot = self._largest_slot(chunk)
        self.grad_ring.resize(slot)
        self.copy_ring.resize(slot)

    def _largest_slot(self, chunk: int) -> int:
        """``chunk``, or less where no parameter crossing the bus is that large (a slot never holds more than one)."""
        largest = max((stored_nbytes(s) for s in self.store.shadow.values() if is_plain(s)), default=0)
        return max(1, min(chunk, largest))

    def _land(self, param: nn.Parameter, part: Tensor, start: int, fresh: bool) -> None:
        self.store.add_grad_part(param, part, start, fresh)

    def is_on_device(self, index: int) -> bool:
        return index in self.on_device

    # -- gradients, device -> host --------------------------------------------------
    def grad_to_host(self, param: nn.Parameter, grad: Tensor) -> None:
        """Take ``grad`` (just accumulated on the device) to the host store."""
        if getattr(autograd_profiler, "_is_profiler_enabled", False):  # one parameter's: labelled only while a profiler runs
            with record_function("l2l/grad_to_host"):
                self._grad_to_host(param, grad)
        else:
            self._grad_to_host(param, grad)

    def _grad_to_host(self, param: nn.Parameter, grad: Tensor) -> None:
        nbytes = grad.numel() * grad.element_size()
        started = time.perf_counter()
        if not self.staged:  # the host is the device: autograd's tensor is the host's
            self.store.add_grad(param, grad, owned=True)
            if not self.alias:
                self.stats.d2h_bytes += nbytes
                self.stats.copy_seconds += time.perf_counter() - started
            return
        computed = self.memory.event()  # the compute that made it, on the current stream
        start = self._timing_event()
        self.grad_ring.send(param, grad, self.copy_stream, computed)
        done = self._timing_event()
        if start is not None and done is not None:
            self._timed.append((start, done))
        else:
            self.stats.copy_seconds += time.perf_counter() - started
        self.stats.d2h_bytes += nbytes

    def finish_grads(self, params: list[nn.Parameter] | None = None) -> None:
        """Wait for the in-flight gradient copies (of ``params``, default all) and
        accumulate them in fp32. Safe to call from the host-optimizer thread for one
        unit while the main thread continues the backward pass."""
        with record_function("l2l/grad_to_host"):
            self._finish_grads(params)

    def _finish_grads(self, params: list[nn.Parameter] | None) -> None:
        self.grad_ring.finish(params)
        if params is not None:
            return
        for start, end in self._timed:
            end.synchronize()
            self.stats.copy_seconds += start.elapsed_time(end) / 1000.0
        self._timed.clear()

    def wait_copies(self) -> None:
        """Block until the copy stream is idle (before host tensors it reads are rewritten)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def _track_peak(self) -> None:
        blocks = sum(1 for i in self.on_device if i >= 0)  # the resident unit is index -1
        self.stats.peak_resident_blocks = max(self.stats.peak_resident_blocks, blocks)

    def _timing_event(self) -> torch.cuda.Event | None:
        """A timing event recorded on the copy stream (CUDA), else None."""
        return self.memory.event(self.copy_stream, timing=True) if self.cuda else None
