"""Per-step data wait and step time of a training loop.

The wait of step ``i`` is the time from the end of step ``i - 1`` (or from the start of
the epoch) to the arrival of batch ``i``; the step time is from that arrival to the end
of step ``i``. Both come from one monotonic clock that callers may replace, so the
arithmetic is testable without sleeping.
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
    waits: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    _last_end: float | None = None
    _arrival: float | None = None

    def start(self) -> None:
        """The loop is about to ask for its first batch (epoch start)."""
        self._last_end = self.clock()
        self._arrival = None

    def batch_arrived(self) -> None:
        now = self.clock()
        if self._last_end is not None:  # a batch with no known start is not counted as a wait
            self.waits.append(now - self._last_end)
        self._arrival = now

    def step_ended(self) -> None:
        now = self.clock()
        if self._arrival is not None and len(self.steps) < len(self.waits):
            self.steps.append(now - self._arrival)
        self._arrival = None
        self._last_end = now

    def __len__(self) -> int:
        return len(self.steps)

    def stats(self, last: int | None = None, skip: int = 0) -> WaitStats:
        """Means over complete steps ``skip:`` (or the ``last`` ones), e.g. to drop warm-up steps."""
        n = len(self.steps)
        start = max(skip, n - last) if last is not None else skip
        waits, steps = self.waits[start:n], self.steps[start:n]
        if not steps:
            return WaitStats(0, 0.0, 0.0)
        return WaitStats(len(steps), sum(waits) / len(steps), sum(steps) / len(steps))
