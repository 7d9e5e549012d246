"""Workers started while the first batch loads: which ones, whether they stay, what they say of the start.

Why. Tuned from a loader at its defaults, the first batch loads in the training thread, and
the search used to start workers only once that step (and, unless it waited over 3x its
compute, one more) had measured the start: one or two whole batches loaded here that
hand-set workers, forked when the epoch began, would have had ready (seed 004's workload:
0.54 s each). :class:`~lightning_accel.prefetch.slow_batch.SlowBatchWatch` notices the slow
batch while it loads; :class:`FirstBatchWorkers` decides what to start then, from the
little that is known (the loading thread's CPU share), and after that step whether they
stay (:meth:`FirstBatchWorkers.keeps`). If they do, the start has been measured on the
warm-up step alone, which may carry one-off costs; the workers' own measurement of the
items restates it (:func:`restate_start`) before the run is called data-bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_accel.cpu_budget import CpuBudget
from lightning_accel.prefetch.search import Budget, Trial, worker_settings
from lightning_accel.prefetch.settings import LoaderSettings
from lightning_accel.prefetch.wait_meter import WaitStats

__all__ = ["FirstBatchWorkers", "restate_start"]


@dataclass(frozen=True)
class FirstBatchWorkers:
    """The policy for workers started while the first batch of a start without workers loads."""

    start: LoaderSettings
    budget: Budget
    cpu: CpuBudget | None = None
    cuda: bool = False
    busy_threshold: float = 0.5  # the loading's CPU share above which items count as CPU-bound

    @property
    def cores(self) -> int:
        return self.cpu.cores if self.cpu is not None else 1

    def choose(self, cpu_share: float) -> LoaderSettings:
        """What to start, knowing only that the batch is slow and ``cpu_share`` of its loading ran on a CPU
        (called on a timer thread: reads only).

        I/O-bound items get the worker budget: what the search reaches on seed 004 and the
        stream, and spare I/O workers are cheap. CPU-bound ones get a worker per core of the
        CPU budget: more would only share the cores.
        """
        busy = cpu_share >= self.busy_threshold
        workers = min(self.cores, self.budget.max_workers) if busy else self.budget.max_workers
        return worker_settings(self.start, workers, self.cuda)

    def keeps(self, started: LoaderSettings, first_step: WaitStats, batch_bytes: int) -> bool:
        """Whether the workers ``started`` stay after the step that loaded the slow batch: it waited longer
        than it computed, their buffers fit the memory budget now that a batch's size is known, and
        CPU-bound items (now measured over the whole batch) keep them within the CPU budget."""
        return (
            first_step.wait_s > first_step.step_s
            and self.budget.allows(started, batch_bytes)
            and (first_step.wait_cpu_share < self.busy_threshold or started.num_workers <= self.cores)
        )


def restate_start(start: Trial, item_s: float) -> bool:
    """The start (no workers), measured on the warm-up step alone, restated from the first candidate's items.

    That step's batch may have carried one-off costs (a cold cache, first file opens: 300 ms
    where later items took 1 ms). The first candidate's workers each took ``item_s`` per
    batch (the median time a worker spent on its next queued batch: where training is slower
    than the workers, some waited for it to take one, which the mean would count), what
    loading here would take, or more where they shared the cores: the start would wait the
    lesser of the two. Restated so, it carries no spread of its own: it comes from the very
    samples the candidate is measured on, so their spread (the candidate's) is the only noise
    between the two; counting it twice kept the defaults on JPEG decoding where 2 workers waited
    20 +- 7 ms against the start's 32. Returns whether it was restated.
    """
    if item_s >= start.interval_s:
        return False
    start.interval_s = start.wait_s = item_s
    start.spread_s, start.fastest_s = 0.0, None
    return True
