"""One inner loader of a :class:`~lightning_accel.prefetch.TunableLoader`: its plan, stamps, workers.

An inner loader serves a segment of an epoch: the batches of a :class:`_Plan` (map-style,
read lazily so lowering ``stop`` stops its workers early) or a stream copy positioned
where it takes over. Its ``collate_fn`` stamps every batch with the (system-wide
monotonic) time its worker finished it, which is what the tuner measures a candidate by.
Starting one forks its workers, which can run on a thread while the current loader
serves; ``cpu_busy`` says how much of their time the workers wanted the CPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_accel.prefetch.loader_rebuild import more_workers_than_cores, rebuild_loader
from lightning_accel.prefetch.settings import LoaderSettings
from lightning_accel.prefetch.wait_meter import sched_s


_START_S_PER_WORKER = [0.05]  # seconds to start one worker: a prior, then the last start measured here


def worker_start_s() -> float:
    """Seconds one worker took to start at the last start in this process (forking, pipes); 50 ms before any."""
    return _START_S_PER_WORKER[0]


class _Plan:
    """Batches ``items[start:stop]`` (or indices), read lazily: lowering ``stop`` stops the workers early."""

    def __init__(self, items: list | None = None, start: int = 0) -> None:
        self.reset(items or [], start)

    def reset(self, items: list, start: int = 0) -> None:
        self.items, self.start, self.stop = items, start, len(items)

    def __iter__(self) -> Iterator:
        i = self.start
        while i < min(self.stop, len(self.items)):  # re-read each time: ``stop`` may move while a loader runs
            yield self.items[i]
            i += 1

    def __len__(self) -> int:
        return max(0, self.stop - self.start)


class _Stamped:
    """``collate_fn`` that also returns when the batch was finished (``time.monotonic`` is system-wide)."""

    def __init__(self, collate_fn: Callable) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: Any) -> tuple[float, Any]:
        batch = self.collate_fn(items)
        return time.monotonic(), batch


class _Inner:
    """One inner loader over its own plan (or positioned stream copy), with its iterator once started.

    ``first``: the epoch's batch count at which it starts serving; ``position``: for a
    resumable stream, the stream position of its first item.
    """

    def __init__(
        self,
        template: DataLoader,
        settings: LoaderSettings,
        plan: _Plan | None,
        dataset: Any = None,
        first: int = 0,
        position: int = 0,
    ) -> None:
        self.settings = settings
        self.plan = plan
        self.first, self.position = first, position
        # Its own generator for the workers' base seed: starting an inner loader must not draw from the
        # user's (which also shuffles) or the global one, or the tuned run's orders and RNG would drift.
        seed = template.generator.initial_seed() if template.generator is not None else torch.initial_seed()
        self.loader = rebuild_loader(
            template,
            settings,
            plan,
            collate_fn=_Stamped(template.collate_fn),
            dataset=dataset,
            generator=torch.Generator().manual_seed(seed + first),
        )
        self.iterator: Any = None
        self.restart = False  # a stream started again from its beginning (counted when it takes over)

    def start(self) -> Iterator:
        self.began = time.monotonic()
        with more_workers_than_cores():
            self.iterator = iter(self.loader)  # workers start fetching now
        self.started_at = time.monotonic()
        if self.settings.num_workers:
            _START_S_PER_WORKER[0] = (self.started_at - self.began) / self.settings.num_workers
        return self.iterator

    def cpu_busy(self) -> float | None:
        """The workers' seconds on a CPU per second since they started (or since the last call), not counting
        time queued for one.

        Near 0 when items wait on I/O, near 1 when they keep the workers computing, however
        few cores they share and however busy other processes keep them
        (``/proc/PID/schedstat``, Linux). ``None`` without workers or where it cannot be read.
        """
        workers = getattr(self.iterator, "_workers", None)
        if not workers or getattr(self, "started_at", None) is None:
            return None
        times = [sched_s(worker.pid) for worker in workers]
        if any(t is None for t in times):
            return None
        now = time.monotonic()
        on_cpu, queued = sum(t[0] for t in times), sum(t[1] for t in times)  # type: ignore[index]
        # Since the last call: the window the caller cares about, not the idle start-up before training.
        then, cpu0, queued0 = getattr(self, "_busy_mark", (self.started_at, 0.0, 0.0))
        self._busy_mark = (now, on_cpu, queued)
        own = (now - then) * len(workers) - (queued - queued0)
        return min(1.0, (on_cpu - cpu0) / own) if own > 0 else None

    def start_in_background(self) -> None:
        """Fork the workers on a thread: forking a process holding a big heap takes ~50 ms per worker."""

        def start() -> None:
            try:
                self.start()
            except BaseException as err:  # re-raised (by starting again) where the loader is needed
                self._failed = err

        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=start, name="prefetch-start", daemon=True)
        self._thread.start()

    @property
    def starting(self) -> bool:
        """Its background start is under way."""
        thread = getattr(self, "_thread", None)
        return thread is not None and thread.is_alive()

    def started(self) -> Iterator:
        """The iterator, once the background start is over (started again here if it failed there)."""
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join()
            self._thread = None
        if self.iterator is None:
            self.start()
        return self.iterator

    def close(self, background: bool = False) -> None:
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join()
            self._thread = None
        iterator, self.iterator = self.iterator, None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is None:
            return
        if background:  # the thread keeps the iterator alive until its workers have joined
            threading.Thread(target=shutdown, name="prefetch-shutdown", daemon=True).start()
        else:
            shutdown()
