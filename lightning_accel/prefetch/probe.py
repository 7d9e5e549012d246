"""Measuring how fast a loader delivers batches on its own (no training step in between).

Pulling batches back to back, the time between the first and the last of ``n``
batches over ``n - 1`` is the loader's sustained interval. The first batch is excluded
because it carries the worker start-up; ``n - 1`` is a whole number of rounds of every
worker, so a burst of batches buffered during start-up does not pass for throughput.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_accel.prefetch.loader_rebuild import is_iterable, more_workers_than_cores, rebuild_loader
from lightning_accel.prefetch.search import spread
from lightning_accel.prefetch.settings import LoaderSettings


@dataclass
class Probe:
    interval_s: float  # sustained seconds per batch
    batches: int  # batches pulled
    elapsed_s: float  # wall time the probe cost, start-up included
    batch_bytes: int  # bytes of tensors in the first batch
    spread_s: float = 0.0  # standard error of interval_s over whole rounds of workers (0: one round)


def batch_nbytes(batch: Any) -> int:
    """Bytes held by the tensors in a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        return batch.nelement() * batch.element_size()
    if isinstance(batch, dict):
        return sum(batch_nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_nbytes(v) for v in batch)
    return 0


def probe_batches(settings: LoaderSettings, min_batches: int = 4) -> int:
    # Workers start together, so batches arrive in rounds of w = num_workers; k * w + 1
    # batches span whole rounds after the first arrival (a part round would overstate speed).
    w = settings.num_workers
    if w == 0:
        return min_batches
    return w * max(1, math.ceil((min_batches - 1) / w)) + 1


def _probe_plan(loader: DataLoader, n: int) -> list:
    """The first ``n`` batches (or indices) of the dataset in order: the user's sampler is not advanced."""
    size = len(loader.dataset)  # type: ignore[arg-type]
    if loader.batch_sampler is None:
        return [i % size for i in range(n)]
    bs = loader.batch_sampler.batch_size  # type: ignore[attr-defined]
    return [[(k * bs + j) % size for j in range(bs)] for k in range(n)]


def measure_loader(
    loader: DataLoader, settings: LoaderSettings, min_batches: int = 4, clock: Callable[[], float] = time.perf_counter
) -> Probe:
    """Build ``loader`` with ``settings``, pull enough batches back to back, shut it down."""
    n = probe_batches(settings, min_batches)
    plan = None if is_iterable(loader) else _probe_plan(loader, n)
    candidate = rebuild_loader(loader, settings, plan)
    start = clock()
    with more_workers_than_cores():
        iterator = iter(candidate)
    arrivals: list[float] = []
    nbytes = 0
    try:
        for batch in itertools.islice(iterator, n):
            arrivals.append(clock())
            if not nbytes:
                nbytes = batch_nbytes(batch)
    finally:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
    noise = 0.0
    if len(arrivals) < 2:
        interval = arrivals[0] - start if arrivals else float("inf")
    else:
        interval = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)
        w = max(1, settings.num_workers)  # per round of w batches: the samples whose spread is the noise
        rounds = [(arrivals[i + w] - arrivals[i]) / w for i in range(0, len(arrivals) - w, w)]
        noise = spread(rounds)
    return Probe(interval, len(arrivals), clock() - start, nbytes, noise)
