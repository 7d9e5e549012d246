"""PrefetchTuner: finding the train loader's worker settings by measurement, during fit, without pausing it.

The train ``DataLoader`` is wrapped in a :class:`~lightning_accel.prefetch.TunableLoader`
as Lightning processes it, before the fit loop reads from it
(:mod:`~lightning_accel.callbacks._process_hook`): for a loader without a length
Lightning's fetcher reads one batch ahead right then, and the tuner's first decision (start
workers while a slow first batch loads) is about exactly that batch. Where it keeps your
loader (one it cannot rebuild, several train loaders), ``on_train_start`` says why in one
warning, once the loaders are all known. Each step's timings then feed
:class:`~lightning_accel.prefetch.online.OnlineSearch`, which decides whether the run is
data-bound and, if so, which settings serve, switching the loader at batch boundaries; its
module docstring says how and why. This callback only wires it in: the budgets, the cache,
the wrap, rank-zero messages and the logged metrics.

What the search decided is the callback's state in a checkpoint (:meth:`PrefetchTuner.state_dict`):
a fit resumed from it serves that choice at once, with no search and no cache needed. A fit
that raises cleans up in ``on_exception`` as ``teardown`` would (Lightning calls only the
former then): the strategy's ``process_dataloader`` is put back and the loaders' workers
and reaper threads are shut down.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel.callbacks._process_hook import TrainLoaderHook, resumed_mid_epoch
from lightning_accel.cpu_budget import CpuBudget, cpu_budget
from lightning_accel.prefetch import cache
from lightning_accel.prefetch.loader_rebuild import RebuildError
from lightning_accel.prefetch.loader_state import is_stateful_loader
from lightning_accel.prefetch.online import OnlineSearch
from lightning_accel.prefetch.options import OPTION_NAMES, TunerOptions
from lightning_accel.prefetch.plot import trials_svg
from lightning_accel.prefetch.report import search_report, trials_csv
from lightning_accel.prefetch.search import Budget, PrefetchSearch, default_budget
from lightning_accel.prefetch.settings import LoaderSettings
from lightning_accel.prefetch.stateful_tunable import tunable_loader
from lightning_accel.prefetch.tunable_loader import TunableLoader
from lightning_accel.prefetch.wait_meter import WaitMeter, WaitStats


class PrefetchTuner(Callback):
    """Tunes ``num_workers``, ``pin_memory`` and ``persistent_workers`` of the train loader.

    ``prefetch_factor`` stays the loader's own (2 by default), bounded by the memory budget:
    buffers absorb uneven items but cannot raise the rate the workers make batches at, which
    is what the search measures (see :attr:`~lightning_accel.prefetch.PrefetchSearch.best`).

    Args:
        max_workers: worker processes per rank at most; ``None``: 4 x the rank's CPU budget
            (affinity, cgroup quota, SLURM, local ranks). CPU-bound items stay within the budget.
        memory_budget_bytes: bytes of buffered batches per rank at most
            (workers x prefetch_factor x batch bytes); ``None``: half the free RAM / shared memory.
        warmup_steps: steps ignored before measuring (worker start-up, the epoch's set-up).
        trial_steps: steps measured at most to decide whether training is data-bound; two are
            enough when each waited longer for its batch than it computed (clearly data-bound;
            two also give the measurement its spread), one when the warm-up step waited over 3x
            as long as it computed and the first candidate's workers started right after it,
            none when they started while the first batch loaded (``speculate``): the warm-up
            step's verdict then waits for those workers' own measurement of the items.
        max_search_steps: the search must be decided by this step; it starts after step
            ``warmup_steps + trial_steps``, which must come before it, and tries no candidate
            it could not judge in time.
        cache_path: JSON file of tuned settings per dataset and machine; a hit skips the search.
        data_bound_fraction: share of time waiting above which the loader is tuned.
        stream_switch: for an iterable dataset that cannot report its position:
            ``"next_epoch"`` (default, loses no data) or ``"restart"`` (the tuned settings
            serve now and the stream starts again from its beginning).

    Every setting lives in :attr:`options` (:class:`~lightning_accel.prefetch.options.TunerOptions`),
    which the search reads: the heuristics ``early``, ``speculate``, ``guess``, ``max_lead``,
    ``remeasure`` and ``cpu_busy_threshold`` may be set there before fit
    (``tuner.options.early = False``).
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
        stream_switch: str = "next_epoch",
    ) -> None:
        # the single source of every setting: OnlineSearch and the wrap read it, nothing here keeps a copy
        self.options = TunerOptions(
            max_workers=max_workers, memory_budget_bytes=memory_budget_bytes, warmup_steps=warmup_steps,
            trial_steps=trial_steps, max_search_steps=max_search_steps, cache_path=cache_path,
            data_bound_fraction=data_bound_fraction, stream_switch=stream_switch,
        )
        self.cpu: CpuBudget | None = None
        self.meter = WaitMeter()
        self.loader: TunableLoader | None = None
        self.online: OnlineSearch | None = None  # built as the loader is wrapped, when it is tuned here
        self._chosen: LoaderSettings | None = None  # when no search runs: the cache's settings
        self._reason = "not run"
        self._cache_key = ""
        self._hook: TrainLoaderHook | None = None  # installed for each fit (setup to teardown)
        self._why_not = "no train loader was set up"  # why the loader was kept, when it was
        self._untuned: TunableLoader | None = None  # the first of several train loaders: wrapped, serving, closed at the end
        # What a checkpoint carries (state_dict): set by a cache hit or a checkpoint's finished search;
        # a search run in this fit speaks for itself (self.online)
        self._decided: dict[str, Any] | None = None
        self._restored: dict[str, Any] | None = None  # a checkpoint's finished search, to serve at the next wrap
        self._cut_short = False  # the search was still running when training ended

    def __setattr__(self, name: str, value: Any) -> None:
        if name in OPTION_NAMES:  # once an attribute here; now nothing would read it
            raise AttributeError(
                f"PrefetchTuner.{name} is a setting of its options: set tuner.options.{name} = {value!r} before fit"
            )
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        if name in OPTION_NAMES:
            raise AttributeError(f"PrefetchTuner has no attribute {name!r}; read tuner.options.{name}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._why_not = "no train loader was set up"
            self._hook = TrainLoaderHook(trainer, lambda loader: self._wrap_early(trainer, loader))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._clean_up()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._clean_up()  # Lightning calls no teardown when fit raises
        self._close_loaders()

    def _clean_up(self) -> None:
        """Put the strategy's ``process_dataloader`` back (idempotent)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _close_loaders(self) -> None:
        """Shut down the wrapped loaders' workers and reaper threads (idempotent; the loader stays readable)."""
        for loader in (self.loader, self._untuned):
            if loader is not None:
                loader.close()
        self._untuned = None

    @override
    def state_dict(self) -> dict[str, Any]:
        """What was chosen and why, and whether the search finished (a fit resumed from it serves that choice
        without searching again); an unfinished search is searched again."""
        if self.online is not None:
            finished = self.online.done and not (self._cut_short and self.online.chosen is None)  # as the cache
            return _state(self.online.chosen, self.online.reason, finished)
        if self._decided is not None:
            return dict(self._decided)
        return _state(None, self._reason, False)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict) if state_dict.get("finished") else None

    def _wrap_early(self, trainer: pl.Trainer, loader: Any) -> Any:
        """The fit's train loader as Lightning processes it: wrapped and tuned from here, or kept (and
        ``on_train_start`` says why, once the loaders are all known)."""
        self.online, self.loader, self._chosen, self._cut_short = None, None, None, False  # a later fit decides afresh
        restored, self._restored = self._restored, None
        self._decided = restored  # the next checkpoint carries a checkpoint's choice on, even where it cannot serve
        if resumed_mid_epoch(trainer) and not is_stateful_loader(loader):
            self._why_not = "fit resumed part-way through an epoch and the loader cannot report its position"
            return loader
        budget = self._budget(trainer)
        if restored is not None and self._within(restored, budget):
            return self._serve_restored(loader, restored)
        self._decided = None
        cached = self._cached(loader, trainer, budget)
        try:
            wrapped = tunable_loader(loader, cached, self.options.stream_switch)
        except RebuildError as err:
            self._why_not = str(err)
            return loader
        self._begin(wrapped, budget, cached, trainer.lightning_module)
        return wrapped

    def _within(self, restored: dict[str, Any], budget: Budget) -> bool:
        """Whether a checkpoint's choice fits this machine's budget (it may come from a larger one)."""
        chosen = _settings(restored)
        if chosen is None or chosen.num_workers <= budget.max_workers:
            return True
        rank_zero_info(
            f"PrefetchTuner: the checkpoint's choice ({chosen.label()}) is over this machine's budget of "
            f"{budget.max_workers} workers; searching again"
        )
        return False

    def _serve_restored(self, loader: Any, restored: dict[str, Any]) -> Any:
        """A resumed fit: the checkpoint's finished search serves from the first batch, no search runs."""
        chosen = _settings(restored)
        try:
            wrapped = tunable_loader(loader, chosen, self.options.stream_switch)
        except RebuildError as err:
            self._why_not = str(err)
            return loader
        self.loader = wrapped
        self._chosen, self._reason = chosen, f"from checkpoint: {restored['reason']}"
        serves = chosen.label() if chosen is not None else "your loader's settings"
        rank_zero_info(f"PrefetchTuner: resumed with the checkpoint's choice, no search: {serves} ({restored['reason']})")
        return wrapped

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        combined = trainer.fit_loop._combined_loader
        count = len(combined.flattened) if combined is not None else 0
        if count > 1:  # the first of several was wrapped as it was processed: it serves your settings, untuned
            if self.loader is not None:
                self.loader.prepare(self.loader.settings, lead=0)  # drops workers it may have started
            self._untuned, self.online, self.loader = self.loader, None, None
            self._refuse(f"{count} train loaders; only a single train loader is supported")
        elif self.loader is None:
            self._refuse(self._why_not)
        elif self.online is not None and self.loader.handed_out == 0:
            self.meter.start()  # nothing read ahead (a loader with a length): the first wait counts from here

    def _budget(self, trainer: pl.Trainer) -> Budget:
        self.cpu = cpu_budget(trainer.num_devices)
        return default_budget(self.options.max_workers, self.options.memory_budget_bytes, trainer.num_devices)

    def _refuse(self, why_not: str) -> None:
        self._reason = f"kept your loader: {why_not}"
        rank_zero_warn(f"PrefetchTuner: {why_not}; training continues with your loader's settings")

    def _begin(self, loader: TunableLoader, budget: Budget, cached: LoaderSettings | None, pl_module: pl.LightningModule) -> None:
        """``loader`` serves from now on: with the cache's settings, or searched online from its own."""
        self.loader = loader
        if cached is not None:
            self._chosen, self._reason = cached, f"from cache {self.options.cache_path}"
            self._decided = _state(cached, self._reason, True)
            rank_zero_info(f"PrefetchTuner: {self._reason}: {cached.label()}")
            return
        self.online = OnlineSearch(
            self.loader, budget, self.cpu, self.meter, cuda=pl_module.device.type == "cuda",
            options=self.options, cache_key=self._cache_key, say=rank_zero_info, warn=rank_zero_warn,
        )
        self.online.start()

    def _cached(self, loader: Any, trainer: pl.Trainer, budget: Budget) -> LoaderSettings | None:
        if not self.options.cache_path or not hasattr(loader, "dataset"):
            return None  # no cache, or not a DataLoader (the wrap says why it is kept)
        self._cache_key = cache.cache_key(loader.dataset, getattr(loader, "batch_size", None), trainer.num_devices)
        cached = cache.load(self.options.cache_path, self._cache_key)
        return cached if cached is not None and cached.num_workers <= budget.max_workers else None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.online is not None:
            self.online.batch_arrived()
        if self.loader is not None:
            self.loader.step_started()  # batches already used are freed while this step computes

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.online is None or self.online.done:
            return
        self.online.step_ended(batch)
        if not self.online.done:
            return
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
        if self.online is not None and self.online.end():  # training ended mid-search: keep what was learnt
            self._cut_short = True
            rank_zero_info(self.report())
        self._close_loaders()

    # What the search found (before it runs, or when none runs: the cache's answer or why not).
    @property
    def chosen(self) -> LoaderSettings | None:
        return self.online.chosen if self.online is not None else self._chosen

    @property
    def reason(self) -> str:
        return self.online.reason if self.online is not None else self._reason

    @property
    def search(self) -> PrefetchSearch | None:
        return self.online.search if self.online is not None else None

    @property
    def measured(self) -> WaitStats | None:
        return self.online.measured if self.online is not None else None

    @property
    def cpu_note(self) -> str:
        return self.online.cpu_note if self.online is not None else ""

    @property
    def finished_step(self) -> int | None:
        return self.online.finished_step if self.online is not None else None

    @property
    def measurement_cost_s(self) -> float:
        return self.online.measurement_cost_s if self.online is not None else 0.0

    @property
    def remeasured(self) -> int:
        return self.online.remeasured if self.online is not None else 0

    def report(self) -> str:
        """What was measured, tried and chosen, as one table."""
        return self.online.report() if self.online is not None else search_report(self.reason)

    def trials_csv(self) -> str:
        """``settings,ms_per_batch,batches_per_s`` per trial: throughput against the settings tried."""
        return trials_csv(self.search.trials if self.search else [])

    def trials_svg(self) -> str:
        """Throughput (batches/s) against the settings tried, in order, as an SVG document."""
        return trials_svg(self.search.trials if self.search else [], self.chosen)


def _state(chosen: LoaderSettings | None, reason: str, finished: bool) -> dict[str, Any]:
    """:meth:`PrefetchTuner.state_dict`'s form: plain data, so a checkpoint loads without this package's classes."""
    return {"chosen": chosen.as_kwargs() if chosen is not None else None, "reason": reason, "finished": finished}


def _settings(state: dict[str, Any]) -> LoaderSettings | None:
    return LoaderSettings(**state["chosen"]) if state.get("chosen") is not None else None


__all__ = ["PrefetchTuner"]
