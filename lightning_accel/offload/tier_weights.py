"""Masters on disk read ahead of the compute that runs on them, into a few reusable buffers.

Where the device computes on the fp32 masters themselves (fp32 on the host itself: the CPU device, whose
blocks alias their masters; a GPU under ``32-true``, which copies them), a unit whose masters the tier
put on disk would otherwise be read through its file's map: page faults that the tier does not count,
of 4-128 KiB each, in the compute's own thread, into page cache that stays charged to the run's memory
until the kernel drops it (measured with the bench before this: 806.8 MB read from storage a step for
the tier's 454.5 MB, the forward 0.2 s slower). Here the streamer asks for a unit's weights when it
prefetches the unit (:meth:`WeightReads.start`: one ``O_DIRECT`` read of the unit's masters, the head of
its file, through the tier's I/O threads while the block before it computes), takes them when the block
computes (:meth:`WeightReads.take`: views of the buffer, waiting for the read only if it is late) and
gives them back when it releases the block (:meth:`WeightReads.drop`).

A read-ahead no block took is dropped before the host step rewrites that unit (:meth:`forget`), and
after anything wrote through the maps (:meth:`forget_all`): a buffer never holds weights older than the
file. The plan counts ``weight_buffers`` of the largest block's span (prefetch depth + 2: the block
computing, the block whose forward turned into its backward); a unit held for the whole step (a streamed
resident unit, ``own``: often far larger than a block, a 128k-vocabulary embedding) reads into a buffer of
its own size, so it does not size the blocks' buffers. Should more blocks ever be held at once a buffer is
added (``grown``) rather than waiting for one that only a later block's release would free.
Nothing here imports Lightning.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from lightning_accel.offload.disk_io import DirectFile, DiskIO, align_up, aligned_buffer


def in_a_file(tensor: Tensor) -> bool:
    """Whether the tier can keep ``tensor`` as a region of a file: a plain dense tensor (a quantized subclass such as
    torchao's NF4 holds its bytes in tensors of its own, and stays in memory). A fake tensor (``estimate``'s stand-in,
    nothing allocated) is the plain tensor it stands for."""
    return type(tensor) in (Tensor, FakeTensor) and tensor.layout == torch.strided and tensor.is_contiguous()


@dataclass
class _Buffer:
    data: Tensor
    unit: int | None = None
    read: Future[None] | None = None
    taken: bool = False


@dataclass(frozen=True)
class WeightSpan:
    """Where one unit's masters lie in its file: the head, ``nbytes`` long; each parameter's view there."""

    file: DirectFile
    nbytes: int
    views: dict[nn.Parameter, tuple[int, torch.Size, torch.dtype]]  # parameter -> its offset, shape and dtype


class WeightReads:
    """Reads spilled units' masters for the compute, ahead of it, into ``buffers`` reusable buffers."""

    def __init__(self, io: DiskIO, spans: dict[int, WeightSpan], buffers: int, pin: bool = False,
                 own: set[int] | frozenset[int] = frozenset()) -> None:
        self.io = io
        self.spans = spans
        self._pin = pin
        shared = [i for i in spans if i not in own]
        self._size = max((spans[i].nbytes for i in shared), default=0)
        self._buffers = [_Buffer(aligned_buffer(self._size, pin)) for _ in range(buffers if shared else 0)]
        self._own = {i: _Buffer(aligned_buffer(spans[i].nbytes, pin)) for i in own}  # each held unit's buffer
        self._lock = threading.Lock()
        self.grown = 0  # buffers added beyond the plan's (more blocks held at once than it counted)

    def covers(self, index: int) -> bool:
        return index in self.spans

    @property
    def buffer_bytes(self) -> int:
        return sum(b.data.numel() for b in (*self._buffers, *self._own.values()))

    def start(self, index: int) -> None:
        """Begin reading ``index``'s masters if a buffer is free (else :meth:`take` reads them when they are needed)."""
        with self._lock:
            if self._holding(index) is None:
                free = self._free(index)
                if free is not None:
                    self._read(free, index)

    def take(self, index: int) -> dict[nn.Parameter, Tensor]:
        """``index``'s masters as views of a buffer, read by now; held until :meth:`drop`."""
        with self._lock:
            buffer = self._holding(index)
            if buffer is None:
                buffer = self._free(index)
                if buffer is None:  # a read-ahead nobody holds yet gives way, else one more buffer
                    buffer = next((b for b in self._buffers if not b.taken), None)
                    if buffer is not None:
                        self._settle(buffer)
                    else:
                        buffer = _Buffer(aligned_buffer(self._size, self._pin))
                        self._buffers.append(buffer)
                        self.grown += 1
                self._read(buffer, index)
            buffer.taken = True
        assert buffer.read is not None
        self.io.wait(buffer.read)
        span = self.spans[index]
        return {p: buffer.data[at:at + shape.numel() * dtype.itemsize].view(dtype).view(shape)
                for p, (at, shape, dtype) in span.views.items()}

    def drop(self, index: int) -> None:
        """The block is released: its buffer may take another unit (its read finished: :meth:`take` waited)."""
        with self._lock:
            buffer = self._holding(index)
            if buffer is not None:
                self._settle(buffer)

    def forget(self, index: int, keep_taken: bool = False) -> None:
        """``index``'s file is about to change (its host step): a read-ahead of the old masters goes. Taken (the compute
        holds it), it stays where ``keep_taken`` (the caller knows the compute reads none of what steps), else that is
        an error."""
        with self._lock:
            buffer = self._holding(index)
            if buffer is not None:
                if buffer.taken:
                    if keep_taken:
                        return
                    raise RuntimeError(f"unit {index}'s masters are stepped while its block still computes on them")
                self._settle(buffer)

    def forget_all(self) -> None:
        """Every read-ahead nobody holds goes (the files changed through their maps: a checkpoint loaded)."""
        with self._lock:
            for buffer in (*self._buffers, *self._own.values()):
                if buffer.unit is not None and not buffer.taken:
                    self._settle(buffer)

    def _holding(self, index: int) -> _Buffer | None:
        if index in self._own:
            return self._own[index] if self._own[index].unit == index else None
        return next((b for b in self._buffers if b.unit == index), None)

    def _free(self, index: int) -> _Buffer | None:
        """A buffer ``index`` may be read into now: its own (a held unit's), else a shared one nobody uses."""
        if index in self._own:
            return self._own[index]
        return next((b for b in self._buffers if b.unit is None), None)

    def _read(self, buffer: _Buffer, index: int) -> None:
        span = self.spans[index]
        buffer.unit, buffer.taken = index, False
        buffer.read = self.io.read(span.file, buffer.data, 0, align_up(span.nbytes), urgent=True)

    def _settle(self, buffer: _Buffer) -> None:
        """Free ``buffer`` once no read writes into it any more."""
        if buffer.read is not None:
            self.io.wait(buffer.read)
        buffer.unit, buffer.read, buffer.taken = None, None, False
