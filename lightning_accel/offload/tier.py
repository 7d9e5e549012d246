"""The NVMe tier: units' optimizer state and fp32 masters in files, streamed through a few host buffers for their step.

What :func:`~.tier_plan.plan_tier` puts on disk lives in one file per unit under the run's scratch
directory (:mod:`.tier_dir`), each tensor in a region of its own aligned for ``O_DIRECT``: the unit's
masters first, then its optimizer state, so the host step reads and writes one contiguous span.

At rest (between steps, in a checkpoint, after fit) each of those tensors *is* a view of its file
region through a shared memory map: ``param.data``, ``store.master[param]`` and
``optimizer.state[param][key]`` are those views. So everything that reads them the ordinary way
(``state_dict()``, ``torch.save`` of a checkpoint, a user's code after ``fit``) reads the file, in
pages the kernel may drop again, and never needs the whole state in memory; a checkpoint is
written from the page cache as it streams.

For a unit's host step the tier reads its span into one of :data:`~.tier_plan.SLOTS` reusable
buffers (pinned on CUDA) with ``O_DIRECT`` (:mod:`.disk_io`), points the parameters and their
state at views of that buffer, runs the same update as in memory (the caller's step function: the
fused kernel, the shadow written in the same pass), writes the span back, and points everything at
the file again. While one unit steps, the next expected unit's span is already being read
(:meth:`NVMeTier.expect`: the backward's block order when blocks step during the backward, the
plan's order after it) and the previous one's is being written. Reads and writes of ``O_DIRECT`` and
the shared map stay coherent: a direct write drops the cached pages of its range, a direct read
writes dirty ones back first (Linux), and loads through the map (a checkpoint restored into the
views) are written back explicitly (:meth:`NVMeTier.sync`).

The update is the one that runs in memory, on the same tensors' values, so a run with the tier
equals the same run in memory bit for bit (tests/offload/test_tier.py and the strategy tests).
Nothing here imports Lightning.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_accel.offload.disk_io import (DirectFile, DiskFull, DiskIO, IOCounters, align_up, aligned_buffer, free_bytes,
                                             give_large_frees_back)
from lightning_accel.offload.host_store import HostStore
from lightning_accel.offload.plan import Unit
from lightning_accel.offload.state_keys import StateKeys
from lightning_accel.offload.tier_dir import make_run_dir
from lightning_accel.offload.tier_plan import TierPlan
from lightning_accel.offload.tier_weights import WeightReads, WeightSpan, in_a_file

# a unit's update: (its parameters with gradients, their shadows, their bf16 gradients) -> parameters whose shadows it wrote
UnitStep = Callable[[list[nn.Parameter], dict[nn.Parameter, Tensor], dict[nn.Parameter, Tensor]], list[Tensor]]


@dataclass(frozen=True)
class _Region:
    offset: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * torch.tensor([], dtype=self.dtype).element_size()

    def view(self, base: Tensor, start: int = 0) -> Tensor:
        """This region's tensor inside ``base`` (a uint8 buffer or map that begins at file offset ``start``)."""
        at = self.offset - start
        return base[at:at + self.nbytes].view(self.dtype).view(self.shape)


@dataclass
class _UnitFile:
    index: int
    file: DirectFile
    masters: dict[nn.Parameter, _Region] = field(default_factory=dict)
    state: dict[tuple[nn.Parameter, str], _Region] = field(default_factory=dict)
    frozen: dict[nn.Parameter, _Region] = field(default_factory=dict)  # frozen weights as stored (the plan spilled weights)
    shadows: dict[nn.Parameter, _Region] = field(default_factory=dict)  # trainable parameters' low-precision shadows
    step_start: int = 0  # where the host step's span begins: after the frozen weights, which it never reads
    rest: dict[object, Tensor] = field(default_factory=dict)  # region key -> its view through the map

    @property
    def size(self) -> int:
        return self.file.size


@dataclass
class _Slot:
    buffer: Tensor
    unit: int | None = None
    read: Future[None] | None = None


class NVMeTier:
    """Holds the spilled units' files and buffers, and steps a spilled unit through them.

    Args:
        store: the host store whose masters move to disk (their views replace them).
        units: the offloaded units, in the order the plan indexes them.
        plan: which units' state and masters live on disk.
        optimizer: the one optimizer stepping the host parameters.
        state_keys: each trainable parameter's per-element state (:func:`~.state_keys.per_element_state`).
        nvme_path: where the run's scratch directory is made.
        pin: pinned buffers (CUDA).
    """

    def __init__(self, store: HostStore, units: list[Unit], plan: TierPlan, optimizer: Optimizer,
                 state_keys: dict[nn.Parameter, StateKeys], nvme_path: str, pin: bool = False) -> None:
        self.store = store
        self.plan = plan
        self.optimizer = optimizer
        self.counters = IOCounters()
        self.directory = make_run_dir(nvme_path)
        self.files: dict[int, _UnitFile] = {}
        self._maps: list[np.memmap] = []
        self._lock = threading.Condition()
        self._writes: list[Future[None]] = []
        self._expected: list[int] = []
        self._waiting: list[int] = []  # units a step is waiting to take
        try:
            layouts = {i: self._layout(units[i], plan, i, state_keys, store) for i in range(len(units)) if plan.unit_disk_bytes(i)}
            need = sum(align_up(layout[0]) for layout in layouts.values())
            free = free_bytes(self.directory)
            if free is not None and need > free:
                raise DiskFull(nvme_path, need, free, OSError(28, "No space left on device"))
            self.io = DiskIO(self.counters)
            give_large_frees_back()  # what moves to disk must leave the process (see give_large_frees_back)
            for i, (size, masters, state, frozen, shadows, step_start) in layouts.items():
                path = os.path.join(self.directory, f"unit-{i:05d}.bin")
                self.files[i] = _UnitFile(i, DirectFile(path, size), masters, state, frozen, shadows, step_start)
            largest = max((f.size for f in self.files.values()), default=0)
            self.slots = [_Slot(aligned_buffer(largest, pin)) for _ in range(plan.slots)] if self.files else []
            for unit_file in self.files.values():
                self._spill(unit_file)
            # the compute's reads of the masters it runs on (:mod:`.tier_weights`)
            spans = {}
            for i, unit_file in self.files.items():
                computed = {p: r for p, r in unit_file.masters.items() if store.shadow[p] is store.master[p]}
                computed.update(unit_file.frozen)
                computed.update(unit_file.shadows)
                if plan.compute_span(i) and computed:
                    spans[i] = WeightSpan(unit_file.file, max(r.offset + r.nbytes for r in computed.values()),
                                          {p: (r.offset, r.shape, r.dtype) for p, r in computed.items()})
            self.weights = WeightReads(self.io, spans, plan.weight_buffers, pin)
        except BaseException:
            self.close()
            raise

    # -- set-up ---------------------------------------------------------------------------------------
    @staticmethod
    def _layout(unit: Unit, plan: TierPlan, index: int, keys: dict[nn.Parameter, StateKeys],
                store: HostStore) -> tuple[int, dict, dict, dict, dict, int]:
        """Where each tensor of ``unit`` lies in its file: frozen weights, shadows, masters (those the compute runs on
        first), optimizer state. The compute reads the head (up to the masters it runs on); the host step the span
        from the shadows on."""
        at = 0
        masters: dict[nn.Parameter, _Region] = {}
        state: dict[tuple[nn.Parameter, str], _Region] = {}
        frozen: dict[nn.Parameter, _Region] = {}
        shadows: dict[nn.Parameter, _Region] = {}
        trainable = [p for _, p in unit.params if p.requires_grad]
        if plan.spilled_weights(index):
            for _, param in unit.params:
                if (param in store.frozen or not param.requires_grad) and in_a_file(store.shadow[param]):
                    stored = store.shadow[param]
                    frozen[param] = _Region(at, stored.shape, stored.dtype)
                    at += align_up(frozen[param].nbytes)
        step_start = at
        if plan.spilled_weights(index):
            for param in trainable:
                shadow = store.shadow[param]
                if shadow is not store.master[param]:
                    shadows[param] = _Region(at, shadow.shape, shadow.dtype)
                    at += align_up(shadows[param].nbytes)
        if plan.masters_on_disk[index]:
            # the masters the compute runs on (no shadow) first: the head of the file is what the forward reads
            for param in sorted(trainable, key=lambda p: store.shadow[p] is not store.master[p]):
                region = _Region(at, param.shape, param.dtype)
                masters[param] = region
                at += align_up(region.nbytes)
        if plan.state_on_disk[index]:
            for param in trainable:
                for key, dtype in keys.get(param, ()):
                    region = _Region(at, param.shape, dtype)
                    state[(param, key)] = region
                    at += align_up(region.nbytes)
        return at, masters, state, frozen, shadows, step_start

    def _spill(self, unit_file: _UnitFile) -> None:
        """Write the unit's masters (and any state the optimizer already has) to its file, then make the
        file's views what the parameters and the optimizer hold: the in-memory tensors are let go."""
        mapped = np.memmap(unit_file.file.path, dtype=np.uint8, mode="r+", shape=(unit_file.size,)) if unit_file.size else None
        if mapped is not None:
            self._maps.append(mapped)
            base = torch.from_numpy(mapped)
            for key, region in [*unit_file.masters.items(), *unit_file.state.items()]:
                unit_file.rest[key] = region.view(base)
            for param, region in unit_file.frozen.items():
                unit_file.rest[("frozen", param)] = region.view(base)
            for param, region in unit_file.shadows.items():
                unit_file.rest[("shadow", param)] = region.view(base)
        slot = self.slots[0]
        for param, region in unit_file.frozen.items():
            region.view(slot.buffer).copy_(self.store.master[param])
        for param, region in unit_file.shadows.items():
            region.view(slot.buffer).copy_(self.store.shadow[param])
        for param, region in unit_file.masters.items():
            region.view(slot.buffer).copy_(self.store.master[param])
        for (param, key), region in unit_file.state.items():
            held = self.optimizer.state.get(param, {}).get(key)
            if isinstance(held, Tensor):
                region.view(slot.buffer).copy_(held)
        self.io.wait(self.io.write(unit_file.file, slot.buffer, 0, unit_file.size))
        self._point_at_rest(unit_file)

    def _point_at_rest(self, unit_file: _UnitFile) -> None:
        for param in unit_file.frozen:
            view = unit_file.rest[("frozen", param)]
            self.store.master[param] = self.store.shadow[param] = view
            param.data = view
        for param in unit_file.shadows:
            self.store.shadow[param] = unit_file.rest[("shadow", param)]
        for param in unit_file.masters:
            view = unit_file.rest[param]
            if self.store.shadow[param] is self.store.master[param]:
                self.store.shadow[param] = view
            self.store.master[param] = view
            param.data = view
        for (param, key) in unit_file.state:
            state = self.optimizer.state.get(param)
            if state and key in state:
                state[key] = unit_file.rest[(param, key)]

    # -- what is where ------------------------------------------------------------------------------------
    def is_spilled(self, index: int) -> bool:
        return index in self.files

    def on_disk(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s master lives on disk (its tensor is a view of a file)."""
        return any(param in f.masters for f in self.files.values())

    def store_bytes_on_disk(self) -> int:
        """Bytes of the host store's tensors (masters, shadows, frozen weights) that are views of the files."""
        return sum(r.nbytes for f in self.files.values() for r in (*f.masters.values(), *f.shadows.values(), *f.frozen.values()))

    def state_bytes_on_disk(self, optimizer: Optimizer) -> int:
        """Bytes of ``optimizer``'s state held as file views (present state only)."""
        total = 0
        for unit_file in self.files.values():
            for (param, key), region in unit_file.state.items():
                held = optimizer.state.get(param, {}).get(key)
                if held is not None and held is unit_file.rest[(param, key)]:
                    total += region.nbytes
        return total

    @property
    def buffer_bytes(self) -> int:
        weights = self.weights.buffer_bytes if hasattr(self, "weights") else 0
        return sum(s.buffer.numel() for s in self.slots) + weights

    # -- streaming ---------------------------------------------------------------------------------------
    def expect(self, order: Iterable[int]) -> None:
        """The spilled units about to step, in order: their reads start as buffers free up."""
        with self._lock:
            self._expected = [i for i in order if i in self.files]
        self._read_ahead()

    def _read_ahead(self) -> None:
        with self._lock:
            # a unit a step is waiting for comes first: a freed buffer must not go to a unit needed later
            for index in [*self._waiting, *self._expected]:
                if any(s.unit == index for s in self.slots):
                    continue
                slot = self._free_slot()
                if slot is None:
                    return
                self._start_read(slot, index)

    def _free_slot(self) -> _Slot | None:
        return next((s for s in self.slots if s.unit is None), None)

    def _start_read(self, slot: _Slot, index: int) -> None:
        unit_file = self.files[index]
        slot.unit = index
        slot.read = self.io.read(unit_file.file, slot.buffer, unit_file.step_start, unit_file.size - unit_file.step_start)

    def _take(self, index: int) -> _Slot:
        """The slot holding ``index``'s span, read now if it was not read ahead (waiting for a free slot first)."""
        with self._lock:
            # first in line while it waits (_waiting): a write's callback that frees a slot reads ahead, and must read
            # this unit, not a later one (all slots holding later units, none ever released, was a deadlock)
            if index in self._expected:
                self._expected.remove(index)
            self._waiting.append(index)
            try:
                slot = next((s for s in self.slots if s.unit == index), None)
                while slot is None:
                    free = self._free_slot()
                    if free is not None:
                        self._start_read(free, index)
                    else:
                        self._lock.wait()
                    slot = next((s for s in self.slots if s.unit == index), None)
            finally:
                self._waiting.remove(index)
        assert slot.read is not None
        self.io.wait(slot.read)
        return slot

    def _release(self, slot: _Slot) -> None:
        with self._lock:
            slot.unit = None
            slot.read = None
            self._lock.notify_all()

    def step_unit(self, index: int, params: list[nn.Parameter], shadows: dict[nn.Parameter, Tensor],
                  low_grads: dict[nn.Parameter, Tensor], step: UnitStep) -> None:
        """Step ``params`` (the unit's parameters with gradients) of spilled unit ``index`` through a buffer: read
        (or take the read-ahead), point parameters and state at the buffer, ``step``, refresh the shadows the step
        did not write, write the span back, point everything at the file again. Thread-safe against other units'
        calls (the block steps run on the host-step thread)."""
        unit_file = self.files[index]
        self.weights.forget(index)  # a read-ahead of the masters as they are now would be stale after this step
        slot = self._take(index)
        buffer, start = slot.buffer, unit_file.step_start
        try:
            for param, region in unit_file.masters.items():
                param.data = region.view(buffer, start)
            for (param, key), region in unit_file.state.items():
                state = self.optimizer.state.get(param)
                if state and key in state:
                    state[key] = region.view(buffer, start)
            # shadows on disk are written in the buffer, with their masters
            shadows = {p: unit_file.shadows[p].view(buffer, start) if p in unit_file.shadows else s for p, s in shadows.items()}
            written = {id(p) for p in step(params, shadows, low_grads)}
            for (param, key), region in unit_file.state.items():  # state the step made (a first step) moves in
                held = self.optimizer.state.get(param, {}).get(key)
                view = region.view(buffer, start)
                if isinstance(held, Tensor) and held is not view and held.data_ptr() != view.data_ptr():
                    view.copy_(held)
            for param in params:
                shadow = shadows.get(param)
                if shadow is not None and id(param) not in written:
                    shadow.copy_(param.data)
        except BaseException:
            self._point_at_rest(unit_file)  # the file still holds the unit as it was before this step
            self._release(slot)
            raise
        self._point_at_rest(unit_file)
        write = self.io.write(unit_file.file, buffer, start, unit_file.size - start)
        with self._lock:
            self._writes.append(write)
        write.add_done_callback(lambda _: (self._release(slot), self._read_ahead()))
        self._read_ahead()

    def finish_step(self) -> None:
        """After the optimizer step: every write done (the views read what was written), read-ahead dropped."""
        with self._lock:
            writes, self._writes = self._writes, []
            self._expected = []
        for write in writes:
            self.io.wait(write)
        for slot in self.slots:
            if slot.unit is not None and slot.read is not None:
                self.io.wait(slot.read)
                self._release(slot)

    def adopt_state(self) -> None:
        """State the optimizer holds outside the files (a checkpoint just loaded) is written to them and replaced
        by their views; masters written through the views are written back (:meth:`sync`)."""
        for unit_file in self.files.values():
            for (param, key), region in unit_file.state.items():
                held = self.optimizer.state.get(param, {}).get(key)
                view = unit_file.rest[(param, key)]
                if isinstance(held, Tensor) and held is not view:
                    view.copy_(held)
                    self.optimizer.state[param][key] = view
        self.sync()

    def sync(self) -> None:
        """Write back what was written through the maps (a checkpoint's weights loaded into the parameters); weights
        read ahead before that are read again."""
        for mapped in self._maps:
            mapped.flush()
        if hasattr(self, "weights"):
            self.weights.forget_all()

    def close(self) -> None:
        """Finish the writes and remove the scratch directory. The views stay readable (the maps outlive the
        files' names), so the module and optimizer after fit still hold their values."""
        if hasattr(self, "io"):
            try:
                self.finish_step()
            finally:
                self.io.close()
        for unit_file in self.files.values():
            unit_file.file.close()
        shutil.rmtree(self.directory, ignore_errors=True)
