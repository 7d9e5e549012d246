"""Per-step data wait and step time of a training loop.

The wait of step ``i`` is the time from the end of step ``i - 1`` (or from the start of
the epoch) to the arrival of batch ``i``; the step time is from that arrival to the end
of step ``i``. Both come from one monotonic clock that callers may replace, so the
arithmetic is testable without sleeping. A second clock, this thread's runnable time
(on a CPU or queued for one), says how much of each wait the process itself spent
wanting the CPU: with no loader workers the loading runs in this process, so that share
tells I/O-bound items (mostly sleeping) from CPU-bound ones, which decides how many
workers the cores can take. CPU time alone would not: on a shared machine a busy thread
gets a fraction of a core and looks half idle (measured here: 0.30 CPU seconds per
second, 1.00 runnable, for a pure busy loop under a load average of 6 on 2 cores).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


def runnable_s(pid: int | str = "self") -> float | None:
    """Seconds the (main thread of the) process ``pid`` has been running or waiting in a run queue.

    From ``/proc/PID/schedstat`` (Linux; nanoseconds on CPU, nanoseconds waiting for it);
    ``None`` where it cannot be read.
    """
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            on_cpu, queued = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return (int(on_cpu) + int(queued)) / 1e9


def runnable_clock() -> float:
    """This thread's runnable seconds (:func:`runnable_s`), or its CPU time where schedstat is missing."""
    t = runnable_s("thread-self")
    return t if t is not None else time.process_time()


@dataclass
class WaitStats:
    """Means over a window of steps, in seconds."""

    steps: int
    wait_s: float
    step_s: float
    wait_cpu_s: float = 0.0  # of ``wait_s``, seconds this thread was runnable (on a CPU or queued for one)

    @property
    def wait_cpu_share(self) -> float:
        """Runnable seconds per second of waiting, in [0, 1]: near 0 for I/O-bound loading in this process."""
        return min(1.0, self.wait_cpu_s / self.wait_s) if self.wait_s > 0 else 0.0

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
    cpu_clock: Callable[[], float] = runnable_clock
    waits: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    wait_cpus: list[float] = field(default_factory=list)
    _last_end: float | None = None
    _last_end_cpu: float = 0.0
    _arrival: float | None = None

    def start(self) -> None:
        """The loop is about to ask for its first batch (epoch start)."""
        self._last_end, self._last_end_cpu = self.clock(), self.cpu_clock()
        self._arrival = None

    def batch_arrived(self) -> None:
        now, cpu = self.clock(), self.cpu_clock()
        if self._last_end is not None:  # a batch with no known start is not counted as a wait
            self.waits.append(now - self._last_end)
            self.wait_cpus.append(cpu - self._last_end_cpu)
        self._arrival = now

    def step_ended(self) -> None:
        now = self.clock()
        if self._arrival is not None and len(self.steps) < len(self.waits):
            self.steps.append(now - self._arrival)
        self._arrival = None
        self._last_end, self._last_end_cpu = now, self.cpu_clock()

    def __len__(self) -> int:
        return len(self.steps)

    def stats(self, last: int | None = None, skip: int = 0) -> WaitStats:
        """Means over complete steps ``skip:`` (or the ``last`` ones), e.g. to drop warm-up steps."""
        n = len(self.steps)
        start = max(skip, n - last) if last is not None else skip
        waits, steps, cpus = self.waits[start:n], self.steps[start:n], self.wait_cpus[start:n]
        if not steps:
            return WaitStats(0, 0.0, 0.0)
        return WaitStats(len(steps), sum(waits) / len(steps), sum(steps) / len(steps), sum(cpus) / len(steps))
