"""The NVMe tier's step buffers: a few chunk-sized host buffers the host step streams through.

Each unit's host step goes through its chunks (:mod:`.tier_chunks`) in order; a chunk is read into a free buffer
ahead of its step (in the order the steps will take them: :meth:`StepBuffers.expect`), taken by its step
(:meth:`StepBuffers.take`, waiting for the read, or reading it now), and written back, the buffer freed once the
write has landed (:meth:`StepBuffers.write_back`). With :data:`~.tier_plan.SLOTS` buffers one chunk steps while
the next is read and the previous one written, whatever the size of the unit. Nothing here imports Lightning.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from torch import Tensor

from lightning_accel.offload.disk_io import DiskIO, aligned_buffer

Key = tuple[int, int]  # (unit, chunk)


@dataclass
class Slot:
    buffer: Tensor
    key: Key | None = None
    read: Future[None] | None = None


class StepBuffers:
    """``count`` buffers of ``nbytes`` (pinned on CUDA); ``reader(key, buffer)`` starts the read of a chunk into one."""

    def __init__(self, io: DiskIO, count: int, nbytes: int, pin: bool, reader: Callable[[Key, Tensor], Future[None]]) -> None:
        self.io = io
        self.slots = [Slot(aligned_buffer(nbytes, pin)) for _ in range(count)]
        self._reader = reader
        self._lock = threading.Condition()
        self._writes: list[Future[None]] = []
        self._expected: list[Key] = []
        self._waiting: list[Key] = []  # chunks a step is waiting to take

    @property
    def nbytes(self) -> int:
        return sum(s.buffer.numel() for s in self.slots)

    def expect(self, keys: Iterable[Key]) -> None:
        """The chunks about to step, in order: their reads start as buffers free up."""
        with self._lock:
            self._expected = list(keys)
        self._read_ahead()

    def _read_ahead(self) -> None:
        with self._lock:
            # a chunk a step is waiting for comes first: a freed buffer must not go to a chunk needed later
            for key in [*self._waiting, *self._expected]:
                if any(s.key == key for s in self.slots):
                    continue
                slot = self._free_slot()
                if slot is None:
                    return
                self._start_read(slot, key)

    def _free_slot(self) -> Slot | None:
        return next((s for s in self.slots if s.key is None), None)

    def _start_read(self, slot: Slot, key: Key) -> None:
        slot.key = key
        slot.read = self._reader(key, slot.buffer)

    def take(self, key: Key) -> Slot:
        """The slot holding ``key``'s chunk, read now if it was not read ahead (waiting for a free slot first)."""
        with self._lock:
            # first in line while it waits (_waiting): a write's callback that frees a slot reads ahead, and must read
            # this chunk, not a later one (all slots holding later chunks, none ever released, was a deadlock)
            if key in self._expected:
                self._expected.remove(key)
            self._waiting.append(key)
            try:
                slot = next((s for s in self.slots if s.key == key), None)
                while slot is None:
                    free = self._free_slot()
                    if free is not None:
                        self._start_read(free, key)
                    else:
                        self._lock.wait()
                    slot = next((s for s in self.slots if s.key == key), None)
            finally:
                self._waiting.remove(key)
        assert slot.read is not None
        self.io.wait(slot.read)
        return slot

    def release(self, slot: Slot) -> None:
        """``slot`` is free again (its chunk written back, or not changed)."""
        with self._lock:
            slot.key = None
            slot.read = None
            self._lock.notify_all()

    def write_back(self, slot: Slot, write: Future[None]) -> None:
        """``write`` (of ``slot``'s chunk) frees the slot when it lands; the next chunks are read ahead meanwhile."""
        with self._lock:
            self._writes.append(write)
        write.add_done_callback(lambda _: (self.release(slot), self._read_ahead()))
        self._read_ahead()

    def freed(self, slot: Slot) -> None:
        """``slot``'s chunk did not change (nothing in it stepped): free it and read ahead."""
        self.release(slot)
        self._read_ahead()

    def finish(self) -> None:
        """Every write landed, every read-ahead dropped (the files hold what was written)."""
        with self._lock:
            writes, self._writes = self._writes, []
            self._expected = []
        for write in writes:
            self.io.wait(write)
        for slot in self.slots:
            if slot.key is not None and slot.read is not None:
                self.io.wait(slot.read)
                self.release(slot)
