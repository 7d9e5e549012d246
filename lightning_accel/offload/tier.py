"""The NVMe tier: units' optimizer state and fp32 masters in files, streamed through a few host buffers for their step.

What :func:`~.tier_plan.plan_tier` puts on disk lives in one file per unit under the run's scratch
directory (:mod:`.tier_dir`), each tensor in a region of its own aligned for ``O_DIRECT``: the unit's
frozen weights and shadows, then its masters, then its optimizer state.

At rest (between steps, in a checkpoint, after fit) each of those tensors *is* a view of its file
region through a shared memory map: ``param.data``, ``store.master[param]`` and
``optimizer.state[param][key]`` are those views. So everything that reads them the ordinary way
(``state_dict()``, ``torch.save`` of a checkpoint, a user's code after ``fit``) reads the file, in
pages the kernel may drop again, and never needs the whole state in memory; a checkpoint is
written from the page cache as it streams.

A unit's host step goes through its span chunk by chunk (:mod:`.tier_chunks`: runs of parameters and
element ranges of a parameter, each at most the plan's chunk): each chunk is read with ``O_DIRECT``
(:mod:`.disk_io`) into one of :data:`~.tier_plan.SLOTS` reusable buffers of one chunk (pinned on CUDA;
:mod:`.tier_buffers`), its ranges are stepped as parameters of their own (:mod:`.slice_step`: the same
update as in memory, the caller's step function, the shadow written in the same pass), and it is written
back, while the next chunk is already being read (:meth:`NVMeTier.expect`: the backward's block order when
blocks step during the backward, the plan's order after it) and the previous one written. So what the
host keeps for the step is three chunks, whatever the size of a unit. Reads and writes of ``O_DIRECT`` and
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
from collections.abc import Iterable
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
from lightning_accel.offload.slice_step import Slice, SlicedStep, UnitStep
from lightning_accel.offload.state_keys import StateKeys
from lightning_accel.offload.tier_buffers import Key, StepBuffers
from lightning_accel.offload.tier_chunks import Chunk, Piece, Strand, cut_unit
from lightning_accel.offload.tier_dir import make_run_dir
from lightning_accel.offload.tier_plan import TierPlan
from lightning_accel.offload.tier_weights import WeightReads, WeightSpan, in_a_file

__all__ = ["NVMeTier", "UnitStep"]


@dataclass(frozen=True)
class _Region:
    offset: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

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
    rest: dict[object, Tensor] = field(default_factory=dict)  # region key -> its view through the map
    params: list[nn.Parameter] = field(default_factory=list)  # the trainable parameters, in the chunks' order
    chunks: list[Chunk] = field(default_factory=list)  # the host step's chunks (:mod:`.tier_chunks`)

    @property
    def size(self) -> int:
        return self.file.size


class NVMeTier:
    """Holds the spilled units' files and buffers, and steps a spilled unit through them.

    Args:
        store: the host store whose masters move to disk (their views replace them).
        units: the offloaded units, in the order the plan indexes them.
        plan: which units' state and masters live on disk, and the chunk of the step buffers.
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
        self.keys = state_keys
        self.counters = IOCounters()
        self.directory = make_run_dir(nvme_path)
        self.files: dict[int, _UnitFile] = {}
        self._maps: list[np.memmap] = []
        self.buffers: StepBuffers | None = None
        self._partial: dict[Key, list[tuple[int, int, int]]] = {}  # chunks a step needs part of: the requests of that part
        try:
            layouts = {i: self._layout(units[i], plan, i, state_keys, store) for i in range(len(units)) if plan.unit_disk_bytes(i)}
            need = sum(align_up(layout[0]) for layout in layouts.values())
            free = free_bytes(self.directory)
            if free is not None and need > free:
                raise DiskFull(nvme_path, need, free, OSError(28, "No space left on device"))
            self.io = DiskIO(self.counters)
            give_large_frees_back()  # what moves to disk must leave the process (see give_large_frees_back)
            for i, (size, masters, state, frozen, shadows) in layouts.items():
                path = os.path.join(self.directory, f"unit-{i:05d}.bin")
                unit_file = _UnitFile(i, DirectFile(path, size), masters, state, frozen, shadows)
                unit_file.params = [p for _, p in units[i].params if p.requires_grad and p not in store.frozen]
                unit_file.chunks = cut_unit([(p.numel(), self._strands(unit_file, p)) for p in unit_file.params],
                                            plan.step_buffer) if plan.step_buffer else []
                self.files[i] = unit_file
            if plan.step_buffer:
                held = frozenset(i for i in range(len(units) - plan.held, len(units)) if i in self.files)
                self.buffers = StepBuffers(self.io, plan.slots, plan.step_buffer, pin, self._read_chunk, own_units=held)
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
            held = set(range(len(units) - plan.held, len(units)))
            self.weights = WeightReads(self.io, spans, plan.weight_buffers, pin, own=held & set(spans))
        except BaseException:
            self.close()
            raise

    # -- set-up ---------------------------------------------------------------------------------------
    @staticmethod
    def _layout(unit: Unit, plan: TierPlan, index: int, keys: dict[nn.Parameter, StateKeys],
                store: HostStore) -> tuple[int, dict, dict, dict, dict]:
        """Where each tensor of ``unit`` lies in its file: frozen weights, shadows, masters (those the compute runs on
        first), optimizer state. The compute reads the head (up to the masters it runs on); the host step the
        shadows, masters and state, chunk by chunk."""
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
        return at, masters, state, frozen, shadows

    def _strands(self, unit_file: _UnitFile, param: nn.Parameter) -> list[Strand]:
        """``param``'s tensors the host step reads from ``unit_file``: its shadow, master and state where on disk."""
        regions: list[tuple[object, _Region]] = []
        if param in unit_file.shadows:
            regions.append((("shadow", param), unit_file.shadows[param]))
        if param in unit_file.masters:
            regions.append((("master", param), unit_file.masters[param]))
        regions += [(("state", param, key), unit_file.state[(param, key)]) for key, _ in self.keys.get(param, ())
                    if (param, key) in unit_file.state]
        return [Strand(key, region.offset, region.dtype.itemsize) for key, region in regions]

    def _spill(self, unit_file: _UnitFile) -> None:
        """Write the unit's tensors (and any state the optimizer already has) to its file, then make the file's views
        what the parameters and the optimizer hold: the in-memory tensors are let go."""
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
        writes: list[tuple[_Region, Tensor]] = [(r, self.store.master[p]) for p, r in unit_file.frozen.items()]
        writes += [(r, self.store.shadow[p]) for p, r in unit_file.shadows.items()]
        writes += [(r, self.store.master[p]) for p, r in unit_file.masters.items()]
        for (param, key), region in unit_file.state.items():
            held = self.optimizer.state.get(param, {}).get(key)
            if isinstance(held, Tensor):
                writes.append((region, held))
        buffer = self.buffers.slots[0].buffer if self.buffers is not None else aligned_buffer(min(unit_file.size, 4 << 20))
        for region, tensor in writes:  # through one buffer, a buffer's worth at a time
            data = tensor.detach().reshape(-1).view(torch.uint8)
            for at in range(0, data.numel(), buffer.numel()):
                n = min(buffer.numel(), data.numel() - at)
                buffer[:n].copy_(data[at:at + n])
                self.io.wait(self.io.write(unit_file.file, buffer, region.offset + at, n))
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
        return (self.buffers.nbytes if self.buffers is not None else 0) + weights

    # -- streaming ---------------------------------------------------------------------------------------
    def expect(self, order: Iterable[int]) -> None:
        """The spilled units about to step, in order: their chunks' reads start as buffers free up."""
        if self.buffers is not None:
            self.buffers.expect((i, c) for i in order if i in self.files for c in range(len(self.files[i].chunks)))

    def _read_chunk(self, key: Key, buffer: Tensor) -> Future[None]:
        unit_file = self.files[key[0]]
        return self.io.read_spans(unit_file.file, buffer, self._partial.get(key) or list(unit_file.chunks[key[1]].spans))

    def _spans(self, unit_file: _UnitFile, pieces: list[Piece]) -> list[tuple[int, int, int]]:
        """The requests of ``pieces`` alone (file offset, buffer offset, bytes), adjacent ones merged."""
        ranges = sorted((s.offset + piece.start * s.itemsize, piece.at[s.key], align_up((piece.stop - piece.start) * s.itemsize))
                        for piece in pieces for s in self._strands(unit_file, unit_file.params[piece.param]) if s.key in piece.at)
        spans: list[list[int]] = []
        for offset, at, nbytes in ranges:
            if spans and spans[-1][0] + spans[-1][2] == offset and spans[-1][1] + spans[-1][2] == at:
                spans[-1][2] += nbytes
            else:
                spans.append([offset, at, nbytes])
        return [(o, a, n) for o, a, n in spans]

    def step_unit(self, index: int, params: list[nn.Parameter], shadows: dict[nn.Parameter, Tensor],
                  low_grads: dict[nn.Parameter, Tensor], step: UnitStep, computing: bool = False,
                  grads: dict[nn.Parameter, Tensor] | None = None) -> None:
        """Step ``params`` (the unit's parameters with gradients) of spilled unit ``index`` through the step buffers,
        chunk by chunk: take the chunk (read ahead, or read now), step its ranges (:class:`.SlicedStep`: ``step`` on
        them, the shadows the step did not write refreshed), write it back; then give each parameter its state as
        the file's views. Thread-safe against other units' calls (the block steps run on the host-step thread). A step
        that raises leaves the chunks before it stepped in the file and the rest as they were; every buffer is freed.
        Chunks holding none of ``params`` are neither read nor written. ``computing``: the compute still holds the unit
        (a streamed resident unit, its parameters stepping as their gradients land), on weights read before: it keeps
        them (it reads none of ``params`` again); ``grads``: their gradients, where not ``param.grad``."""
        unit_file = self.files[index]
        # a read-ahead of the weights as they are now would be stale after this step
        self.weights.forget(index, keep_taken=computing)
        wanted = {id(p) for p in params}
        stepping = SlicedStep(self.optimizer, step)
        assert self.buffers is not None
        for number, chunk in enumerate(unit_file.chunks):
            pieces = [piece for piece in chunk.pieces if id(unit_file.params[piece.param]) in wanted]
            if not pieces:
                self.buffers.skip((index, number))
                continue
            # part of a chunk (a resident unit's parameter stepping alone): its ranges alone are read and written
            spans = list(chunk.spans) if len(pieces) == len(chunk.pieces) else self._spans(unit_file, pieces)
            self._partial[(index, number)] = spans
            try:
                slot = self.buffers.take((index, number))
            finally:
                del self._partial[(index, number)]
            try:
                stepping.run([self._slice(unit_file, piece, slot.buffer, shadows, grads) for piece in pieces], low_grads)
            except BaseException:
                self.buffers.freed(slot)
                raise
            self.buffers.write_back(slot, self.io.write_spans(unit_file.file, slot.buffer, spans))
        stepping.finish(lambda param, key: unit_file.rest[(param, key)])

    def _slice(self, unit_file: _UnitFile, piece: Piece, buffer: Tensor, shadows: dict[nn.Parameter, Tensor],
               grads: dict[nn.Parameter, Tensor] | None = None) -> Slice:
        """``piece``'s ranges: in ``buffer`` where its tensors are on disk, else of the tensors in memory."""
        param = unit_file.params[piece.param]
        count = piece.stop - piece.start

        def ranged(key: object, whole: Tensor) -> Tensor:
            at = piece.at.get(key)
            if at is None:
                return whole.view(-1)[piece.start:piece.stop]
            return buffer[at:at + count * whole.dtype.itemsize].view(whole.dtype)

        held = self.optimizer.state.get(param, {})
        state = {}
        for key, dtype in self.keys.get(param, ()):
            if ("state", param, key) in piece.at:
                state[key] = ranged(("state", param, key), torch.empty(0, dtype=dtype))
            else:  # (a spilled unit's state is on disk; kept in memory it is stepped where it is)
                assert key in held, f"no optimizer state {key!r} in memory or on disk for a parameter of unit {unit_file.index}"
                state[key] = ranged(None, held[key])
        shadow = shadows.get(param)
        return Slice(param, piece.start, piece.stop, ranged(("master", param), self.store.master[param]), state,
                     ranged(("shadow", param), shadow) if shadow is not None else None, (grads or {}).get(param))

    def finish_step(self) -> None:
        """After the optimizer step: every write done (the views read what was written), read-ahead dropped."""
        if self.buffers is not None:
            self.buffers.finish()

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
