import pytest

from lightning_accel.pipeline.schedule import (
    Action,
    bubble_fraction,
    check_schedule,
    equal_microbatches,
    clock_cycles,
    gpipe_order,
    ideal_speedup,
    one_f_one_b_order,
    simulate,
)


def _names(actions):
    return [f"{a.kind}{a.microbatch}" for a in actions]


def test_gpipe_clock_cycles_by_hand():
    assert list(clock_cycles(1, 1)) == [[(0, 0)]]
    assert list(clock_cycles(1, 3)) == [[(0, 0)], [(0, 1)], [(0, 2)]]
    assert list(clock_cycles(3, 1)) == [[(0, 0)], [(1, 0)], [(2, 0)]]
    assert list(clock_cycles(3, 3)) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1), (0, 2)],
        [(2, 1), (1, 2)],
        [(2, 2)],
    ]
    assert list(clock_cycles(4, 2)) == [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(3, 0), (2, 1)], [(3, 1)]]


def test_gpipe_order_by_hand():
    assert [_names(o) for o in gpipe_order(3, 2)] == [
        ["F0", "F1", "F2", "B2", "B1", "B0"],
        ["F0", "F1", "F2", "B2", "B1", "B0"],
    ]


def test_one_f_one_b_order_by_hand():
    assert [_names(o) for o in one_f_one_b_order(4, 2)] == [
        ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
        ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],
    ]
    assert [_names(o) for o in one_f_one_b_order(4, 3)] == [
        ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"],
        ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
        ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],
    ]
    # fewer micro-batches than warm-up slots: all forwards, then all backwards
    assert [_names(o) for o in one_f_one_b_order(1, 3)] == [["F0", "B0"]] * 3


def test_simulated_gpipe_matches_clock_cycles_then_drains_in_reverse():
    m, n = 3, 3
    clocks = simulate(gpipe_order(m, n))
    forward = [[(a.microbatch, a.stage) for a in c if a.kind == "F"] for c in clocks[: m + n - 1]]
    assert [sorted(c) for c in forward] == [sorted(c) for c in clock_cycles(m, n)]
    backward = clocks[m + n - 1 :]
    assert backward[0] == [Action("B", 2, 2)]
    assert backward[-1] == [Action("B", 0, 0)]
    assert len(clocks) == 2 * (m + n - 1)


def test_simulated_one_f_one_b_by_hand():
    clocks = simulate(one_f_one_b_order(4, 2))
    by_stage = [[f"{a.kind}{a.microbatch}" if a else "--" for a in row] for row in zip(
        *[[next((a for a in c if a.stage == s), None) for s in range(2)] for c in clocks]
    )]
    assert by_stage == [
        ["F0", "F1", "--", "B0", "F2", "B1", "F3", "B2", "--", "B3"],
        ["--", "F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "--"],
    ]


def test_simulate_detects_deadlock():
    bad = [[Action("F", 0, 0), Action("B", 0, 0)], [Action("B", 0, 1), Action("F", 0, 1)]]
    with pytest.raises(ValueError, match="deadlock"):
        simulate(bad)


def test_bubble_and_ideal_speedup():
    assert bubble_fraction(8, 2) == pytest.approx(1 / 9)
    assert ideal_speedup(8, 2) == pytest.approx(16 / 9)
    assert ideal_speedup(1, 4) == pytest.approx(1.0)


def test_check_schedule_errors():
    check_schedule("gpipe", 1, 4)
    check_schedule("1f1b", 4, 4)
    check_schedule("interleaved_1f1b", 8, 4)
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'zb'"):
        check_schedule("zb", 4, 2)
    with pytest.raises(ValueError, match=r"chunks=2, stages=4\); set chunks >= 4 or schedule='gpipe'"):
        check_schedule("1f1b", 2, 4)
    with pytest.raises(ValueError, match=r"multiple of the 2 rounds \(chunks=9, stages=4\); set chunks=8"):
        check_schedule("interleaved_1f1b", 9, 4)


def test_equal_micro_batches_of_a_ragged_batch():
    """chunks where it divides the batch; else the largest divisor below it the schedule runs; else the smallest above;
    None where none does (1F1B on 2 stages needs 2 micro-batches: a batch of 1 has none)."""
    cases = [(8, 4, "gpipe", 2), (2, 4, "gpipe", 2), (6, 4, "1f1b", 2), (7, 4, "gpipe", 2), (7, 4, "1f1b", 2),
             (1, 4, "1f1b", 2), (5, 8, "interleaved_1f1b", 4), (12, 8, "interleaved_1f1b", 4)]
    assert [equal_microbatches(*c) for c in cases] == [4, 2, 3, 1, 7, None, 5, 6]
