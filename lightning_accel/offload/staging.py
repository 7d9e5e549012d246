"""Bounded rings of reusable pinned buffers that the copies between the host and the device cross.

A copy between the device and pageable host memory cannot run asynchronously, so the offload stages it through
page-locked memory. Staging every parameter in a pinned buffer of its own (one per trainable parameter, for the
whole fit) pins a copy of the model: 14 GB for an 8B model's bf16 gradients, 137 GB for a 70B one. Here the copies
cross a few buffers of at most one *slot* each, reused, so what is pinned is bounded by what is in flight:

- :class:`GradRing` (device -> host): a gradient is cut into pieces of at most a slot, each copied into the next
  slot on the copy stream; a piece *lands* (its copy waited for, then summed into the host's fp32 gradient buffer by
  ``land``) when its slot comes round again, or when the host step asks for its parameter's gradients
  (:meth:`GradRing.finish`). Pieces land in the order they were sent, so a range of a gradient accumulated over
  micro-batches sums in the same order as the whole tensor would, and every element's sum is the same float
  operation: the landed gradient equals the one staged whole, bit for bit.
- :class:`CopyRing` (host -> device): a weight in pageable memory is copied piece by piece into a slot (on the
  host) and from there to the device (on the copy stream); a slot is refilled once its copy is done.

Slots are made at first use and kept; :mod:`.tier_plan` counts ``GRAD_SLOTS + COPY_SLOTS`` slots of the plan's chunk
(capped at the largest unit's bytes). The memory and the stream operations come from :mod:`.device_memory`, so on the
CPU device (its stand-in) the same code runs on plain memory. Nothing here imports Lightning.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_accel.offload.device_memory import DeviceMemory

from lightning_accel.offload.tier_plan import COPY_SLOTS, GRAD_SLOTS  # (the plan counts them: tier_plan.TierPlan.staging_bytes)
from lightning_accel.offload.tier_plan import DEFAULT_CHUNK as DEFAULT_SLOT  # a slot without a tier's plan


class _Ring:
    def __init__(self, memory: DeviceMemory, slots: int, slot_bytes: int) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a staging ring needs at least one slot of at least one byte, not {slots} of {slot_bytes}")
        self.memory = memory
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._buffers: list[Tensor | None] = [None] * slots
        self._next = 0
        self._lock = threading.RLock()

    @property
    def allocated_bytes(self) -> int:
        """Pinned bytes the ring holds (slots are made at first use)."""
        return sum(b.numel() for b in self._buffers if b is not None)

    def _slot(self, index: int, nbytes: int, dtype: torch.dtype) -> Tensor:
        buffer = self._buffers[index]
        if buffer is None:
            buffer = self._buffers[index] = self.memory.empty_pinned(self.slot_bytes)
        return buffer[:nbytes].view(dtype)

    def _pieces(self, numel: int, element_size: int) -> Iterable[tuple[int, int]]:
        per = max(1, self.slot_bytes // element_size)
        for start in range(0, numel, per):
            yield start, min(per, numel - start)


@dataclass
class _Landing:
    key: Hashable
    start: int  # the piece's first element in the flattened gradient
    part: Tensor  # the slot's bytes, as the piece
    done: torch.cuda.Event | None  # its copy (None: done)
    fresh: bool  # the first gradient of ``key`` since its buffer was emptied: copied into place, not added


class GradRing(_Ring):
    """Device -> host gradient staging through ``slots`` reusable pinned buffers of ``slot_bytes``.

    ``land(key, part, start, fresh)`` sums a landed piece into the host's buffer for ``key`` (elements ``start`` on of
    its flattened gradient; ``fresh``: the buffer holds nothing of this step yet, copy instead of adding);
    ``has_buffer(key)``: whether the host already holds a gradient of ``key`` (then a new one adds to it)."""

    def __init__(self, memory: DeviceMemory, land: Callable[[Hashable, Tensor, int, bool], None],
                 has_buffer: Callable[[Hashable], bool], slots: int = GRAD_SLOTS, slot_bytes: int = DEFAULT_SLOT) -> None:
        super().__init__(memory, slots, slot_bytes)
        self._land_fn = land
        self._has_buffer = has_buffer
        self._flight: list[_Landing | None] = [None] * slots
        self._of: dict[Hashable, deque[int]] = {}  # each key's slots in flight, oldest first

    def in_flight(self, key: Hashable) -> bool:
        return key in self._of

    def send(self, key: Hashable, grad: Tensor, stream: torch.cuda.Stream | None, after: torch.cuda.Event | None) -> None:
        """Start copying ``grad`` (on the device) to the host in pieces on ``stream``, once ``after`` (the compute that
        made it) is done; a slot still in flight lands first."""
        flat = grad.reshape(-1)
        with self._lock:
            fresh = key not in self._of and not self._has_buffer(key)
            for start, count in self._pieces(flat.numel(), flat.element_size()):
                index = self._next
                self._next = (index + 1) % self.slots
                if self._flight[index] is not None:
                    self._land(index)
                part = self._slot(index, count * flat.element_size(), flat.dtype)
                with self.memory.on(stream):
                    self.memory.wait(stream, after)
                    part.copy_(flat[start:start + count], non_blocking=self.memory.cuda)
                    done = self.memory.event(stream)
                self._flight[index] = _Landing(key, start, part, done, fresh)
                self._of.setdefault(key, deque()).append(index)
            self.memory.record_stream(flat, stream)

    def finish(self, keys: Iterable[Hashable] | None = None) -> None:
        """Land every piece in flight (of ``keys``; default all), each key's in the order sent."""
        with self._lock:
            if keys is None:
                for offset in range(self.slots):  # the oldest slot is the next one to be reused
                    index = (self._next + offset) % self.slots
                    if self._flight[index] is not None:
                        self._land(index)
                return
            for key in keys:
                while key in self._of:
                    self._land(self._of[key][0])

    def _land(self, index: int) -> None:
        landing = self._flight[index]
        assert landing is not None
        queue = self._of[landing.key]
        assert queue[0] == index, "pieces of a gradient land in the order they were sent"
        self.memory.synchronize(landing.done)
        self._land_fn(landing.key, landing.part, landing.start, landing.fresh)
        queue.popleft()
        if not queue:
            del self._of[landing.key]
        self._flight[index] = None

    def resize(self, slot_bytes: int) -> None:
        """Slots of ``slot_bytes`` from now on (the tier's plan); what is in flight lands first."""
        with self._lock:
            self.finish()
            if slot_bytes != self.slot_bytes:
                self.slot_bytes = slot_bytes
                self._buffers = [None] * self.slots


class CopyRing(_Ring):
    """Host -> device weight copies from pageable memory through ``slots`` reusable pinned buffers of ``slot_bytes``."""

    def __init__(self, memory: DeviceMemory, slots: int = COPY_SLOTS, slot_bytes: int = DEFAULT_SLOT) -> None:
        super().__init__(memory, slots, slot_bytes)
        self._done: list[torch.cuda.Event | None] = [None] * slots

    def to_device(self, src: Tensor, device: torch.device, stream: torch.cuda.Stream | None) -> Tensor:
        """A copy of ``src`` (a plain host tensor) on ``device``, made on ``stream`` (the caller runs on it)."""
        out = torch.empty(src.shape, dtype=src.dtype, device=device)
        flat_src, flat_out = src.reshape(-1), out.view(-1)
        with self._lock:
            for start, count in self._pieces(flat_src.numel(), flat_src.element_size()):
                index = self._next
                self._next = (index + 1) % self.slots
                self.memory.synchronize(self._done[index])  # the slot's last copy has left it
                part = self._slot(index, count * flat_src.element_size(), flat_src.dtype)
                part.copy_(flat_src[start:start + count])
                flat_out[start:start + count].copy_(part, non_blocking=self.memory.cuda)
                self._done[index] = self.memory.event(stream)
        return out

    def resize(self, slot_bytes: int) -> None:
        with self._lock:
            for done in self._done:
                self.memory.synchronize(done)
            self._done = [None] * self.slots
            if slot_bytes != self.slot_bytes:
                self.slot_bytes = slot_bytes
                self._buffers = [None] * self.slots
