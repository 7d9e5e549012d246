"""schedule="auto"'s choice on synthetic timings: the simulator's argmin, within the memory budget, never inside the noise."""

from __future__ import annotations

import pytest

from lightning_accel.pipeline.auto_schedule import (
    AutoSchedule,
    Residual,
    StageCosts,
    candidates,
    choose,
    fit_residual,
    predict,
    same_placement,
)
from lightning_accel.pipeline.schedule_clock import peak_activations, schedule_orders, step_time


def _costs(stages: int, slow: int | None = None, fixed: float = 2e-3, per_row: float = 1e-4) -> StageCosts:
    scale = [3.0 if s == slow else 1.0 for s in range(stages)]
    return StageCosts(
        fixed={k: [fixed * x for x in scale] for k in "FIW"},
        per_row={k: [per_row * x for x in scale] for k in "FIW"},
        held_per_row=[1000.0] * stages,
    )


def _brute_force(costs: StageCosts, ranks: int, batch: int, settings: list) -> dict:
    out = {}
    for name, m in settings:
        rows = batch / m
        out[(name, m)] = step_time(schedule_orders(name, ranks, m), costs.stages, lambda k, s: costs.seconds(k, s, rows))
    return out


@pytest.mark.parametrize(("start", "stages", "slow"), [("1f1b", 2, None), ("1f1b", 2, 1), ("zbv", 4, 2), ("interleaved_1f1b", 4, None)])
def test_choice_is_the_argmin_of_the_schedule_clock(start, stages, slow):
    costs, batch = _costs(stages, slow), 32
    settings = candidates(start, batch, stages, 32)
    assert {name for name, _ in settings} == set(same_placement(start))
    times = _brute_force(costs, 2, batch, settings)
    choice = choose(costs, 2, batch, (start, 4), [0.1, 0.1, 0.1], settings)  # no spread: any gain counts
    assert times[choice.chosen] == min(times.values())  # ties: the current setting, then the fewest activations
    assert choice.switches == (times[(start, 4)] > min(times.values()))
    assert choice.best.step_s == pytest.approx(min(times.values()))
    assert choice.current.step_s == pytest.approx(times[(start, 4)])
    assert "candidates keep the current stage placement" in choice.report()


def test_fixed_cost_per_microbatch_stops_more_chunks_from_winning():
    # all cost per micro-batch (sleeping blocks): more micro-batches add work faster than they shrink the bubble
    costs = _costs(2, fixed=5e-3, per_row=0.0)
    choice = choose(costs, 2, 32, ("1f1b", 8), [0.3, 0.3], candidates("1f1b", 32, 2, 32))
    assert choice.chosen == ("gpipe", 1)  # (M + 1) x a cost that does not shrink with M: one micro-batch
    only_rows = _costs(2, fixed=0.0, per_row=1e-4)
    assert choose(only_rows, 2, 32, ("1f1b", 8), [0.3, 0.3], candidates("1f1b", 32, 2, 32)).chosen[1] == 32


def test_memory_budget_excludes_candidates_over_it():
    costs, batch = _costs(2), 32
    settings = candidates("1f1b", batch, 2, 32)
    free = choose(costs, 2, batch, ("1f1b", 4), [0.1, 0.1], settings)
    budget = free.best.peak_bytes - 1  # the unconstrained best no longer fits
    choice = choose(costs, 2, batch, ("1f1b", 4), [0.1, 0.1], settings, max_activation_bytes=budget)
    assert free.best.setting in choice.over_budget
    assert all(p.peak_bytes <= budget for p in choice.considered)
    fitting = [p for p in free.considered if p.peak_bytes <= budget]
    assert free.best.step_s < choice.best.step_s == min(p.step_s for p in fitting)
    with pytest.raises(ValueError, match="max_activation_bytes=1; raise it"):
        choose(costs, 2, batch, ("1f1b", 4), [0.1, 0.1], settings, max_activation_bytes=1)


def test_no_switch_inside_the_noise():
    costs, batch = _costs(2, slow=1), 32
    settings = candidates("1f1b", batch, 2, 32)
    sure = choose(costs, 2, batch, ("gpipe", 2), [0.100, 0.100, 0.100], settings)
    gain = sure.current.step_s - sure.best.step_s
    assert sure.switches and gain > 0
    # steps that scatter by several times the gain: the same prediction stays with the current setting
    noisy = [0.1 - 2 * gain, 0.1, 0.1 + 2 * gain]
    kept = choose(costs, 2, batch, ("gpipe", 2), noisy, settings)
    assert kept.noise_s > gain and not kept.switches and kept.chosen == ("gpipe", 2)
    assert "gains less than the noise" in kept.report()


def _measured(costs: StageCosts, residual: Residual, counts=(4, 8)) -> dict:
    """zbv's steps at each count as a machine whose actions cost ``residual`` beyond the meter would measure them."""
    return {m: [predict(("zbv", m), costs, 2, 32, residual).step_s] * 3 for m in counts}


def test_a_cost_per_action_beyond_the_meter_makes_fewer_microbatches_win():
    # metered F/I/W alone: zbv/4 is the clock's best (150.0 ms against zbv/2's 153.4); each action costing 1 ms more
    # outside the meter (runtime, sends), twice the micro-batches pay it twice as often: zbv/2 wins (167.4 vs 175.0)
    costs, settings = _costs(4, fixed=1e-3, per_row=6e-4), candidates("zbv", 32, 4, 32)
    measured = _measured(costs, Residual(1e-3, 5e-3))
    residual = fit_residual(costs, 2, 32, "zbv", measured)
    assert residual.per_action_s == pytest.approx(1e-3, rel=1e-6)
    assert residual.per_step_s == pytest.approx(5e-3, rel=1e-6) and residual.fitted_on == (4, 8)
    blind = choose(costs, 2, 32, ("zbv", 4), measured[4], settings)
    assert not blind.switches and blind.best.setting == ("zbv", 4)
    seen = choose(costs, 2, 32, ("zbv", 4), measured[4], settings, residual=residual)
    assert seen.chosen == ("zbv", 2)
    assert seen.current.step_s == pytest.approx(measured[4][0])  # the start predicted as measured
    assert "1.00 ms per action and 5.0 ms per step beyond F/I/W (fitted on chunks=4,8's measured steps)" in seen.report()
    # the fitted counts may be the start's half: the same residual
    assert fit_residual(costs, 2, 32, "zbv", _measured(costs, Residual(1e-3, 5e-3), (2, 4))).per_action_s == pytest.approx(1e-3)


@pytest.mark.parametrize("per_step", [0.0, 0.02])
def test_no_cost_per_action_beyond_the_meter_changes_nothing(per_step):
    # steps measured as the clock predicts them (plus, or not, a cost once per step): no cost per action is fitted,
    # every candidate's predicted gain over the start is the clock's own, and the choice is the same
    costs, settings = _costs(4, fixed=1e-3, per_row=6e-4), candidates("zbv", 32, 4, 32)
    measured = _measured(costs, Residual(0.0, per_step))
    residual = fit_residual(costs, 2, 32, "zbv", measured)
    assert residual.per_action_s == 0.0 and residual.per_step_s == pytest.approx(per_step, abs=1e-12)
    blind = choose(costs, 2, 32, ("zbv", 4), measured[4], settings)
    seen = choose(costs, 2, 32, ("zbv", 4), measured[4], settings, residual=residual)
    assert seen.chosen == blind.chosen == ("zbv", 4)
    assert [p.step_s - per_step for p in seen.considered] == pytest.approx([p.step_s for p in blind.considered])
    # more micro-batches measured cheaper than the clock says: no negative cost per action (it would favour them)
    cheaper = {4: measured[4], 8: [measured[8][0] - 0.01] * 3}
    assert fit_residual(costs, 2, 32, "zbv", cheaper).per_action_s == 0.0
    assert fit_residual(costs, 2, 32, "zbv", {4: measured[4]}) == Residual()  # one count: nothing to fit


def test_stage_costs_fit_a_fixed_and_a_per_row_part():
    samples = {("F", 0): [(4.0, 0.003), (4.0, 0.003), (8.0, 0.005)], ("I", 0): [(4.0, 0.002)], ("W", 0): [(8.0, 0.001)]}
    costs = StageCosts.fit(samples, {0: [(4.0, 400.0), (8.0, 800.0)]})
    assert costs.seconds("F", 0, 16.0) == pytest.approx(0.001 + 0.0005 * 16)
    assert costs.seconds("B", 0, 8.0) == pytest.approx(0.004 + 0.001)  # one size: all per row
    assert costs.held_per_row == [100.0]


def test_peak_activations_follow_the_schedule():
    held, cost = {0: 1.0, 1: 1.0}, lambda k, s: 1.0
    assert peak_activations(schedule_orders("gpipe", 2, 8), 2, cost, held) == 8  # every micro-batch alive
    assert peak_activations(schedule_orders("1f1b", 2, 8), 2, cost, held) == 2  # S - s on the first stage


def test_auto_settings_are_checked():
    with pytest.raises(ValueError, match="choose one of"):
        AutoSchedule(start="zb")
    with pytest.raises(ValueError, match="at least 2 steps"):
        AutoSchedule(steps=1)
