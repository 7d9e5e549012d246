"""Host buffers to and from files at the disk's speed: O_DIRECT, aligned buffers, a few threads.

The NVMe tier (:mod:`.tier`) moves each unit's optimizer state and masters between a file and a
reusable host buffer once per step. What decides that path, measured on the 2-core sandbox's
virtual disk (ext4; ``lightning-accel bench offload --nvme`` prints it again next to each run):

- ``O_DIRECT``: the bytes go from the buffer to the disk and back without the page cache, so the
  host memory a run uses is its buffers and nothing else (a page cache the size of the state would
  be charged to the run's memory cgroup, the limit the tier exists to respect), and a read comes
  from the disk, not from a copy the kernel may or may not still hold;
- ``os.preadv`` / ``os.pwritev`` in a few threads: the GIL is released inside the syscall, so four
  threads keep four requests in flight; 4 MiB requests with four threads read at 1.9-2.3 GB/s and
  write at 4.2-4.8 GB/s here, against 1.2 / 0.6 GB/s with one thread and 1 MiB requests (dd's one
  stream reads 1.8 GB/s at 4 MiB). No compiler, no library beyond Python's ``os``; io_uring
  bindings and DeepSpeed's aio op need one (its libaio builds are what its users report failing).

``O_DIRECT`` asks for buffer addresses, file offsets and lengths aligned to the logical block size;
everything here is aligned to :data:`ALIGN` (4096, every disk's page-sized block). Pinned buffers
(CUDA) are page-aligned by their allocator; plain ones are cut from a slightly larger tensor.
Nothing here imports Lightning.
"""

from __future__ import annotations

import errno
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_accel.offload.device_memory import DeviceMemory
from lightning_accel.offload.tier_plan import human

ALIGN = 4096
CHUNK = 4 << 20  # bytes per request: 4 MiB (see the module docstring)
THREADS = 4  # requests in flight


def align_up(nbytes: int, align: int = ALIGN) -> int:
    return (nbytes + align - 1) // align * align


def aligned_buffer(nbytes: int, pin: bool | DeviceMemory = False) -> Tensor:
    """A uint8 host tensor of ``nbytes`` (rounded up to :data:`ALIGN`) whose address is aligned for O_DIRECT; ``pin``:
    page-locked, or the device's layer (:mod:`.device_memory`: pinned and counted on CUDA, counted on its stand-in)."""
    nbytes = align_up(max(nbytes, 1))
    if isinstance(pin, DeviceMemory):
        if pin.cuda:
            buf = pin.empty_pinned(nbytes)
            if buf.data_ptr() % ALIGN == 0:
                return buf
            del buf
        buf = pin.empty_pinned(nbytes + ALIGN)
    elif pin:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if buf.data_ptr() % ALIGN == 0:
            return buf
        del buf
        buf = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
    else:
        buf = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-buf.data_ptr()) % ALIGN
    return buf[skip:skip + nbytes]


class DiskFull(OSError):
    """The tier's directory has no room for its files; one line: the path, the bytes needed, the free bytes, the fix."""

    explained = True

    def __init__(self, path: str, needed: int, free: int | None, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.path, self.needed, self.free = path, needed, free

    def __str__(self) -> str:
        free = "an unknown amount" if self.free is None else human(self.free)
        return (f"strategy.nvme_path: no room in '{self.path}' for the NVMe tier: it needs {self.needed:,} bytes "
                f"({human(self.needed)}) and {free} is free there; free that much, point nvme_path at a larger disk, "
                "or raise host_budget so that less goes to disk")


def free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


@dataclass
class IOCounters:
    """Bytes through the disk and the seconds a caller waited for it (the tier's share of OffloadStats)."""

    read_bytes: int = 0
    write_bytes: int = 0
    wait_seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, read: int = 0, write: int = 0, wait: float = 0.0) -> None:
        with self.lock:
            self.read_bytes += read
            self.write_bytes += write
            self.wait_seconds += wait


class DirectFile:
    """One file opened for O_DIRECT reads and writes of aligned spans, in requests of :data:`CHUNK` bytes.

    ``O_DIRECT`` falls back to buffered I/O where the filesystem refuses it (tmpfs says EINVAL at open);
    :attr:`direct` says which. The file is preallocated to ``size`` bytes (``posix_fallocate``), so a disk
    without room fails here, before any work, and never in the middle of a step.
    """

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = align_up(size)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
            self.direct = hasattr(os, "O_DIRECT")
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            self.fd = os.open(path, flags, 0o600)
            self.direct = False
        try:
            if self.size:
                os.posix_fallocate(self.fd, 0, self.size)
        except OSError as err:
            os.close(self.fd)
            os.unlink(path)
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(os.path.dirname(path), self.size, free_bytes(os.path.dirname(path)), err) from None
            raise

    def requests(self, buf: Tensor, offset: int, nbytes: int) -> list[tuple[memoryview, int]]:
        """(buffer slice, file offset) of each request covering ``nbytes`` from ``offset`` (both aligned)."""
        assert offset % ALIGN == 0 and buf.data_ptr() % ALIGN == 0, "O_DIRECT spans must be aligned"
        nbytes = align_up(nbytes)
        view = memoryview(buf.numpy()).cast("B")
        return [(view[at:at + min(CHUNK, nbytes - at)], offset + at) for at in range(0, nbytes, CHUNK)]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class DiskIO:
    """A few threads issuing the requests of reads and writes, each a :class:`~concurrent.futures.Future`.

    One pool for the whole tier: four requests in flight saturate this disk (module docstring), and more
    threads would only compete with the host step for the rank's cores (they sleep in the syscall).
    Requests wait in one queue by priority, then in order: a read the compute waits for (``urgent``: a
    block's weights) goes before the requests of the host step's reads and writes queued ahead of it,
    which are tens of MB a unit and would otherwise hold the forward up behind them.
    """

    def __init__(self, counters: IOCounters, threads: int = THREADS) -> None:
        self.counters = counters
        self._queue: queue.PriorityQueue[tuple[int, int, Callable[[], None] | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._threads = [threading.Thread(target=self._work, name=f"l2l-nvme_{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            _, _, task = self._queue.get()
            if task is None:
                return
            task()

    def _submit_part(self, priority: int, fn: Callable[..., None], *args: object) -> Future[None]:
        future: Future[None] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                fn(*args)
            except BaseException as err:  # noqa: BLE001 (handed to the waiter)
                future.set_exception(err)
            else:
                future.set_result(None)

        self._queue.put((priority, next(self._order), run))
        return future

    def read(self, file: DirectFile, buf: Tensor, offset: int, nbytes: int, urgent: bool = False) -> Future[None]:
        return self.read_spans(file, buf, [(offset, 0, nbytes)], urgent)

    def write(self, file: DirectFile, buf: Tensor, offset: int, nbytes: int) -> Future[None]:
        return self.write_spans(file, buf, [(offset, 0, nbytes)])

    def read_spans(self, file: DirectFile, buf: Tensor, spans: list[tuple[int, int, int]], urgent: bool = False) -> Future[None]:
        """Read each ``(file offset, buffer offset, bytes)`` of ``spans`` (aligned) into ``buf``: one future for all."""
        return self._submit(file, buf, spans, os.preadv, write=False, priority=0 if urgent else 1)

    def write_spans(self, file: DirectFile, buf: Tensor, spans: list[tuple[int, int, int]]) -> Future[None]:
        return self._submit(file, buf, spans, os.pwritev, write=True, priority=1)

    def _submit(self, file: DirectFile, buf: Tensor, spans: list[tuple[int, int, int]],
                call: Callable[[int, list[memoryview], int], int], write: bool, priority: int) -> Future[None]:
        requests = [r for offset, at, nbytes in spans for r in file.requests(buf[at:], offset, nbytes)]
        parts = [self._submit_part(priority, _whole, call, file, view, at) for view, at in requests]
        done: Future[None] = Future()
        total = sum(align_up(nbytes) for _, _, nbytes in spans)
        remaining = [len(parts)]
        lock = threading.Lock()

        def one_done(part: Future[None]) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if not last or done.done():
                error = part.exception()
                if error is not None and not done.done():
                    done.set_exception(error)
                return
            errors = [p.exception() for p in parts if p.exception() is not None]
            if errors:
                done.set_exception(errors[0])
            else:
                self.counters.add(write=total) if write else self.counters.add(read=total)
                done.set_result(None)

        if not parts:
            done.set_result(None)
        for part in parts:
            part.add_done_callback(one_done)
        return done

    def wait(self, future: Future[None]) -> None:
        """Wait for ``future`` (re-raising its error), counting the time waited as time on the disk."""
        if future.done():
            future.result()
            return
        started = time.perf_counter()
        try:
            future.result()
        finally:
            self.counters.add(wait=time.perf_counter() - started)

    def close(self) -> None:
        """Finish what is queued, then stop the threads."""
        for _ in self._threads:
            self._queue.put((2, next(self._order), None))  # after every request
        for thread in self._threads:
            thread.join()


def _whole(call: Callable[[int, list[memoryview], int], int], file: DirectFile, view: memoryview, offset: int) -> None:
    """One request to the end: a short read or write (a signal, a filesystem's choice) goes on from where it stopped."""
    done = 0
    while done < len(view):
        n = call(file.fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"{'read' if call is os.preadv else 'write'} of {file.path} at {offset + done} returned {n}")
        done += n


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def give_large_frees_back() -> bool:
    """Make glibc hand freed allocations of 128 KiB and more straight back to the OS (``mallopt(M_MMAP_THRESHOLD)``, what
    ``MALLOC_MMAP_THRESHOLD_`` sets at start-up: glibc's own first threshold, held there; returns whether it could).

    Why the tier needs it: glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), after
    which blocks of that size come from the heap and stay in the process once freed. A run with the tier frees a
    model's worth of tensors once (the masters that moved to disk, a first step's optimizer state made in memory
    before it moves there, every step's gradients): measured on a 67M-parameter model, the process then kept 1.18 GB
    against 0.46-0.72 GB with the threshold fixed at 1 MiB, and a memory cgroup sized for the tier killed it. At 1 MiB
    the gradients of a block's smaller matrices (a 384-wide Llama's attention projections: 590 kB each) still came from
    the heap, freed by the host-step thread while the backward allocated the next ones: a 118M-parameter Llama's step
    peaked 117 MiB above its start where the plan counted 56 MiB, 75 MiB at 128 KiB (tests/strategies/test_l2l_tier_cgroup.py).
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 128 << 10))
    except (OSError, AttributeError):  # not glibc
        return False


def measure_bandwidth(directory: str, nbytes: int = 256 << 20, pin: bool = False) -> tuple[float, float]:
    """(read, write) bytes per second of this machine's disk under ``directory``, through the same path the tier
    uses (O_DIRECT, :data:`CHUNK` requests, :data:`THREADS` threads): the bench's I/O floor."""
    counters = IOCounters()
    io = DiskIO(counters)
    path = os.path.join(directory, f".lightning-accel-probe-{os.getpid()}-{threading.get_ident()}")
    buf = aligned_buffer(nbytes, pin)
    buf.fill_(7)
    file = DirectFile(path, nbytes)
    try:
        started = time.perf_counter()
        io.wait(io.write(file, buf, 0, nbytes))
        os.fdatasync(file.fd)
        write = nbytes / (time.perf_counter() - started)
        started = time.perf_counter()
        io.wait(io.read(file, buf, 0, nbytes))
        read = nbytes / (time.perf_counter() - started)
    finally:
        file.close()
        os.unlink(path)
        io.close()
    return read, write
