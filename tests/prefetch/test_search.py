"""The loader-settings search against simulated loaders whose best settings are known."""

from __future__ import annotations

import pytest

from lightning_accel.prefetch import Budget, LoaderSettings, PrefetchSearch, Trial, default_budget

MB = 1 << 20


def run(search: PrefetchSearch, interval) -> list[LoaderSettings]:
    """Drive the search with a simulated loader; returns the settings it asked to measure."""
    asked = []
    while (s := search.propose()) is not None:
        asked.append(s)
        search.record(s, interval(s))
    return asked


def io_bound(latency: float, produce: float = 0.0):
    # Workers overlap I/O perfectly: one batch per latency/workers; no workers pays it in line.
    return lambda s: latency + produce if s.num_workers == 0 else max(latency / s.num_workers, produce)


def brute_force_wait(interval, step: float, budget: Budget, batch_bytes: int) -> float:
    candidates = [LoaderSettings(w, 2 if w else None) for w in range(0, budget.max_workers + 1)]
    return min(max(0.0, interval(s) - step) for s in candidates if budget.allows(s, batch_bytes))


def test_seed004_workload_reaches_zero_wait_in_one_model_guided_jump():
    # 0.5 s of latency per batch, 0.1 s step: the wait vanishes from 5 workers on. The start's
    # measurement says 0.5 / 0.1 = 5 workers would do, so the doubling starts at 8, not 2.
    interval = io_bound(0.5)
    search = PrefetchSearch(LoaderSettings(), step_s=0.1, batch_bytes=48 * MB, budget=Budget(8, 10_000 * MB))
    asked = run(search, interval)
    assert [s.num_workers for s in asked] == [0, 8]
    assert search.best.wait_s == 0.0 == brute_force_wait(interval, 0.1, search.budget, 48 * MB)
    assert search.best.settings == LoaderSettings(8, 2, pin_memory=False, persistent_workers=True)


def test_seed004_from_a_shorter_latency_doubles_from_the_guess():
    # 0.25 s per item, 0.1 s step: the model says 2.5 workers, so 4; 4 leave 0.0625 - 0.1 < 0: done.
    search = PrefetchSearch(LoaderSettings(), step_s=0.1, batch_bytes=MB, budget=Budget(8, 10_000 * MB))
    assert [s.num_workers for s in run(search, io_bound(0.25))] == [0, 4]
    # An optimistic model (an item takes 3x longer in a busy worker than in line): doubling goes on.
    contended = lambda s: 0.5 if s.num_workers == 0 else 1.5 / s.num_workers  # noqa: E731
    search = PrefetchSearch(LoaderSettings(), step_s=0.1, batch_bytes=MB, budget=Budget(16, 10_000 * MB))
    assert [s.num_workers for s in run(search, contended)] == [0, 8, 16]
    assert search.best.settings.num_workers == 16 and search.best.wait_s == 0.0


def test_worker_budget_is_respected_and_climbed_to():
    interval = io_bound(0.5)
    budget = Budget(max_workers=3, memory_bytes=10_000 * MB)
    search = PrefetchSearch(LoaderSettings(), step_s=0.1, batch_bytes=48 * MB, budget=budget)
    asked = run(search, interval)
    assert max(s.num_workers for s in asked) == 3  # doubling stops at 2, climbing finds 3
    assert search.best.settings.num_workers == 3
    assert search.best.wait_s == pytest.approx(brute_force_wait(interval, 0.1, budget, 48 * MB))


def test_memory_budget_caps_workers_times_prefetch_times_batch():
    interval = io_bound(0.5)
    budget = Budget(max_workers=64, memory_bytes=5 * 48 * MB)  # room for 5 buffered batches: 2 workers x 2
    search = PrefetchSearch(LoaderSettings(), step_s=0.1, batch_bytes=48 * MB, budget=budget)
    asked = run(search, interval)
    assert all(s.buffered_batches * 48 * MB <= budget.memory_bytes for s in asked[1:])
    assert search.best.settings.num_workers == 2


def test_cpu_bound_loader_stops_when_gains_flatten():
    # Decoding holds a core: 2 cores give at most 2x, more workers add nothing.
    interval = lambda s: 0.4 / min(max(s.num_workers, 1), 2)  # noqa: E731
    search = PrefetchSearch(LoaderSettings(), step_s=0.1, batch_bytes=MB, budget=Budget(64, 10_000 * MB))
    asked = run(search, interval)
    # The model guesses 0.4 / 0.1 = 4 workers; 8 does not pay, so 16 is never tried, and the
    # climb back down finds that 2 do as well as 4.
    assert [s.num_workers for s in asked][:3] == [0, 4, 8] and max(s.num_workers for s in asked) == 8
    assert search.best.settings.num_workers == 2  # the fewest workers among equals


def test_already_fast_loader_is_measured_once_and_kept():
    search = PrefetchSearch(LoaderSettings(4, 2), step_s=0.1, batch_bytes=MB, budget=Budget(8, 10_000 * MB))
    asked = run(search, lambda s: 0.01)
    assert asked == [LoaderSettings(4, 2)]
    assert search.best.settings == LoaderSettings(4, 2)


def test_pin_memory_only_with_cuda():
    for cuda in (False, True):
        search = PrefetchSearch(LoaderSettings(), 0.1, MB, Budget(8, 10_000 * MB), cuda=cuda)
        asked = run(search, io_bound(0.5))
        assert all(s.pin_memory is cuda for s in asked[1:])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(max_workers=0, memory_bytes=1), r"max_workers=0 must be a positive integer; pass max_workers=None"),
        (dict(max_workers=-2, memory_bytes=1), r"max_workers=-2"),
        (dict(max_workers=1, memory_bytes=0), r"memory_budget_bytes=0 must be a positive integer; pass memory_budget"),
        (dict(max_workers=1, memory_bytes=-5), r"memory_budget_bytes=-5"),
    ],
)
def test_bad_budgets_are_rejected_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        Budget(**kwargs)
    assert "\n" not in str(info.value)


def test_default_budget_splits_between_ranks():
    one, four = default_budget(local_world_size=1), default_budget(local_world_size=4)
    assert one.max_workers >= four.max_workers >= 1
    assert four.memory_bytes <= one.memory_bytes // 3  # free memory may move a little in between
    assert default_budget(max_workers=3, memory_bytes=7) == Budget(3, 7)


def test_a_gain_within_the_noise_does_not_replace_the_start():
    # Issue 15's CPU-bound case: 68.7 -> 68.1 ms per batch is 1%, inside a 2 ms standard error.
    search = PrefetchSearch(LoaderSettings(), step_s=0.005, batch_bytes=MB, budget=Budget(8, 10_000 * MB))
    start = search.record(LoaderSettings(), 0.0687, spread_s=0.002)
    eight = search.record(LoaderSettings(8, 2), 0.0681 + 0.005, spread_s=0.002)  # wait 68.1 ms with workers
    assert not search.beats(eight, start)
    assert search.best is start  # within the noise: the fewest workers
    # The same gain measured without noise would count; a large one counts despite the noise.
    assert search.beats(Trial(eight.settings, eight.interval_s, eight.wait_s, 0.0), Trial(start.settings, 0.0687, 0.0687))
    four = search.record(LoaderSettings(4, 2), 0.030, spread_s=0.002)
    assert search.beats(four, start) and search.best is four


def test_noisy_doubling_stops_when_the_gain_is_inside_the_spread():
    search = PrefetchSearch(LoaderSettings(), step_s=0.01, batch_bytes=MB, budget=Budget(16, 10_000 * MB), guess=False)
    search.record(search.propose(), 0.2, 0.01)
    assert search.propose() == LoaderSettings(2, 2, persistent_workers=True)
    search.record(LoaderSettings(2, 2, persistent_workers=True), 0.12, 0.01)
    assert search.propose().num_workers == 4  # 40% faster, far outside the noise: keep doubling
    search.record(LoaderSettings(4, 2, persistent_workers=True), 0.10, 0.015)
    # 17% faster (above min_gain) but within 2 x hypot(10, 15) ms = 36 ms of noise: no 8.
    assert all(s.num_workers != 8 for s in run(search, lambda s: 0.1))


def test_default_budget_follows_the_cpu_budget(monkeypatch):
    import lightning_accel.prefetch.search as search_module
    from lightning_accel.cpu_budget import CpuBudget

    monkeypatch.setattr(search_module, "cpu_budget", lambda ranks: CpuBudget(max(1, 3 // ranks), "affinity", ranks, "given"))
    assert default_budget(local_world_size=1).max_workers == 12  # 4 x 3 cores for I/O-bound items
    assert default_budget(local_world_size=2).max_workers == 4


def test_a_budget_shrunk_after_measuring_drops_the_trials_it_no_longer_allows():
    search = PrefetchSearch(LoaderSettings(), step_s=0.1, batch_bytes=MB, budget=Budget(16, 10_000 * MB))
    search.record(search.propose(), 0.8)
    eight = search.propose()
    assert eight.num_workers == 8
    search.record(eight, 0.3)
    search.budget = Budget(2, 10_000 * MB)  # the tuner learnt the items are CPU-bound: 2 cores
    assert search.best.settings == LoaderSettings()  # 8 workers are out; the start stays
    nxt = search.propose()
    assert nxt is not None and nxt.num_workers <= 2  # the search goes on within the new budget


def test_a_candidate_faster_than_every_sample_of_a_rough_start_wins():
    # Two samples under heavy load (256 and 549 ms) give a 146 ms standard error: the 2.4x faster
    # candidate is inside twice the combined spread, yet faster than both samples.
    search = PrefetchSearch(LoaderSettings(), step_s=0.045, batch_bytes=MB, budget=Budget(2, 10_000 * MB))
    start = search.record(LoaderSettings(), 0.4027, spread_s=0.1466, fastest_s=0.256)
    two = search.record(LoaderSettings(2, 2, persistent_workers=True), 0.1669, spread_s=0.0095, fastest_s=0.15)
    assert two.wait_s > 0 and search.beats(two, start)
    # Issue 15's 1%: not faster than the start's fastest sample, and within the noise.
    start = Trial(LoaderSettings(), 0.0687, 0.0687, 0.002, fastest_s=0.0670)
    eight = Trial(LoaderSettings(8, 2), 0.0731, 0.0681, 0.002)
    assert not search.beats(eight, start)


def test_headroom_jumps_past_the_count_that_only_just_keeps_up():
    # 0.2 s items, 0.05 s step: 4 workers keep up exactly; with headroom 1.5 the first jump is to 8.
    plain = PrefetchSearch(LoaderSettings(), step_s=0.05, batch_bytes=MB, budget=Budget(8, 10_000 * MB))
    roomy = PrefetchSearch(LoaderSettings(), step_s=0.05, batch_bytes=MB, budget=Budget(8, 10_000 * MB), headroom=1.5)
    assert [s.num_workers for s in run(plain, io_bound(0.2))][:2] == [0, 4]
    assert [s.num_workers for s in run(roomy, io_bound(0.2))][:2] == [0, 8]


def test_a_noisy_trial_with_fewer_workers_does_not_win_by_its_noise():
    # Measured on a loaded machine: one worker's item times scattered (50.9 +- 20 ms) over a 6.2 ms step.
    search = PrefetchSearch(LoaderSettings(), step_s=0.0062, batch_bytes=MB, budget=Budget(2, 10_000 * MB))
    start = search.record(LoaderSettings(), 0.0341, 0.0008, fastest_s=0.0335)
    two = search.record(LoaderSettings(2, 2, persistent_workers=True), 0.0219, 0.0012, fastest_s=0.0205)
    search.record(LoaderSettings(1, 2, persistent_workers=True), 0.0509, 0.0200, fastest_s=0.0309)
    assert search.best is two and search.beats(two, start)


def test_a_draw_inside_a_wide_noise_is_undecided_and_more_samples_decide_it():
    # The jpeg-tar case measured under load: the start 290 +- 6 ms, 2 workers 287 +- 102 ms on 3 samples.
    search = PrefetchSearch(LoaderSettings(), step_s=0.016, batch_bytes=MB, budget=Budget(2, 10_000 * MB))
    search.record(search.propose(), 0.290, 0.006)
    rough = search.record(LoaderSettings(2, 2, persistent_workers=True), 0.287, 0.102)
    assert search.undecided(rough)
    search.trials.pop()  # measured longer, past the hiccups of its first samples: now it beats the start
    sharper = search.record(LoaderSettings(2, 2, persistent_workers=True), 0.150, 0.025)
    assert not search.undecided(sharper) and search.beats(sharper, search.trials[0])
    # Clearly worse, or a difference too small to matter (both below a negligible wait): decided.
    worse = PrefetchSearch(LoaderSettings(), step_s=0.1, batch_bytes=MB, budget=Budget(4, 10_000 * MB))
    worse.record(LoaderSettings(), 0.05, 0.002)
    assert not worse.undecided(worse.record(LoaderSettings(2, 2, persistent_workers=True), 0.4, 0.01))
    tiny = PrefetchSearch(LoaderSettings(), step_s=0.1, batch_bytes=MB, budget=Budget(4, 10_000 * MB))
    tiny.record(LoaderSettings(), 0.05, 0.001)
    assert not tiny.undecided(tiny.record(LoaderSettings(2, 2, persistent_workers=True), 0.051, 0.001))
    assert not PrefetchSearch(LoaderSettings(), 0.1, MB, Budget(4, MB)).undecided(Trial(LoaderSettings(), 0.1, 0.1))


def test_a_candidate_slower_on_average_than_the_start_is_never_best_by_its_noise():
    # Measured under a load average of 11: 4 workers clearly beat the start; 2 workers, tried next,
    # scattered so widely that nothing was "better" than them beyond the noise.
    search = PrefetchSearch(LoaderSettings(), step_s=0.019, batch_bytes=MB, budget=Budget(4, 10_000 * MB))
    start = search.record(LoaderSettings(), 0.057, 0.0015, fastest_s=0.055)
    four = search.record(LoaderSettings(4, 2, persistent_workers=True), 0.030, 0.013, fastest_s=0.020)
    search.record(LoaderSettings(2, 2, persistent_workers=True), 0.365, 0.203, fastest_s=0.2)
    assert search.best is four and search.beats(four, start)


def test_among_candidates_that_beat_the_start_the_mean_wait_decides():
    # bench prefetch, jpeg-tar, 2026-11-23 (load ~2.5): the start's two samples 29.9 and 149.5 ms (a fork
    # stall), 2 workers 30.5 +- 6.2 ms, 1 worker 43.5 +- 16.4 ms per batch over a 13.8 ms step. Before,
    # 1 worker was "best" (no trial beat it beyond the noise) and, not beating the start, the start stayed.
    search = PrefetchSearch(LoaderSettings(), step_s=0.0138, batch_bytes=MB, budget=Budget(2, 10_000 * MB))
    start = search.record(LoaderSettings(), 0.0897, 0.0598, fastest_s=0.0299)
    two = search.record(LoaderSettings(2, 2, persistent_workers=True), 0.0305, 0.0062, fastest_s=0.024)
    one = search.record(LoaderSettings(1, 2, persistent_workers=True), 0.0435, 0.0164, fastest_s=0.030)
    assert search.beats(two, start) and not search.beats(one, start)
    assert not search.beats(two, one)  # within the noise of each other: the old rule took the fewest
    assert search.best is two
    # Both beat the start (the quiet-machine JPEG case): 1 worker's mean wait is cut 2.5x by 2 workers.
    search = PrefetchSearch(LoaderSettings(), step_s=0.010, batch_bytes=MB, budget=Budget(2, 10_000 * MB))
    search.record(LoaderSettings(), 0.127, 0.002, fastest_s=0.124)
    one = search.record(LoaderSettings(1, 2, persistent_workers=True), 0.0200, 0.006)
    two = search.record(LoaderSettings(2, 2, persistent_workers=True), 0.0140, 0.004)
    assert not search.beats(two, one) and search.best is two
    # A cut smaller than min_gain of the wait (or than a negligible share of the step) buys no workers.
    search = PrefetchSearch(LoaderSettings(), step_s=0.010, batch_bytes=MB, budget=Budget(8, 10_000 * MB))
    search.record(LoaderSettings(), 0.300, 0.002, fastest_s=0.295)
    four = search.record(LoaderSettings(4, 2, persistent_workers=True), 0.0600, 0.001)
    search.record(LoaderSettings(8, 2, persistent_workers=True), 0.0560, 0.001)  # 4 ms less of a 50 ms wait: 8%
    assert search.best is four


def test_a_start_over_a_shrunk_budget_gives_way_to_the_best_that_fits_without_beating_it():
    search = PrefetchSearch(LoaderSettings(8, 2), step_s=0.010, batch_bytes=MB, budget=Budget(8, 10_000 * MB))
    search.record(LoaderSettings(8, 2), 0.030, 0.010)
    two = search.record(LoaderSettings(2, 2, persistent_workers=True), 0.032, 0.010)  # a draw with the start
    search.budget = Budget(2, 10_000 * MB)  # CPU-bound items: 2 cores
    assert not search.beats(two, search.trials[0]) and search.best is two


def test_fewer_cpu_bound_workers_that_could_not_win_are_not_measured():
    # bench prefetch, jpeg, quiet machine: the start 95.5 ms, 2 workers 16.1 ms a batch over a 15.1 ms step,
    # 2 cores. One worker has a core of its own at best (2 workers and training shared 2 cores): 21.5 ms.
    def searched(cpu_cores):
        search = PrefetchSearch(LoaderSettings(), step_s=0.0151, batch_bytes=MB, budget=Budget(2, 10_000 * MB), cpu_cores=cpu_cores)
        search.record(search.propose(), 0.0955, 0.002, fastest_s=0.09)
        two = search.propose()
        assert two.num_workers == 2
        search.record(two, 0.0161, 0.0005)
        return search.propose()

    assert searched(None) == LoaderSettings(1, 2, persistent_workers=True)  # unknown cores: measured, as before
    assert searched(2) is None  # at best 21.5 - 15.1 = 6.4 ms of wait against 1.0: it could not be chosen
    # 4 workers on 2 cores shared 5 ways: one item at best 16.1 x 4 x 2/5 = 25.8 ms, so 2 workers might keep up.
    search = PrefetchSearch(LoaderSettings(), step_s=0.0151, batch_bytes=MB, budget=Budget(4, 10_000 * MB), cpu_cores=2)
    search.record(search.propose(), 0.0955, 0.002, fastest_s=0.09)
    four = search.propose()
    assert four.num_workers == 4  # the model's jump: 95.5 / 15.1 = 6.3 workers, within the budget of 4
    search.record(four, 0.0161, 0.0005)
    assert search.propose() == LoaderSettings(2, 2, persistent_workers=True)


def test_prefetch_factor_is_not_searched():
    # Buffers cannot raise the rate the wait is predicted from: a deeper prefetch_factor could only win by noise.
    search = PrefetchSearch(LoaderSettings(), step_s=0.01, batch_bytes=MB, budget=Budget(2, 10_000 * MB))
    asked = run(search, lambda s: 0.1 if s.num_workers == 0 else 0.04 / s.num_workers)
    assert all(s.prefetch_factor in (None, 2) for s in asked)


def test_waits_follow_the_step_time_measured_again():
    # Judged against a warm-up step (300 ms) both counts leave no wait and the fewest win; against the
    # steady 20 ms step one worker leaves 40 ms a step and two 10 ms.
    search = PrefetchSearch(LoaderSettings(), step_s=0.3, batch_bytes=MB, budget=Budget(2, 10_000 * MB))
    start = search.record(LoaderSettings(), 0.100, 0.001, fastest_s=0.099)
    one = search.record(LoaderSettings(1, 2, persistent_workers=True), 0.060, 0.001)
    two = search.record(LoaderSettings(2, 2, persistent_workers=True), 0.030, 0.001)
    assert one.wait_s == two.wait_s == 0.0 and search.best is one
    search.restep(0.020)
    assert start.wait_s == 0.100  # without workers nothing overlaps: the wait is the interval, whatever the step
    assert one.wait_s == pytest.approx(0.040) and two.wait_s == pytest.approx(0.010) and search.best is two
    search.restep(0.0)  # no measurement: nothing changes
    assert search.step_s == 0.020
