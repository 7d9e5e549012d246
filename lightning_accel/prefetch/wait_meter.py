"""Per-step data wait and step time of a training loop.

The wait of step ``i`` is the time from the end of step ``i - 1`` (or from the start of
the epoch) to the arrival of batch ``i``; the step time is from that arrival to the end
of step ``i``. Both come from one monotonic clock that callers may replace, so the
arithmetic is testable without sleeping. Two more clocks, this thread's time on a CPU
and its time queued for one (``/proc/.../schedstat``), say how much of each wait the
process spent computing: with no loader workers the loading runs in this process, so
the share ``on CPU / (wait - queued)`` tells I/O-bound items (mostly sleeping) from
CPU-bound ones, which decides how many workers the cores can take. CPU time over wall
time would not: on a shared machine a busy thread gets a fraction of a core and looks
idle (measured here: 0.30 CPU seconds per second for a pure busy loop under a load
average of 6 on 2 cores), while counting the queueing as work makes a sleeping thread,
which queues at each wake-up, look busy (0.3 at a load average of 9).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def sched_s(pid: int | str = "self") -> tuple[float, float] | None:
    """Seconds the (main thread of the) process ``pid`` has spent on a CPU and queued for one.

    From ``/proc/PID/schedstat`` (Linux); ``None`` where it cannot be read.
    """
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            on_cpu, queued = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(on_cpu) / 1e9, int(queued) / 1e9


def thread_cpu_clock() -> float:
    """This thread's seconds on a CPU (its CPU time where schedstat is missing)."""
    t = sched_s("thread-self")
    return t[0] if t is not None else time.process_time()


def thread_queue_clock() -> float:
    """This thread's seconds queued for a CPU (0 where schedstat is missing)."""
    t = sched_s("thread-self")
    return t[1] if t is not None else 0.0


def _zero() -> float:
    return 0.0


@dataclass
class WaitStats:
    """Means over a window of steps, in seconds."""

    steps: int
    wait_s: float
    step_s: float
    wait_cpu_s: float = 0.0  # of ``wait_s``, seconds this thread was on a CPU
    wait_queued_s: float = 0.0  # of ``wait_s``, seconds it was queued for one

    @property
    def wait_cpu_share(self) -> float:
        """CPU seconds per second of waiting not spent queued, in [0, 1]: near 0 for I/O-bound loading here."""
        own = self.wait_s - self.wait_queued_s
        return min(1.0, self.wait_cpu_s / own) if own > 0 else 0.0

    @property
    def wait_fraction(self) -> float:
        """Share of wall time spent waiting for data: 0 is compute-bound, 1 is all waiting."""
        total = self.wait_s + self.step_s
        return self.wait_s / total if total > 0 else 0.0

    @property
    def throughput(self) -> float:
        """Steps per second."""
        total = self.wait_s + self.step_s
        return 1.0 / total if total > 0 else 0.0


@dataclass
class WaitMeter:
    """Records ``waits[i]`` and ``steps[i]`` from three calls: epoch start, batch arrival, step end."""

    clock: Callable[[], float] = time.perf_counter
    cpu_clock: Callable[[], float] = thread_cpu_clock
    queue_clock: Callable[[], float] | None = None  # default: this thread's, with the default cpu_clock; else none
    waits: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    wait_cpus: list[float] = field(default_factory=list)
    wait_queued: list[float] = field(default_factory=list)
    _last_end: float | None = None
    _last_end_cpu: float = 0.0
    _last_end_queued: float = 0.0

    def __post_init__(self) -> None:
        if self.queue_clock is None:
            self.queue_clock = thread_queue_clock if self.cpu_clock is thread_cpu_clock else _zero
    _arrival: float | None = None

    def start(self) -> None:
        """The loop is about to ask for its first batch (epoch start)."""
        self._last_end, self._last_end_cpu = self.clock(), self.cpu_clock()
        self._last_end_queued = self.queue_clock()  # type: ignore[misc]
        self._arrival = None

    def batch_arrived(self) -> None:
        now, cpu, queued = self.clock(), self.cpu_clock(), self.queue_clock()  # type: ignore[misc]
        if self._last_end is not None:  # a batch with no known start is not counted as a wait
            self.waits.append(now - self._last_end)
            self.wait_cpus.append(cpu - self._last_end_cpu)
            self.wait_queued.append(queued - self._last_end_queued)
        self._arrival = now

    def step_ended(self) -> None:
        now = self.clock()
        if self._arrival is not None and len(self.steps) < len(self.waits):
            self.steps.append(now - self._arrival)
        self._arrival = None
        self._last_end, self._last_end_cpu = now, self.cpu_clock()
        self._last_end_queued = self.queue_clock()  # type: ignore[misc]

    def __len__(self) -> int:
        return len(self.steps)

    def stats(self, last: int | None = None, skip: int = 0, stop: int | None = None) -> WaitStats:
        """Means over complete steps ``skip:stop`` (or the ``last`` ones before ``stop``), e.g. to drop warm-up steps."""
        n = len(self.steps) if stop is None else min(stop, len(self.steps))
        start = max(skip, n - last) if last is not None else skip
        return self.stats_of(range(start, n))

    def stats_of(self, indices: Sequence[int]) -> WaitStats:
        """Means over the complete steps ``indices`` (e.g. those no background work disturbed)."""
        indices = [i for i in indices if 0 <= i < len(self.steps)]
        if not indices:
            return WaitStats(0, 0.0, 0.0)
        k = len(indices)
        mean = lambda xs: sum(xs[i] for i in indices) / k  # noqa: E731
        return WaitStats(k, mean(self.waits), mean(self.steps), mean(self.wait_cpus), mean(self.wait_queued))
