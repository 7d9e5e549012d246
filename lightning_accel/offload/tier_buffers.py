"""The NVMe tier's step buffers: a few chunk-sized host buffers the host step streams through.

Each unit's host step goes through its chunks (:mod:`.tier_chunks`) in order; a chunk is read into a free buffer
ahead of its step (in the order the steps will take them: :meth:`StepBuffers.expect`), taken by its step
(:meth:`StepBuffers.take`, waiting for the read, or reading it now), and written back, the buffer freed once the
write has landed (:meth:`StepBuffers.write_back`). With :data:`~.tier_plan.SLOTS` buffers one chunk steps while
the next is read and the previous one written, whatever the size of the unit. A streamed resident unit, whose parameters step one by one
as their gradients land (the head's at the start of the backward, the embedding's at its end), has a buffer of its
own; should a step still ask for a chunk nobody read ahead, it takes over a buffer read ahead for a later chunk
rather than wait for one that only that later chunk's step would free. Nothing here imports Lightning.
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
    taken: bool = False  # by a step, until its write lands (else: a read-ahead, which a step waiting may take over)


class StepBuffers:
    """``count`` buffers of ``nbytes`` (pinned on CUDA); ``reader(key, buffer)`` starts the read of a chunk into one. The
    chunks of ``own_units`` (a streamed resident unit, whose parameters step one by one as their gradients land, out of
    the blocks' order) go through one more buffer of their own."""

    def __init__(self, io: DiskIO, count: int, nbytes: int, pin: bool, reader: Callable[[Key, Tensor], Future[None]],
                 own_units: frozenset[int] = frozenset()) -> None:
        self.io = io
        self.slots = [Slot(aligned_buffer(nbytes, pin)) for _ in range(count)]
        self.own = Slot(aligned_buffer(nbytes, pin)) if own_units else None
        self._own_units = own_units
        self._all = [*self.slots, *([self.own] if self.own is not None else [])]
        self._reader = reader
        self._lock = threading.Condition()
        self._writes: list[Future[None]] = []
        self._writing: dict[Key, Future[None]] = {}  # chunks whose write has not landed: not read again before it has
        self._expected: list[Key] = []
        self._waiting: list[Key] = []  # chunks a step is waiting to take

    @property
    def nbytes(self) -> int:
        return sum(s.buffer.numel() for s in self._all)

    def expect(self, keys: Iterable[Key]) -> None:
        """The chunks about to step, in order: their reads start as buffers free up."""
        with self._lock:
            self._expected = list(keys)
        self._read_ahead()

    def _read_ahead(self) -> None:
        with self._lock:
            # a chunk a step is waiting for comes first: a freed buffer must not go to a chunk needed later
            for key in [*self._waiting, *self._expected]:
                if any(s.key == key for s in self._all) or key in self._writing:
                    continue
                slot = self._free_slot(key)
                if slot is None:
                    if key[0] in self._own_units:
                        continue
                    return
                self._start_read(slot, key)

    def _free_slot(self, key: Key) -> Slot | None:
        pool = [self.own] if key[0] in self._own_units and self.own is not None else self.slots
        return next((s for s in pool if s.key is None), None)

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
                while key in self._writing:  # (a unit stepping twice a step, a resident one: its last write first)
                    self._lock.wait()
                slot = next((s for s in self._all if s.key == key), None)
                while slot is None:
                    free = self._free_slot(key) or (self._read_ahead_slot() if key[0] not in self._own_units else None)
                    if free is not None:
                        self._start_read(free, key)
                    else:
                        self._lock.wait()
                    slot = next((s for s in self._all if s.key == key), None)
                slot.taken = True
            finally:
                self._waiting.remove(key)
        assert slot.read is not None
        self.io.wait(slot.read)
        return slot

    def _read_ahead_slot(self) -> Slot | None:
        """A buffer holding a read-ahead no step has taken, freed for a step waiting (its chunk is read again later)."""
        slot = next((s for s in self.slots if s.key is not None and not s.taken), None)
        if slot is None:
            return None
        if slot.read is not None:
            self.io.wait(slot.read)  # (its read writes into the buffer until it lands)
        assert slot.key is not None
        self._expected.insert(0, slot.key)
        slot.key, slot.read = None, None
        return slot

    def skip(self, key: Key) -> None:
        """A step does not need ``key``'s chunk after all (none of its parameters step): a read-ahead of it goes."""
        with self._lock:
            if key in self._expected:
                self._expected.remove(key)
            slot = next((s for s in self._all if s.key == key and not s.taken), None)
            if slot is not None and slot.read is not None:
                self.io.wait(slot.read)
        if slot is not None:
            self.freed(slot)

    def release(self, slot: Slot) -> None:
        """``slot`` is free again (its chunk written back, or not changed)."""
        with self._lock:
            slot.key = None
            slot.read = None
            slot.taken = False
            self._lock.notify_all()

    def write_back(self, slot: Slot, write: Future[None]) -> None:
        """``write`` (of ``slot``'s chunk) frees the slot when it lands; the next chunks are read ahead meanwhile."""
        key = slot.key
        assert key is not None
        with self._lock:
            self._writes.append(write)
            self._writing[key] = write

        def landed(_: Future[None]) -> None:
            with self._lock:
                if self._writing.get(key) is write:
                    del self._writing[key]
            self.release(slot)
            self._read_ahead()

        write.add_done_callback(landed)
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
        for slot in self._all:
            if slot.key is not None and slot.read is not None:
                self.io.wait(slot.read)
                self.release(slot)
