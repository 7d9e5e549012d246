"""The search for loader settings: doubling ``num_workers``, then hill-climbing, within budgets.

In the spirit of tf.data AUTOTUNE: a candidate is judged by the measured time between
batches its loader delivers (``interval_s``), against the time a training step takes
(``step_s``). Since worker processes run ahead of the step, the wait they leave is
about ``max(0, interval_s - step_s)``; without workers nothing overlaps and the wait is
``interval_s`` itself. The search doubles ``num_workers`` (2, 4, 8, ... or from twice
the start), starting at the first count that a model of the start's measurement calls
enough (item time / step time, as if workers overlapped perfectly), while that wait
shrinks; then it tries the midpoints between the best and the counts measured on either
side of it (or, after a jump, halfway down), leaving out a count that could not be
chosen even at its most optimistic; it stops as soon as the predicted wait is negligible
or the gains flatten. ``prefetch_factor`` stays the start's (2 by default): buffers absorb
uneven items but cannot raise the rate a count of workers makes, which is what the
wait is predicted from, so a deeper one could only win by noise (it was tried last,
until measured on JPEG decoding to cost a re-fork of the workers for no gain). Every measurement
carries its spread (the standard error of its samples, taken on the spot): a gain within
twice the combined spread is noise, so it does not count as progress, and a candidate
replaces the start only beyond it. With two or three samples a spread is itself rough,
so a candidate faster than every sample of the start (by more than its own noise) beats
it too. Among the candidates that beat the start, the mean wait decides: more workers
win when they cut it by more than a negligible share of the step and by ``min_gain``. Items that wait on I/O get ``headroom``: workers cost little there, and a count
that only just keeps up turns every hiccup into waiting. ``pin_memory`` and ``persistent_workers`` are decided by rule, not by
measurement: pinning only helps a CUDA copy, and persistence only saves the worker
start-up at each epoch boundary. The object is pure: it never touches a loader or a
clock, so the policy is tested against a simulated loader with a known optimum.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from lightning_accel.host_memory import available_host_bytes
from lightning_accel.cpu_budget import cpu_budget
from lightning_accel.prefetch.settings import LoaderSettings


@dataclass(frozen=True)
class Budget:
    """Per-rank limits: worker processes, and bytes of batches buffered at once."""

    max_workers: int
    memory_bytes: int

    def __post_init__(self) -> None:
        if isinstance(self.max_workers, bool) or not isinstance(self.max_workers, int) or self.max_workers <= 0:
            raise ValueError(
                f"max_workers={self.max_workers!r} must be a positive integer; pass max_workers=None to use "
                "4 x the cores per rank, or a count >= 1"
            )
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise ValueError(
                f"memory_budget_bytes={self.memory_bytes!r} must be a positive integer; pass memory_budget_bytes=None "
                "to use half the free RAM/shared memory per rank, or a byte count such as 2_000_000_000"
            )

    def allows(self, settings: LoaderSettings, batch_bytes: int) -> bool:
        return settings.num_workers <= self.max_workers and settings.buffered_batches * batch_bytes <= self.memory_bytes


def worker_settings(start: LoaderSettings, workers: int, cuda: bool, prefetch: int | None = None) -> LoaderSettings:
    """The settings a search candidate with ``workers`` gets: the start's ``prefetch_factor`` (2 by
    default), pinned memory for a CUDA copy, workers kept across epochs."""
    return LoaderSettings(
        num_workers=workers,
        prefetch_factor=(prefetch or start.prefetch_factor or 2) if workers else None,
        pin_memory=cuda,
        persistent_workers=workers > 0,
    )


@dataclass
class Trial:
    settings: LoaderSettings
    interval_s: float  # measured seconds between batches, loader alone
    wait_s: float  # predicted wait per step: max(0, interval_s - step_s), or interval_s without workers
    spread_s: float = 0.0  # standard error of interval_s from its samples (0: a single sample)
    fastest_s: float | None = None  # the fastest sample of interval_s, when there were several


def noise(a: Trial, b: Trial) -> float:
    """Differences between two trials' intervals below this are noise: twice their combined standard error."""
    return 2.0 * math.hypot(a.spread_s, b.spread_s)


def spread(samples: list[float]) -> float:
    """Standard error of the mean of ``samples`` (0 for fewer than two)."""
    n = len(samples)
    if n < 2:
        return 0.0
    mean = sum(samples) / n
    return math.sqrt(sum((x - mean) ** 2 for x in samples) / (n - 1) / n)


@dataclass
class PrefetchSearch:
    """Proposes the next settings to measure from the measurements so far; ``None`` means done.

    ``negligible`` is the predicted wait, as a fraction of the step time, below which
    the search stops; ``min_gain`` the relative reduction of the interval that counts
    as progress (less means the gains have flattened).
    """

    start: LoaderSettings
    step_s: float
    batch_bytes: int
    budget: Budget
    cuda: bool = False
    negligible: float = 0.05
    min_gain: float = 0.1
    max_trials: int = 12
    guess: bool = True  # start the doubling where the model says (False: at 2, or twice the start)
    headroom: float = 1.0  # the model's worker count is multiplied by this (e.g. 1.5 for I/O-bound items)
    cpu_cores: int | None = None  # items keep the workers on a CPU, with this many cores (None: not known)
    trials: list[Trial] = field(default_factory=list)
    _queue: list[LoaderSettings] = field(default_factory=list)
    _phase: str = "start"

    def _settings(self, workers: int, prefetch: int | None = None) -> LoaderSettings:
        return worker_settings(self.start, workers, self.cuda, prefetch)

    def _wait(self, settings: LoaderSettings, interval_s: float) -> float:
        # Without workers the loader only runs while the step waits for it: no overlap.
        return interval_s if settings.num_workers == 0 else max(0.0, interval_s - self.step_s)

    def restep(self, step_s: float) -> None:
        """The step time, measured again: every trial's predicted wait follows it.

        The first steps carry warm-up (a ResNet on CPU: 424 ms at step 1, ~150 ms later; on a
        GPU autotuning or compilation), and judged against them a count of workers that
        leaves every later step waiting looks sufficient. All trials are judged against the
        same, current step time.
        """
        if step_s <= 0:
            return
        self.step_s = step_s
        for trial in self.trials:
            trial.wait_s = self._wait(trial.settings, trial.interval_s)

    def record(
        self, settings: LoaderSettings, interval_s: float, spread_s: float = 0.0, fastest_s: float | None = None
    ) -> Trial:
        trial = Trial(settings, interval_s, self._wait(settings, interval_s), spread_s, fastest_s)
        self.trials.append(trial)
        return trial

    def beats(self, candidate: Trial, incumbent: Trial) -> bool:
        """``candidate`` waits less than ``incumbent`` by more than the noise of both measurements,
        or less than the incumbent's fastest sample by more than its own noise."""
        if incumbent.wait_s - candidate.wait_s > noise(candidate, incumbent):
            return True
        if incumbent.fastest_s is None:
            return False
        return self._wait(incumbent.settings, incumbent.fastest_s) - candidate.wait_s > 2.0 * candidate.spread_s

    def undecided(self, candidate: Trial) -> bool:
        """The measurement of ``candidate`` cannot tell it from the best of the others where it would matter.

        True when their waits differ by less than the noise of both, while that noise is
        wider than a negligible wait: more samples of the candidate (it is serving, so
        they cost nothing extra) may decide it. Keeping the start on such a draw would
        keep it silently on too few samples (2 gave +-102 ms on a 290 ms batch under load).
        """
        others = [t for t in self.trials if t is not candidate]
        if not others:
            return False
        saved, self.trials = self.trials, others
        try:
            incumbent = self.best
        finally:
            self.trials = saved
        assert incumbent is not None
        if self.beats(candidate, incumbent) or self.beats(incumbent, candidate):
            return False
        return noise(candidate, incumbent) > self.negligible * self.step_s

    def _cuts(self, more: Trial, fewer: Trial) -> bool:
        """``more`` waits less than ``fewer`` by enough to pay for its workers or buffers: by more
        than a negligible wait (a share of the step) and by more than ``min_gain`` of ``fewer``'s wait."""
        return fewer.wait_s - more.wait_s > max(self.negligible * self.step_s, self.min_gain * fewer.wait_s)

    @property
    def best(self) -> Trial | None:
        """The start, unless a candidate beats it beyond the noise; then, of those that do, the fewest
        workers (then buffers) whose mean wait no other cuts by enough to pay for its extra workers.

        The noise guards one decision: leaving the user's settings. Between candidates that both
        beat the start it would decide nothing useful: measured on JPEG decoding with a 10 ms
        step, 1 worker waited 30 +- 16 ms and 2 workers 17 +- 6 ms, a draw by the noise that
        kept 1 worker, whose steady wait was 2.5-7x that of 2 in every fit. So among them the
        mean decides, and more workers must cut the wait by more than a negligible share of
        the step and by ``min_gain`` (a 1% gain does not buy 8 workers).
        """
        if not self.trials:
            return None
        start = self.trials[0]
        # Trials the budget does not allow (it shrinks once items turn out CPU-bound) are out; a start
        # over the budget must be left for the best that fits, beating it or not.
        fitting = [t for t in self.trials if self._fits(t.settings)]
        if not fitting:
            return start
        if start in fitting:
            pool = [t for t in fitting if t is not start and self.beats(t, start)]
            if not pool:
                return start
        else:
            pool = fitting
        by_cost = sorted(pool, key=lambda t: (t.settings.num_workers, t.settings.buffered_batches, t.wait_s))
        for t in by_cost:
            if not any(self._cuts(u, t) for u in pool if u is not t):
                return t
        return min(pool, key=lambda t: t.wait_s)  # unreachable: the least wait is cut by none

    def _done(self) -> bool:
        best = self.best
        return best is not None and best.wait_s <= self.negligible * self.step_s

    def _tried(self, settings: LoaderSettings) -> bool:
        return any(t.settings == settings for t in self.trials)

    def _fits(self, settings: LoaderSettings) -> bool:
        return self.budget.allows(settings, self.batch_bytes)

    def propose(self) -> LoaderSettings | None:
        if len(self.trials) >= self.max_trials:
            return None
        if not self.trials:
            return self.start  # the baseline is always measured the same way as the candidates
        if self._done():
            return None
        if self._phase == "start":
            self._phase = "double"
            first = self._first_candidate()
            if first is not None:
                return first
        if self._phase == "double":
            proposal = self._next_double()
            if proposal is not None:
                return proposal
            self._phase = "climb"
            self._queue = self._climb_candidates()
        while self._queue:
            candidate = self._queue.pop(0)
            if not self._tried(candidate) and self._fits(candidate) and self._could_win(candidate):
                return candidate
        return None

    def _could_win(self, fewer: LoaderSettings) -> bool:
        """Whether ``fewer`` workers than the best could be chosen over it at their most optimistic.

        Known only for CPU-bound items on ``cpu_cores`` cores: the best's workers and the
        training process shared the cores (each worker had at least ``cores / (w + 1)`` of
        one), so one item takes at least ``interval x w x min(1, cores / (w + 1))`` on a
        core of its own, and ``fewer`` workers make a batch no faster than that over their
        count. If even that leaves a wait the best cuts by enough, measuring them only
        costs a re-fork (JPEG decoding with a 15 ms step: 2 workers 16.1 ms a batch, so
        1 worker at least 21.5 ms; measured 21.7).
        """
        best = self.best
        if self.cpu_cores is None or best is None or not 0 < fewer.num_workers < best.settings.num_workers:
            return True
        w = best.settings.num_workers
        item_s = best.interval_s * w * min(1.0, self.cpu_cores / (w + 1))
        interval_s = item_s / fewer.num_workers
        return not self._cuts(best, Trial(fewer, interval_s, self._wait(fewer, interval_s)))

    def _first_candidate(self) -> LoaderSettings | None:
        """Where the doubling starts: the first count of 2, 4, 8, ... (from twice the start) the model calls enough.

        The model: one worker takes the start's time per batch x its workers for an item,
        so hiding it behind a step takes ``item / step`` workers if they overlap perfectly
        (I/O). Counts the budget does not allow are not jumped to; measurement then
        confirms the guess or the doubling and climbing correct it.
        """
        w = max(2, 2 * self.start.num_workers)
        item_s = self.trials[0].interval_s * max(1, self.start.num_workers)
        needed = self.headroom * item_s / self.step_s if self.step_s > 0 else w
        while self.guess and w < needed and self._fits(self._settings(2 * w)):
            w *= 2
        first = self._settings(w)
        return first if first != self.start and self._fits(first) else None

    def _worker_trials(self) -> list[Trial]:
        return [t for t in self.trials if t.settings.num_workers > 0]

    def _next_double(self) -> LoaderSettings | None:
        workers = self._worker_trials()
        if not workers:
            return None
        last = workers[-1]
        if len(workers) >= 2:
            previous = workers[-2]
            gain = previous.interval_s - last.interval_s
            if gain < self.min_gain * previous.interval_s or gain <= noise(last, previous):
                return None  # the last doubling did not pay (or not beyond the noise): gains flattened
        candidate = self._settings(2 * last.settings.num_workers)
        return candidate if self._fits(candidate) and not self._tried(candidate) else None

    def _climb_candidates(self) -> list[LoaderSettings]:
        best = self.best
        if best is not None and any(not self._fits(t.settings) for t in self._worker_trials()):
            # The budget shrank below counts already measured (CPU-bound items): what it still allows.
            top = self._settings(self.budget.max_workers)
            if not self._tried(top):
                return [top]
        if best is None or best.settings.num_workers < 2:
            return []
        w = best.settings.num_workers
        # Neighbours halfway to the counts already measured on either side of the best.
        measured = sorted({t.settings.num_workers for t in self._worker_trials()})
        above = [m for m in measured if m > w]
        below = [m for m in measured if m < w]
        out = []
        if above:
            out.append(self._settings((w + above[0]) // 2))
        else:
            nxt = w + max(1, w // 2)
            out.append(self._settings(nxt))  # doubling stopped on the budget: try what still fits
        if below:
            out.append(self._settings(math.ceil((w + below[-1]) / 2)))
        elif w // 2 > self.start.num_workers:  # the doubling jumped: fewer may do as well
            out.append(self._settings(max(1, (w + self.start.num_workers) // 2)))
        return [s for s in out if s.num_workers != w]



def _available_memory_bytes() -> int:
    """Free RAM (``MemAvailable``), and free ``/dev/shm`` where it exists: workers hand batches over through it."""
    ram = available_host_bytes()
    free = [] if ram is None else [ram]
    try:
        st = os.statvfs("/dev/shm")
        free.append(st.f_bavail * st.f_frsize)
    except OSError:
        pass
    return min(free) if free else 4 << 30


def default_budget(
    max_workers: int | None = None, memory_bytes: int | None = None, local_world_size: int = 1
) -> Budget:
    """The per-rank budget: given values are checked, missing ones computed.

    Workers that mostly wait on I/O cost little CPU, so the worker cap is 4 x the
    rank's CPU budget (:func:`~lightning_accel.cpu_budget.cpu_budget`: affinity, cgroup
    quota, SLURM and local ranks), not the core count; items that keep the workers on
    the CPU are held to the budget itself by the tuner once measured. The memory cap is
    half of what is free, split between the ranks on this machine.
    """
    ranks = max(1, local_world_size)
    if max_workers is None:
        max_workers = 4 * cpu_budget(ranks).cores
    if memory_bytes is None:
        memory_bytes = max(1, _available_memory_bytes() // (2 * ranks))
    return Budget(max_workers, memory_bytes)
