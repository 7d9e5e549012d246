"""PrefetchTuner: finding the train loader's worker settings by measurement, during fit.

How it works, and why this way. At ``on_train_start`` the train ``DataLoader`` is
wrapped in a :class:`~lightning_accel.prefetch.TunableLoader` (Lightning has already
called ``iter()`` on it, so the wrapper is swapped into ``fit_loop._combined_loader``
and the epoch iterator re-created before any batch is consumed). The first
``warmup_steps + trial_steps`` real steps measure the data wait against the step time.
Only if waiting takes more than ``data_bound_fraction`` of the time does it search:
the start's pace is known from those steps, and each candidate loader (same dataset,
batch size, collate, sampler kind) is built and pulled back to back for a few batches,
which measures how fast it can deliver without training on those batches or
disturbing the user's sampler; the search
(:class:`~lightning_accel.prefetch.PrefetchSearch`) doubles ``num_workers`` and then
hill-climbs, within the per-rank CPU and memory budgets. The winner is installed at
the next batch for map-style datasets (the wrapper resumes the epoch's order where it
was, so no sample is repeated or skipped) and at the next epoch for iterable ones.

Probing candidates offline rather than training on each in turn keeps the search to a
single pause of a few seconds inside the first steps, and measures each candidate in
steady state instead of in the burst of batches its workers buffered at start-up,
which would make too few workers look sufficient. The user's settings are kept
unless a candidate's predicted wait is below the wait measured in the first steps,
so the run is never slower than its start by more than that pause, which the report
states.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel.bench import format_table
from lightning_accel.callbacks._train_loader import swap_train_loader
from lightning_accel.prefetch import cache
from lightning_accel.prefetch.loader_rebuild import RebuildError, is_iterable
from lightning_accel.prefetch.probe import batch_nbytes, measure_loader
from lightning_accel.prefetch.search import Budget, PrefetchSearch, default_budget
from lightning_accel.prefetch.settings import LoaderSettings
from lightning_accel.prefetch.tunable_loader import TunableLoader
from lightning_accel.prefetch.wait_meter import WaitMeter, WaitStats


def _positive_int(name: str, value: Any, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer; pass {hint}")


class PrefetchTuner(Callback):
    """Tunes ``num_workers``, ``prefetch_factor``, ``pin_memory``, ``persistent_workers`` of the train loader.

    Args:
        max_workers: worker processes per rank at most; ``None``: 4 x cores / ranks on this machine.
        memory_budget_bytes: bytes of buffered batches per rank at most
            (workers x prefetch_factor x batch bytes); ``None``: half the free RAM / shared memory.
        warmup_steps: steps ignored before measuring (loader start-up).
        trial_steps: steps measured to decide whether training is data-bound.
        max_search_steps: the search must be over by this step; it runs, in one pause, right
            after step ``warmup_steps + trial_steps``, which must come before it.
        cache_path: JSON file of tuned settings per dataset and machine; a hit skips the search.
        data_bound_fraction: share of time waiting above which the loader is tuned.
    """

    def __init__(
        self,
        max_workers: int | None = None,
        memory_budget_bytes: int | None = None,
        warmup_steps: int = 1,
        trial_steps: int = 3,
        max_search_steps: int = 30,
        cache_path: str | None = None,
        data_bound_fraction: float = 0.1,
    ) -> None:
        if max_workers is not None or memory_budget_bytes is not None:
            # One-line errors now, before any work; a value left as None is checked as a valid placeholder.
            Budget(1 if max_workers is None else max_workers, 1 if memory_budget_bytes is None else memory_budget_bytes)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an integer >= 0; pass warmup_steps=1")
        _positive_int("trial_steps", trial_steps, "trial_steps=3")
        _positive_int("max_search_steps", max_search_steps, "max_search_steps=30")
        if warmup_steps + trial_steps >= max_search_steps:
            raise ValueError(
                f"warmup_steps + trial_steps = {warmup_steps + trial_steps} leaves no room within "
                f"max_search_steps={max_search_steps}; lower them or raise max_search_steps"
            )
        if not 0 < data_bound_fraction < 1:
            raise ValueError(f"data_bound_fraction={data_bound_fraction!r} must lie strictly between 0 and 1; pass e.g. 0.1")
        self.max_workers = max_workers
        self.memory_budget_bytes = memory_budget_bytes
        self.warmup_steps = warmup_steps
        self.trial_steps = trial_steps
        self.max_search_steps = max_search_steps
        self.cache_path = cache_path
        self.data_bound_fraction = data_bound_fraction
        self.meter = WaitMeter()
        self.loader: TunableLoader | None = None
        self.search: PrefetchSearch | None = None
        self.chosen: LoaderSettings | None = None
        self.measured: WaitStats | None = None
        self.reason = "not run"
        self.measurement_cost_s = 0.0
        self._done = False
        self._cache_key = ""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._done = True
        try:
            why_not = swap_train_loader(trainer, TunableLoader)
        except RebuildError as err:
            why_not = str(err)
        if why_not is not None:
            self.reason = f"kept your loader: {why_not}"
            rank_zero_warn(f"PrefetchTuner: {why_not}; training continues with your loader's settings")
            return
        self.loader = trainer.fit_loop._combined_loader.flattened[0]  # type: ignore[union-attr]
        self._budget = default_budget(self.max_workers, self.memory_budget_bytes, trainer.num_devices)
        self._cuda = pl_module.device.type == "cuda"
        if self.cache_path:
            self._cache_key = cache.cache_key(self.loader.dataset, self.loader.batch_size, trainer.num_devices)
            cached = cache.load(self.cache_path, self._cache_key)
            if cached is not None and cached.num_workers <= self._budget.max_workers:
                self._install(cached, f"from cache {self.cache_path}")
                rank_zero_info(f"PrefetchTuner: {self.reason}: {cached.label()}")
                return
        self._done = False
        self.meter.start()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._done:
            self.meter.batch_arrived()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._done:
            return
        self.meter.step_ended()
        if len(self.meter) >= self.warmup_steps + self.trial_steps:
            self._done = True
            self._batch_bytes = batch_nbytes(batch)
            self._tune(self.meter.stats(skip=self.warmup_steps))
            rank_zero_info(self.report())
            if self.chosen is not None:
                for logger in trainer.loggers:
                    logger.log_metrics(
                        {
                            "prefetch/num_workers": float(self.chosen.num_workers),
                            "prefetch/prefetch_factor": float(self.chosen.prefetch_factor or 0),
                            "prefetch/pin_memory": float(self.chosen.pin_memory),
                        },
                        step=trainer.global_step,
                    )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.loader is not None:
            self.loader.close()

    def _install(self, settings: LoaderSettings, reason: str) -> None:
        assert self.loader is not None
        try:
            self.loader.switch(settings)
        except RebuildError as err:
            self.reason = f"kept your loader: {err}"
            rank_zero_warn(f"PrefetchTuner: {err}; training continues with your loader's settings")
            return
        self.chosen = settings
        self.reason = reason

    def _tune(self, measured: WaitStats) -> None:
        assert self.loader is not None
        self.measured = measured
        if measured.wait_fraction <= self.data_bound_fraction:
            self.reason = (
                f"kept your loader: compute-bound ({100 * measured.wait_fraction:.0f}% of the time waiting "
                f"<= {100 * self.data_bound_fraction:.0f}%)"
            )
            return
        start = self.loader.settings
        self.search = PrefetchSearch(start, measured.step_s, self._batch_bytes, budget=self._budget, cuda=self._cuda)
        # The first steps already measured the start, which saves probing it (seconds on a slow
        # loader): without workers the loader works only while the loop waits, so its time per
        # batch is the wait; with workers, when data-bound, a batch arrives every wait + step.
        self.search.record(start, measured.wait_s if start.num_workers == 0 else measured.wait_s + measured.step_s)
        while (candidate := self.search.propose()) is not None:
            try:
                probe = measure_loader(self.loader.loader, candidate)
            except RebuildError as err:  # e.g. a dataset that cannot be pickled into workers
                self.reason = f"kept your loader: {err}"
                rank_zero_warn(f"PrefetchTuner: {err}; training continues with your loader's settings")
                return
            self.measurement_cost_s += probe.elapsed_s
            self.search.batch_bytes = max(self.search.batch_bytes, probe.batch_bytes)
            self.search.record(candidate, probe.interval_s)
        best, baseline = self.search.best, self.search.trials[0]
        assert best is not None
        if best.settings == start or best.wait_s >= baseline.wait_s:
            self.reason = "kept your loader: no candidate would wait less"
            return
        when = "from the next epoch (iterable dataset)" if is_iterable(self.loader.loader) else "from the next batch"
        self._install(best.settings, f"fastest of {len(self.search.trials)} measured within the budget, used {when}")
        if self.chosen is not None and self.cache_path:
            cache.store(self.cache_path, self._cache_key, self.chosen)

    def report(self) -> str:
        """What was measured, tried and chosen, as one table."""
        lines = [f"PrefetchTuner: {self.reason}"]
        measured = self.measured
        if measured is not None:
            lines.append(
                f"  measured over {measured.steps} steps: wait {1000 * measured.wait_s:.1f} ms, "
                f"step {1000 * measured.step_s:.1f} ms ({100 * measured.wait_fraction:.0f}% waiting)"
            )
        if self.search is not None and self.search.trials:
            budget = self.search.budget
            rows = [
                [
                    t.settings.label(),
                    1000 * t.interval_s,
                    1000 * t.wait_s,
                    f"{t.settings.buffered_batches * self.search.batch_bytes / 2**20:.0f}",
                    "<- chosen" if self.chosen == t.settings else ("start" if i == 0 else ""),
                ]
                for i, t in enumerate(self.search.trials)
            ]
            table = format_table(["settings", "ms/batch", "pred. wait ms", "buffer MiB", ""], rows)
            lines += ["  " + line for line in table.splitlines()]
            lines.append(
                f"  budget per rank: {budget.max_workers} workers, {budget.memory_bytes / 2**20:.0f} MiB; "
                f"measurement cost {self.measurement_cost_s:.1f} s"
            )
        return "\n".join(lines)

    def trials_csv(self) -> str:
        """``settings,ms_per_batch,batches_per_s`` per trial: throughput against the settings tried."""
        rows = ["num_workers,prefetch_factor,pin_memory,ms_per_batch,batches_per_s"]
        for t in self.search.trials if self.search else []:
            s = t.settings
            rate = 1.0 / t.interval_s if t.interval_s > 0 else float("inf")
            rows.append(f"{s.num_workers},{s.prefetch_factor or 0},{int(s.pin_memory)},{1000 * t.interval_s:.3f},{rate:.3f}")
        return "\n".join(rows) + "\n"


__all__ = ["PrefetchTuner"]
