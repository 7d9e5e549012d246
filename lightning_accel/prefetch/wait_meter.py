"""Per-step data wait and step time of a training loop.

The wait of step ``i`` is the time from the end of step ``i - 1`` (or from the start of
the epoch) to the arrival of batch ``i``; the step time is from that arrival to the end
of step ``i``. Both come from one monotonic clock that callers may replace, so the
arithmetic is testable without sleeping. A second clock, this process's CPU time,
says how much of each wait the process itself spent working: with no loader workers
the loading runs in this process, so that share tells I/O-bound items (mostly
sleeping) from CPU-bound ones, which decides how many new workers the cores can start
at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class WaitStats:
    """Means over a window of steps, in seconds."""

    steps: int
    wait_s: float
    step_s: float
    wait_cpu_s: float = 0.0  # of ``wait_s``, seconds this process spent on the CPU

    @property
    def wait_cpu_share(self) -> float:
        """CPU seconds per second of waiting, in [0, 1]: near 0 for I/O-bound loading in this process."""
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
    cpu_clock: Callable[[], float] = time.process_time
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
