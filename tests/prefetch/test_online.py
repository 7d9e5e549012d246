"""The online search without Lightning: a plain loop feeds it, a simulated clock times the steps.

The meter's clock is simulated, so the start's measurement (and with it the data-bound
verdict) is exact; candidates are judged on the real finish times of a real
``TunableLoader``'s workers, over an in-memory dataset whose items sleep.
"""

from __future__ import annotations

import ast
import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

import lightning_accel.prefetch as prefetch_package
from lightning_accel.prefetch import Budget, LoaderSettings, OnlineSearch, TunableLoader, WaitMeter
from lightning_accel.prefetch.cache import load as cache_load
from lightning_accel.prefetch.options import OPTION_NAMES, TunerOptions
from lightning_accel.prefetch.report import search_report, trials_csv
from lightning_accel.prefetch.search import Trial


class Sleepy(Dataset):
    """Item ``i`` is ``i``, made in ``latency_s``."""

    def __init__(self, n: int, latency_s: float = 0.0) -> None:
        self.n, self.latency_s = n, latency_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.latency_s:
            time.sleep(self.latency_s)
        return torch.tensor(i)


class Ticks(IterableDataset):
    """A stream of ``0, 1, ...``, each item made in ``latency_s``, that cannot report its position."""

    def __init__(self, n: int, latency_s: float) -> None:
        self.n, self.latency_s = n, latency_s

    def __iter__(self):
        for i in range(self.n):
            time.sleep(self.latency_s)
            yield torch.tensor(i)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def online_search(loader: TunableLoader, clock: Clock, **kwargs) -> tuple[OnlineSearch, list[str], list[str]]:
    said: list[str] = []
    warned: list[str] = []
    meter = WaitMeter(clock=clock, cpu_clock=lambda: 0.0)  # the loading looks I/O-bound: no CPU time while waiting
    kwargs = dict(warmup_steps=1, trial_steps=3, early=False) | kwargs
    options = TunerOptions(**{k: kwargs.pop(k) for k in list(kwargs) if k in OPTION_NAMES})
    online = OnlineSearch(loader, Budget(2, 1 << 30), None, meter, options=options, say=said.append, warn=warned.append, **kwargs)
    return online, said, warned


def train(online: OnlineSearch, clock: Clock, wait_s: float, step_s: float, steps: int | None = None) -> list[tuple[int, LoaderSettings]]:
    """A training loop: each batch arrives after ``wait_s`` and its step takes ``step_s`` (simulated);
    returns each batch's sample and the settings that served it."""
    served = []
    online.start()
    for batch in online.loader:
        served.append((int(batch), online.loader.settings))
        clock.t += wait_s
        online.batch_arrived()
        clock.t += step_s
        online.step_ended(batch)
        if steps is not None and len(served) == steps:
            break
    return served


def test_compute_bound_keeps_the_loader_and_says_why():
    clock = Clock()
    loader = TunableLoader(DataLoader(Sleepy(12), batch_size=None))
    online, said, warned = online_search(loader, clock)
    try:
        served = train(online, clock, wait_s=0.001, step_s=0.1)
    finally:
        loader.close()
    # Steps 1-3 measured (step 0 is the warm-up): 1 ms waiting per 101 ms, 1% <= 10%.
    assert online.done and online.finished_step == 4
    assert online.reason == "kept your loader: compute-bound (1% of the time waiting <= 10%)"
    assert online.chosen is None and online.search is None and loader.switches == 0
    assert [s for _, s in served] == [LoaderSettings(0)] * 12 and [i for i, _ in served] == list(range(12))
    assert online.report() == (
        "PrefetchTuner: kept your loader: compute-bound (1% of the time waiting <= 10%)\n"
        "  measured over 3 steps: wait 1.0 ms, step 100.0 ms (1% waiting)"
    )
    assert said == warned == []


def test_data_bound_proposes_workers_that_take_over_at_the_prepared_batch(tmp_path):
    clock = Clock()
    loader = TunableLoader(DataLoader(Sleepy(48, latency_s=0.02), batch_size=None, shuffle=True))
    prepared: list[tuple[int, LoaderSettings, int]] = []
    original = loader.prepare

    def spy(settings: LoaderSettings, lead: int = 1) -> None:
        prepared.append((loader.consumed, settings, lead))
        original(settings, lead)

    loader.prepare = spy  # type: ignore[method-assign]
    cache_path = str(tmp_path / "tuned.json")
    online, said, warned = online_search(loader, clock, cache_path=cache_path, cache_key="k")
    try:
        # 200 ms waiting per 5 ms step: steps 1 and 2 each waited longer than they computed (clearly data-bound).
        # The start's wait is simulated, so a wide margin costs no time: two workers' real 10 ms per batch stays far
        # below it on a loaded machine too (at 50 ms, a load of 11 on 2 cores measured them at 42 +- 10: no verdict).
        served = train(online, clock, wait_s=0.2, step_s=0.005)
        online.end()
    finally:
        loader.close()
    assert sorted(i for i, _ in served) == list(range(48))  # every hand-over lost and repeated nothing
    assert online.measured is not None and online.measured.steps == 2
    at, first, lead = prepared[0]
    assert at == 3 and first.num_workers >= 1 and lead >= 1  # proposed right after the measuring steps
    # The start serves every batch before the hand-over, the candidate the one it was prepared for.
    assert [s for _, s in served[: at + lead]] == [LoaderSettings(0)] * (at + lead)
    assert served[at + lead][1] == first
    # Start: 200 ms per batch (the simulated wait); two workers at 20 ms per item: ~10 ms, far beyond the noise.
    trials = online.search.trials
    assert trials[0].settings == LoaderSettings(0) and trials[0].interval_s == pytest.approx(0.2)
    assert online.chosen is not None and online.chosen.num_workers >= 1, online.report()
    assert online.search.best.interval_s < 0.5 * trials[0].interval_s
    assert all(t.settings.num_workers <= 2 for t in trials)  # held to the budget
    assert online.reason.startswith(f"best of {len(trials)} measured online")
    assert cache_load(cache_path, "k") == online.chosen
    assert "<- chosen" in online.report() and said == warned == []


def test_training_that_ends_before_the_first_hand_over_keeps_the_start_and_caches_nothing(tmp_path):
    clock = Clock()
    loader = TunableLoader(DataLoader(Sleepy(24, latency_s=0.01), batch_size=None))
    cache_path = tmp_path / "tuned.json"
    online, _, _ = online_search(loader, clock, cache_path=str(cache_path))
    try:
        train(online, clock, wait_s=0.05, step_s=0.005, steps=3)  # the search starts at step 3, then training ends
        assert online.search is not None and not online.done
        assert online.end() and not online.end()  # cut short once; then nothing is left to end
    finally:
        loader.close()
    assert online.reason == "kept your loader: no candidate of 0 waited less by more than the noise; training ended before the search did"
    assert online.chosen is None and online.finished_step == 3
    assert not cache_path.exists()  # an unfinished "keep" is no answer for the next run


def test_a_candidate_that_cannot_be_built_is_warned_about_once_and_the_start_serves_on(monkeypatch):
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda *a, **k: "spawn")
    data = Sleepy(16)
    data.hook = lambda x: x  # cannot be pickled into spawned workers
    clock = Clock()
    loader = TunableLoader(DataLoader(data, batch_size=None))
    online, said, warned = online_search(loader, clock)
    try:
        served = train(online, clock, wait_s=0.05, step_s=0.005)
    finally:
        loader.close()
    assert len(warned) == 1 and warned[0].startswith("PrefetchTuner: dataset Sleepy cannot be pickled for 'spawn' workers")
    assert warned[0].endswith("; training continues with your loader's settings") and said == []
    assert online.reason.startswith("kept your loader: dataset Sleepy cannot be pickled") and online.chosen is None
    assert online.done and online.finished_step == 3
    assert [s for _, s in served] == [LoaderSettings(0)] * 16 and loader.switches == 0


def test_a_stream_without_a_position_is_probed_in_one_pause_and_serves_from_the_next_epoch():
    clock = Clock()
    loader = TunableLoader(DataLoader(Ticks(24, latency_s=0.01), batch_size=None))
    online, said, warned = online_search(loader, clock)
    try:
        # The start's 200 ms per batch is simulated: a margin that costs no time (at 50 ms, two workers probed at
        # 35 +- 31 ms under a load of 11 on 2 cores could not be told from it).
        served = train(online, clock, wait_s=0.2, step_s=0.005)
        # Decided at step 3 by probing the candidates alone, 10 ms items against the start's 200 ms per batch.
        assert online.done and online.finished_step == 3 and online.measurement_cost_s > 0
        assert online.chosen is not None and online.chosen.num_workers >= 1, online.report()
        when = (
            "used from the next epoch (Ticks cannot report its position (no state_dict/load_state_dict)); "
            "pass stream_switch='restart' to switch now, restarting the stream"
        )
        assert said == [f"PrefetchTuner: {online.chosen.label()} {when}"] and warned == []
        assert online.reason == f"fastest of {len(online.search.trials)} probed within the budget, {when}"
        # This epoch ran on the start to its end, unbroken; the next one starts on the chosen settings.
        assert [i for i, _ in served] == list(range(24)) and {s for _, s in served} == {LoaderSettings(0)}
        assert loader.preparing == online.chosen
        next(iter(loader))
        assert loader.settings == online.chosen
    finally:
        loader.close()


def test_report_of_a_search_that_never_ran_is_its_reason_and_csv_has_a_row_per_trial():
    assert search_report("from cache tuned.json") == "PrefetchTuner: from cache tuned.json"
    trials = [Trial(LoaderSettings(0), 0.05, 0.05), Trial(LoaderSettings(2, 2), 0.01, 0.0)]
    assert trials_csv(trials) == (
        "num_workers,prefetch_factor,pin_memory,ms_per_batch,batches_per_s\n0,0,0,50.000,20.000\n2,2,0,10.000,100.000\n"
    )


def test_the_prefetch_package_never_imports_lightning():
    # Mechanism packages stay Lightning-free; the callbacks are the only adapters.
    for path in sorted(Path(prefetch_package.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "lightning" or n.startswith(("lightning.", "pytorch_lightning")) for n in names), path


def test_candidates_are_judged_against_the_step_time_past_the_warm_up():
    # The first three steps take 300 ms (warm-up: autotuning, first allocations), every later one 20 ms:
    # the search's step time follows the median of the steps after step 0, not the start's measurement.
    clock = Clock()
    loader = TunableLoader(DataLoader(Sleepy(40, latency_s=0.02), batch_size=None))
    online, said, warned = online_search(loader, clock)
    steps: list[float] = []
    try:
        online.start()
        for n, batch in enumerate(loader):
            clock.t += 0.1 if online.search is None else 0.0  # the start waits; candidates' waits do not matter here
            online.batch_arrived()
            steps.append(0.3 if n < 3 else 0.02)
            clock.t += steps[-1]
            online.step_ended(batch)
            if online.done:
                break
    finally:
        loader.close()
    assert online.measured is not None and online.measured.step_s > 0.2  # steps 1-3, two of them warm-up
    assert online.search is not None and online.search.step_s == pytest.approx(sorted(steps[1:])[len(steps[1:]) // 2])
    assert online.search.step_s == pytest.approx(0.02)  # by the end most steps were steady
    for trial in online.search.trials[1:]:  # every candidate's predicted wait is against the current step
        assert trial.wait_s == pytest.approx(max(0.0, trial.interval_s - 0.02))


def test_a_loop_reading_a_batch_ahead_measures_the_start_on_its_own_batches_only():
    # Lightning reads one batch ahead of a stream: each step's wait fetched the next batch, so the wait
    # of the step before the early candidate's hand-over already fetched one of the candidate's batches.
    # It is not the start's: averaged in (2 ms with 150 ms), it once made the start too noisy to beat.
    clock = Clock()
    loader = TunableLoader(DataLoader(Sleepy(40, latency_s=0.005), batch_size=None))
    online, _, _ = online_search(loader, clock, early=True, speculate=False, trial_steps=2)
    served: list[LoaderSettings] = []

    def fetch(batches):
        batch = next(batches)
        served.append(loader.settings)
        clock.t += 0.0 if loader.settings.num_workers else 0.1  # 100 ms a batch here; workers had theirs ready
        return batch

    try:
        online.start()
        batches = iter(loader)
        ahead = fetch(batches)
        for _ in range(30):
            batch, ahead = ahead, fetch(batches)
            online.batch_arrived()
            clock.t += 0.01
            online.step_ended(batch)
    finally:
        loader.close()
    took_over = served.index(online.started_early)
    assert took_over >= 2 and all(s == LoaderSettings(0) for s in served[:took_over])  # the early candidate
    start = online.search.trials[0]
    assert start.settings == LoaderSettings(0)
    assert start.interval_s == pytest.approx(0.1) and start.spread_s == pytest.approx(0.0), online.report()
