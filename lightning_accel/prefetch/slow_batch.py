"""Noticing, while it loads, that a batch this process loads itself is slow: a timer on a side thread.

Why. Tuned from a ``DataLoader`` at its defaults (no workers), the first batch is loaded in
the training thread, and nothing is known before it arrives: not the step time, not the
batch's size. Waiting for it, and then for one more measured step, before starting any
workers costs one to two whole batches on a slow loader (seed 004's workload: 0.54 s each,
against hand-set workers forked when the epoch began). But a batch that has already taken
as long as starting a worker (12-50 ms here) has already cost more than starting one
would: from then on a worker started now is cheaper than waiting to know, the rule of
renting until the rent equals the price. :class:`SlowBatchWatch` runs a callback on a
timer thread once the batch being loaded has taken that long, with the share of that
time the loading thread spent on a CPU (near 0 for I/O-bound items, near 1 for decoding),
which is all that is known by then. The callback must only build and start things; the
loading thread adopts them once its batch is in (:meth:`SlowBatchWatch.stop`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from lightning_accel.prefetch.wait_meter import sched_s

__all__ = ["SlowBatchWatch"]

T = TypeVar("T")


def _thread_sched(native_id: int) -> tuple[float, float] | None:
    """Seconds the thread ``native_id`` of this process spent on a CPU and queued for one."""
    return sched_s(f"self/task/{native_id}")


class SlowBatchWatch(Generic[T]):
    """Calls ``on_slow(cpu_share)`` on a timer thread if :meth:`stop` is not called within ``after_s``.

    Created by the thread about to load a batch; ``cpu_share`` is that thread's CPU seconds
    per second not spent queued, since then (1.0, the cautious value, where
    ``/proc/self/task/*/schedstat`` cannot be read). :meth:`stop` returns what ``on_slow``
    returned, or ``None`` if it did not run (or raised: a failed guess is no reason to fail the
    batch; whoever needs the thing again meets the error there).
    """

    def __init__(self, after_s: float, on_slow: Callable[[float], T | None]) -> None:
        self._on_slow = on_slow
        self._tid = threading.get_native_id()
        self._began = time.perf_counter()
        self._sched = _thread_sched(self._tid)
        self._result: T | None = None
        self.fired = False
        self._timer = threading.Timer(max(0.0, after_s), self._fire)
        self._timer.name = "prefetch-slow-batch"
        self._timer.daemon = True
        self._timer.start()

    def cpu_share(self) -> float:
        """The watched thread's CPU share since the watch began."""
        now = _thread_sched(self._tid)
        if now is None or self._sched is None:
            return 1.0
        own = (time.perf_counter() - self._began) - (now[1] - self._sched[1])
        return min(1.0, max(0.0, (now[0] - self._sched[0]) / own)) if own > 0 else 1.0

    def _fire(self) -> None:
        self.fired = True
        try:
            self._result = self._on_slow(self.cpu_share())
        except Exception:  # noqa: BLE001 - see the class docstring
            self._result = None

    def stop(self) -> T | None:
        """The batch is in: no call from now on; waits for one under way and returns its result."""
        self._timer.cancel()
        self._timer.join()
        return self._result
