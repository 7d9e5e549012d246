"""The online search for a train loader's worker settings: fed step timings, it switches a TunableLoader.

How it works, and why this way. The caller (:class:`~lightning_accel.callbacks.PrefetchTuner`,
as Lightning processes the train loader) wraps the train ``DataLoader`` in a
:class:`~lightning_accel.prefetch.TunableLoader` before any batch is read and feeds
:class:`OnlineSearch` each step: the batch arrived, the step ended (a
:class:`~lightning_accel.prefetch.WaitMeter` times both). The first
``warmup_steps + trial_steps`` real steps measure the data wait against the step time.
From a start without workers, a first batch that has taken longer to load here than a
worker takes to start already starts workers, while it loads (:meth:`TunableLoader.speculate
<lightning_accel.prefetch.TunableLoader.speculate>`; :mod:`~lightning_accel.prefetch.slow_batch`
says why then): the worker budget for I/O-bound loading, a worker per core for CPU-bound.
If that first step waited longer than it computed, they serve from the next batch and are
the first candidate measured, and their measurement of the items, not the warm-up step
alone, decides whether the run is data-bound (:meth:`OnlineSearch._verify_start`); else
they are dropped. Otherwise a first step that waited longer than it computed starts the
likely first candidate's workers in the background, so that their start-up (forking each,
about 80 ms under load) and first items overlap the measuring steps; the steps the forking
disturbed are left out of the measurement, and the candidate is dropped if the
measurement says compute-bound or proposes another.
Only if waiting takes more than ``data_bound_fraction`` of the time does it search, and
it searches online, in the spirit of tf.data AUTOTUNE: the next candidate's loader is
built and its workers started in the background while training goes on consuming the
current one; at a batch boundary ``lead`` steps later (about one batch's latency, so
the new workers have batches ready) the candidate takes over, and training runs on it.
Its pace is measured from the times its workers finished its first ``2 w`` batches (``w + 3``
for one or two workers, so that there are three samples for the spread):
each worker's first and second batch (both queued from the start) span one item as the
``w`` workers make them together, so the pace is not blurred by the batches buffered
before the hand-over (which would make too few workers look sufficient).
:class:`~lightning_accel.prefetch.PrefetchSearch` then proposes the next candidate
(doubling ``num_workers``, then hill-climbing, within the per-rank CPU and memory
budgets) until the predicted wait is negligible, the gains flatten or
``max_search_steps`` would be passed. The best setting measured stays (or is
prepared in the background once more); the start stays when nothing waited less, so
the run is slower than its start by at most the extra waiting of the steps trained on
worse candidates, which the report states as the measurement cost. Every switch is at a
batch boundary of the epoch's fixed order, so no sample is repeated or skipped.

Noise and cores. Each measurement carries its spread, taken on the spot (the standard
error over the steps, or over the workers' item times): a candidate replaces the start
only when it waits less by more than twice their combined spread; among the candidates
that do, the mean wait decides (more workers must cut it by more than a negligible share
of the step: :attr:`PrefetchSearch.best`). A candidate whose first samples
cannot tell it from the best where it would matter is measured longer while it serves
(up to ``remeasure`` times its usual batches) rather than judged on the draw. Items that keep the workers on
the CPU (the share of CPU time while loading, measured in this process without workers
and from ``/proc`` with them, as time on a CPU over the time not spent queued for one,
so a shared machine makes them look neither idle nor busy) hold the worker count to the rank's CPU budget
(:func:`~lightning_accel.cpu_budget.cpu_budget`); I/O-bound ones may use 4x that. With
such items a candidate is judged on the batches its workers made after taking over: the
ones made during the hand-over shared the cores with the loader being replaced (JPEG
decoding: a batch every 79 ms then, ~20 ms settled), which made more workers look slower.

Streams. An iterable dataset that reports its position (the protocol of
:mod:`~lightning_accel.prefetch.stream`) is tuned online like a map-style epoch: each
hand-over starts the new loader at the exact position, so one endless epoch gets the
chosen settings within it. Any other stream is probed back to back in one pause
(:mod:`~lightning_accel.prefetch.stream_probe`), and the loader's ``stream_switch`` says
when the winner serves. The report says which, in one line.

Nothing here knows about ranks or Lightning: messages go to the ``say`` and ``warn``
functions the caller passes (the callback passes rank-zero ones).
"""

from __future__ import annotations

import logging
import statistics
import warnings
from collections.abc import Callable
from typing import Any

from lightning_accel.cpu_budget import CpuBudget
from lightning_accel.prefetch.cache import store as store_in_cache
from lightning_accel.prefetch.first_batch import FirstBatchWorkers, restate_start
from lightning_accel.prefetch.handover import handover_lead
from lightning_accel.prefetch.inner_loader import worker_start_s
from lightning_accel.prefetch.loader_rebuild import RebuildError
from lightning_accel.prefetch.options import TunerOptions
from lightning_accel.prefetch.probe import batch_nbytes
from lightning_accel.prefetch.report import search_report
from lightning_accel.prefetch.search import Budget, PrefetchSearch, Trial, spread
from lightning_accel.prefetch.settings import LoaderSettings
from lightning_accel.prefetch.start_steps import StartSteps
from lightning_accel.prefetch.stream_probe import probe_stream
from lightning_accel.prefetch.tunable_loader import TunableLoader
from lightning_accel.prefetch.wait_meter import WaitMeter, WaitStats

__all__ = ["OnlineSearch"]

_log = logging.getLogger(__name__)


def _verdict_batches(workers: int) -> int:
    """Batches a candidate with ``workers`` serves before its verdict: two rounds, and at least three
    item times for their spread (two gave +-46 ms)."""
    return 2 * workers if workers > 2 else workers + 3


def _verdict_after(candidate: LoaderSettings, settled: bool) -> int:
    """Steps from a candidate's hand-over to its verdict: :func:`_verdict_batches`, after the batches
    its workers buffered before the hand-over when only settled batches count."""
    workers = max(1, candidate.num_workers)
    return _verdict_batches(workers) + (candidate.buffered_batches if settled else 0)


class OnlineSearch:
    """Decides from the steps it is fed whether, and with which settings, ``loader`` serves; switches it.

    Call :meth:`start` when training is about to ask for its first batch, then for each step
    :meth:`batch_arrived` and :meth:`step_ended` until ``done``; :meth:`end` when training
    ends first. The outcome: ``chosen`` (``None``: the start stays), ``reason``, ``search``
    (its trials), ``measured`` (the start's steps) and :meth:`report`.

    Args:
        loader: the wrapped train loader; its settings when built are the start.
        budget: per-rank limits on workers and buffered bytes.
        cpu: the rank's CPU budget (``None``: one core).
        meter: times the steps (a simulated clock in tests); a fresh one by default.
        cuda: batches go to a CUDA device (pinning helps).
        options: the tuner's settings (:class:`~lightning_accel.prefetch.options.TunerOptions`), read
            where they are used and never copied: ``warmup_steps``, ``trial_steps``,
            ``max_search_steps``, ``data_bound_fraction``, ``cache_path`` (where the outcome is
            stored for the next run; not stored without a path) and the heuristics ``early``,
            ``speculate``, ``guess``, ``max_lead``, ``remeasure``, ``cpu_busy_threshold``.
        cache_key: the outcome's key in the cache (the dataset, batch size and ranks).
        say, warn: where the one-line notes and the warnings go.
    """

    def __init__(
        self,
        loader: TunableLoader,
        budget: Budget,
        cpu: CpuBudget | None = None,
        meter: WaitMeter | None = None,
        *,
        cuda: bool = False,
        options: TunerOptions | None = None,
        cache_key: str = "",
        say: Callable[[str], None] = _log.info,
        warn: Callable[[str], None] = warnings.warn,
    ) -> None:
        self.loader, self.budget, self.cpu, self.cuda = loader, budget, cpu, cuda
        self.meter = meter if meter is not None else WaitMeter()
        self.options = options if options is not None else TunerOptions()  # read, never copied
        self.cache_key = cache_key
        self.say, self.warn = say, warn
        self.done = False
        self.search: PrefetchSearch | None = None
        self.chosen: LoaderSettings | None = None
        self.measured: WaitStats | None = None
        self.reason = "not run"
        self.cpu_note = ""  # set when CPU-bound items held the workers to the CPU budget
        self.start_note = ""  # set when the start was restated from its first candidate's workers
        self.measurement_cost_s = 0.0
        self.finished_step: int | None = None  # the step at which the search decided
        self.remeasured = 0  # candidates measured longer because their first samples could not decide
        self.started_early: LoaderSettings | None = None  # what was started early (the start: nothing was)
        self._start = loader.settings
        self._batch_bytes = 0
        self._trying: LoaderSettings | None = None
        self._search_from = 0
        self._start_unverified = False  # measured on the warm-up step alone: _verify_start judges it
        self._steps = StartSteps(self.meter, self.options.warmup_steps, self.options.trial_steps)  # those that measure the start
        # Per step: batches the loader had handed out when its batch arrived. The wait measured the fetch of the
        # last of them, which is the step's own batch, or the next one where the loop reads a batch ahead.
        self._fetched: list[int] = []
        self._first_batch = FirstBatchWorkers(self._start, budget, cpu, cuda, self.options.cpu_busy_threshold)

    def start(self) -> None:
        """Training is about to ask for its first batch."""
        self.meter.start()
        if self.options.early and self.options.speculate and self._start.num_workers == 0 and self.loader.resumable:
            # Past a worker's start-up, a first batch loaded here has cost more than a worker would.
            self.loader.speculate(worker_start_s(), self._first_batch.choose)

    def _judge_speculation(self) -> None:
        """After the step whose slow batch started workers: they stay (:meth:`FirstBatchWorkers.keeps`), serve
        from the next batch and are the first candidate measured, and the start is judged on their
        measurement (:meth:`_verify_start`); or they are dropped, and the usual early start may follow."""
        started = self.loader.speculated
        # Judged once: kept, it is the early candidate; dropped, it is neither preparing nor serving.
        if started is None or self.started_early is not None or started not in (self.loader.preparing, self.loader.settings):
            return
        if self._first_batch.keeps(started, self.meter.stats(last=1), self._batch_bytes):
            self.started_early = started
            self._start_unverified = True
        else:
            self.loader.prepare(self._start, lead=0)

    def batch_arrived(self) -> None:
        """The step's batch arrived (the loop waited for it until now)."""
        if not self.done:
            self.meter.batch_arrived()
            self._fetched.append(self.loader.handed_out)
            self._steps.note(self.loader.starting)

    def step_ended(self, batch: Any) -> None:
        """The step on ``batch`` ended: measure it, and move the search on."""
        if self.done:
            return
        self.meter.step_ended()
        if self.search is None:
            self._batch_bytes = batch_nbytes(batch)
            self._judge_speculation()
            if self.loader.settings != self._start:
                # The early candidate took over: the steps whose waits fetched the start's batches measured it.
                # Where the loop reads a batch ahead (a stream under Lightning), a step's wait fetched the next
                # batch, so the step before the hand-over's already measured the candidate (its 2-3 ms wait,
                # averaged with the start's 150 ms, once made the start too noisy to beat).
                took_over = self.loader.took_over_after
                self._start_search(stop=sum(1 for fetched in self._fetched if fetched <= took_over))
            elif self._steps.enough():
                self._start_search()
            elif self.started_early is None and self.options.early:
                self._start_early()
            self._steps.note(self.loader.starting)
        else:
            # The step time so far, past the warm-up: the median, so steps a background start of workers
            # disturbed do not move it (PrefetchSearch.restep says why it is re-measured).
            self.search.restep(statistics.median(self.meter.steps[self.options.warmup_steps :] or self.meter.steps))
            self._advance()
        if self.done:
            self.finished_step = len(self.meter)

    def end(self) -> bool:
        """Training ended: a search it cut short keeps what it learnt; returns whether there was one."""
        if self.done or self.search is None:
            return False
        self._advance(ending=True)
        self._finish(cut_short=True)
        self.finished_step = len(self.meter)
        return True

    def report(self) -> str:
        """What was measured, tried and chosen, as one table."""
        return search_report(
            self.reason, self.measured, self.search, self.chosen, self.finished_step, self.measurement_cost_s,
            self.cpu_note, self.start_note,
        )

    def _keep(self, why: str) -> None:
        self.reason = f"kept your loader: {why}"
        self.warn(f"PrefetchTuner: {why}; training continues with your loader's settings")
        self.done = True

    def _start_early(self) -> None:
        """After a step that waited longer than it computed: start the likely first candidate's workers now.

        They start (forking, their first items) while the start serves the steps that measure
        it, instead of after them: the hand-over comes right after the measurement and costs
        no wait (the bench stream's hand-over to 8 workers blocked 0.95 s before). The guess is
        the search's own first proposal from this one step; if the full measurement proposes
        otherwise (or calls the run compute-bound), it is dropped. Steps the forking disturbed
        are left out of the measurement (:class:`~lightning_accel.prefetch.start_steps.StartSteps`).
        """
        n = len(self.meter)
        # Only from a start without workers: its steps wait on the loading itself, while a start with
        # workers first serves from buffers they filled, which a longer measurement has to get past.
        if self.loader.settings.num_workers or not self.loader.resumable or n < 1:
            return
        if self.meter.waits[n - 1] <= self.meter.steps[n - 1]:
            return
        self.started_early = self.loader.settings  # tried once, whatever comes of it
        self._new_search(self.meter.stats(last=1), [n - 1])
        assert self.search is not None
        candidate = self.search.propose()  # the first after the start (recorded above)
        # The start serves at least the steps that measure it when they are clearly data-bound (two, or
        # one below; a longer measurement stops where the candidate took over). The loop fetches one batch ahead or
        # none: the hand-over's batch is fetched after the step ``lead`` steps from now ends, either way.
        lead = 0
        if candidate is not None:  # as in _next_candidate: its verdict within the search's steps
            room = self.options.max_search_steps - n - _verdict_after(candidate, self.cpu_bound)
            lead = max(min(self._lead(candidate), room), self._lead(candidate, starting=False))
        # One measured step is enough when this one waited over 3x as long as it computed: the candidate
        # serves a step sooner (seed004: a 0.53 s wait saved, the 8 workers' first items ready by then).
        measuring = 1 if self.meter.waits[n - 1] > 3 * self.meter.steps[n - 1] else min(2, self.options.trial_steps)
        lead = max(lead, self.options.warmup_steps + measuring - n)
        self.search, self.measured, self.cpu_note = None, None, ""
        if candidate is None:
            return
        try:
            self.loader.prepare(candidate, lead)
        except RebuildError:
            return  # said once the search itself meets it
        self.started_early = candidate

    def _new_search(self, measured: WaitStats, indices: list[int]) -> None:
        """The search, with the start measured over the steps ``indices``, held to the budgets."""
        self.measured = measured
        start = self._start
        self.search = PrefetchSearch(
            start, measured.step_s, self._batch_bytes, budget=self.budget, cuda=self.cuda, guess=self.options.guess
        )
        # The first steps already measured the start: without workers the loader works only while
        # the loop waits, so its time per batch is the wait; with workers, when data-bound, a batch
        # arrives every wait + step. Their spread over the steps is the noise of that measurement.
        waits, steps = [self.meter.waits[i] for i in indices], [self.meter.steps[i] for i in indices]
        samples = waits if start.num_workers == 0 else [w + s for w, s in zip(waits, steps)]
        self.search.record(start, sum(samples) / len(samples), spread(samples), min(samples))
        if start.num_workers == 0:
            self._hold_to_cpu_budget(measured.wait_cpu_share, "in this process, without workers")
            if measured.wait_cpu_share < self.options.cpu_busy_threshold:
                self.search.headroom = 1.5  # I/O-bound: spare workers are cheap, a count that just keeps up is not
        else:
            self._hold_to_cpu_budget(self.loader.cpu_busy(), f"{start.num_workers} workers")

    def _start_search(self, stop: int | None = None) -> None:
        """Decide whether to search, from the start's steps after the warm-up (up to ``stop``), and begin."""
        clean = self._steps.clean(stop)
        measured = self.measured = self.meter.stats_of(clean)
        # Measured on the warm-up step alone (workers started while it loaded took over after it), the start
        # is judged once those workers have measured its items again (_verify_start).
        if not self._start_unverified and measured.wait_fraction <= self.options.data_bound_fraction:
            self._compute_bound(measured.wait_fraction)
            return
        self._new_search(measured, clean)
        self._search_from = len(self.meter)
        if not self.loader.resumable:
            self._probe_search()
            return
        self._next_candidate()

    def _compute_bound(self, wait_fraction: float, why: str = "") -> None:
        self.reason = (
            f"kept your loader: compute-bound ({100 * wait_fraction:.0f}% of the time waiting "
            f"<= {100 * self.options.data_bound_fraction:.0f}%{why})"
        )
        self.done = True
        if self.loader.settings != self._start or self.loader.preparing is not None:
            self.loader.prepare(self._start, lead=0)  # an early candidate is not needed

    def _verify_start(self, trial: Trial, item_s: float) -> bool:
        """Whether the run is data-bound, judged once the first candidate, started while the first batch
        loaded, has measured the items again (:func:`restate_start`); if not, the start comes back."""
        assert self.search is not None
        start = self.search.trials[0]
        first = 1000 * self.meter.waits[0]
        if restate_start(start, item_s):
            self.start_note = (
                f"start restated from the first candidate's workers, {1000 * item_s:.1f} ms a batch each, "
                f"where the warm-up step, its only measurement, waited {first:.0f} ms"
            )
        fraction = WaitStats(1, start.wait_s, self.search.step_s).wait_fraction
        if fraction > self.options.data_bound_fraction:
            return True
        self._compute_bound(fraction, f"; the first batch's {first:.0f} ms was one-off: workers made one in {1000 * item_s:.0f} ms")
        return False

    @property
    def cpu_bound(self) -> bool:
        """The search learnt that items keep the loader on a CPU: candidates are then judged on the batches
        made after they took over (TunableLoader.settled_stamps), not on those made while the loader they
        replace still ran."""
        return self.search is not None and self.search.cpu_cores is not None

    def _hold_to_cpu_budget(self, busy: float | None, where: str) -> None:
        """CPU-bound items: no more workers than the rank's CPU budget (more only share the same cores)."""
        assert self.search is not None
        if busy is None or busy < self.options.cpu_busy_threshold:
            return
        self.search.cpu_cores = self.cpu.cores if self.cpu is not None else 1
        if self.cpu is None or self.search.budget.max_workers <= self.cpu.cores:
            return
        self.search.budget = Budget(self.cpu.cores, self.search.budget.memory_bytes)
        self.cpu_note = f"CPU-bound items ({100 * busy:.0f}% on a CPU when not queued, {where}): workers held to the CPU budget, {self.cpu}"

    def _lead(self, candidate: LoaderSettings, starting: bool = True) -> int:
        """Batches the current loader still serves while the candidate's workers start (unless not
        ``starting``) and fill up (:func:`~lightning_accel.prefetch.handover.handover_lead`); 0, a
        cold switch, when both loaders' buffers would not fit the memory budget at once."""
        assert self.search is not None
        current = self.loader.settings
        both = (current.buffered_batches + candidate.buffered_batches) * self.search.batch_bytes
        if both > self.budget.memory_bytes:
            return 0
        trial = next((t for t in reversed(self.search.trials) if t.settings == current), None)
        # This process did the loading only without workers: only then is its CPU share the item's.
        measured = self.measured
        share = measured.wait_cpu_share if measured is not None and self._start.num_workers == 0 and current == self._start else 1.0
        return handover_lead(
            current.num_workers,
            trial.interval_s if trial is not None else None,
            candidate.num_workers,
            self.search.step_s,
            self.cpu.cores if self.cpu is not None else 1,
            cpu_share=share,
            max_lead=self.options.max_lead,
            start_s=candidate.num_workers * worker_start_s() if starting else 0.0,
        )

    def _next_candidate(self) -> None:
        assert self.search is not None
        candidate = self.search.propose()
        early = self.started_early
        serving = early == self.loader.settings or (candidate == early and early == self.loader.preparing)
        if early is not None and early != self._start and serving and all(t.settings != early for t in self.search.trials):
            self._trying = early  # started early, while the start was measured; serving already, it is measured first
            return
        # Serving with more workers than a budget that shrank (CPU-bound items): the next
        # candidate, within it, is tried however late; it is the way back into the budget.
        over = not self.search.budget.allows(self.loader.settings, self.search.batch_bytes)
        lead = 0
        if candidate is not None:
            # The verdict on a candidate needs 2 w of its batches after the hand-over. Steps served while the
            # workers start fit in what is left of the search's steps; past that, the hand-over waits for them.
            verdict = len(self.meter) + _verdict_after(candidate, self.cpu_bound)
            lead = max(min(self._lead(candidate), self.options.max_search_steps - verdict), self._lead(candidate, starting=False))
            if not over and verdict + lead > self.options.max_search_steps:
                candidate = None
        if candidate is None:
            self._finish()
            return
        try:
            self.loader.prepare(candidate, lead)
        except RebuildError as err:  # e.g. a dataset that cannot be pickled into workers
            self._keep(str(err))
            return
        self._trying = candidate

    def _advance(self, ending: bool = False) -> None:
        """After a step of the search: judge the candidate once it has served enough batches
        (when training ends, on the two rounds it served if it has)."""
        assert self.search is not None
        candidate = self._trying
        if candidate is None:
            return
        if self.loader.settings != candidate:
            return  # still being prepared
        w = max(1, candidate.num_workers)
        # CPU-bound items: only the batches made after the hand-over, once the workers have the cores
        # to themselves (made during it, JPEG batches came every 79 ms where settled workers took ~20).
        stamps = self.loader.settled_stamps() if self.cpu_bound and not ending else self.loader.stamps
        needed = _verdict_batches(w) if not ending else w + 1
        if len(stamps) < needed:
            return
        if ending:
            self._trying = None
            items = [max(0.0, stamps[j + w] - stamps[j]) for j in range(len(stamps) - w)]
            self.search.record(candidate, sum(items) / len(items) / w, spread(items) / w, min(items) / w)
            return
        # Worker j made batches j and j + w back to back (both were queued when it started), so
        # their finish times span one item as the w workers make them together: the second
        # round, past the burst of forking and starting all at once; later rounds add samples.
        items = [max(0.0, stamps[j + w] - stamps[j]) for j in range(len(stamps) - w)]
        trial = self.search.record(candidate, sum(items) / len(items) / w, spread(items) / w, min(items) / w)
        # Too close to call where it would matter: the candidate serves anyway, so measure it longer (bounded).
        if self.search.undecided(trial) and len(stamps) < self.options.remeasure * needed and len(self.meter) < self.options.max_search_steps:
            self.search.trials.pop()
            return
        self.remeasured += len(stamps) > needed
        if self._start_unverified:
            self._start_unverified = False
            if not self._verify_start(trial, statistics.median(items)):
                return
        if candidate.num_workers:
            self._hold_to_cpu_budget(self.loader.cpu_busy(), f"{w} workers")
        self._trying = None
        self._next_candidate()

    def _finish(self, cut_short: bool = False) -> None:
        assert self.search is not None
        self.done = True
        best, baseline = self.search.best, self.search.trials[0]
        assert best is not None
        # The start stays unless beaten beyond the noise, or unless it is over the (CPU) budget.
        start_fits = self.search.budget.allows(self._start, self.search.batch_bytes)
        target = best.settings if not start_fits or self.search.beats(best, baseline) else self._start
        # At the end of training nothing is left to serve: only the report and the cache see the result.
        if not cut_short and self.loader.settings != target:
            try:
                self.loader.prepare(target, self._lead(target))
            except RebuildError as err:
                self._keep(str(err))
                return
        self.measurement_cost_s = self._search_cost(baseline.wait_s)
        steps = len(self.meter) - self._search_from
        if target == self._start:
            self.reason = f"kept your loader: no candidate of {len(self.search.trials) - 1} waited less by more than the noise"
            if self.remeasured:
                self.reason += f" ({self.remeasured} measured longer, up to {self.options.remeasure}x, as their first samples could not decide)"
            if cut_short:
                self.reason += "; training ended before the search did"
        else:
            self.chosen = target
            self.reason = f"best of {len(self.search.trials)} measured online in {steps} steps within the budget" + (
                "; training ended before the search did (cached for the next run)" if cut_short else ", serving from the next batches"
            )
        if self.options.cache_path and not (cut_short and target == self._start):  # an unfinished "keep" is no answer
            store_in_cache(self.options.cache_path, self.cache_key, target)

    def _search_cost(self, start_wait_s: float) -> float:
        """Extra waiting, against the start's, of the steps trained while candidates were tried."""
        return sum(max(0.0, w - start_wait_s) for w in self.meter.waits[self._search_from : len(self.meter)])

    def _probe_search(self) -> None:
        """Streams without a position: probe each candidate back to back in one pause (:mod:`.stream_probe`)."""
        assert self.search is not None
        self.done = True
        probe = probe_stream(self.search, self.loader, self._start)
        self.measurement_cost_s += probe.cost_s
        if probe.error is not None:
            self._keep(probe.error)
            return
        self.chosen, self.reason = probe.chosen, probe.reason
        if self.chosen is None:
            return
        self.say(f"PrefetchTuner: {self.chosen.label()} {probe.when}")
        if self.options.cache_path:
            store_in_cache(self.options.cache_path, self.cache_key, self.chosen)
