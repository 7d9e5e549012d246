"""The schedule bench's ideal: its simulation of a schedule's order against the closed forms (no process group)."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.benchmarks.pipeline_schedules import SleepNet, _orders, ideal_step, picture
from lightning_accel.pipeline.schedule import bubble_fraction


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("m", "s"), [(8, 2), (4, 4), (3, 2)])
def test_ideal_step_of_one_stage_per_rank_is_the_fill_drain_closed_form(name, m, s):
    cost = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
    step = ideal_step(_orders(name, s, m), s, cost)
    assert step == (m + s - 1) * 3.0  # (M + S - 1) x (F + B)
    assert 1 - m * 3.0 / step == pytest.approx(bubble_fraction(m, s))


def test_ideal_step_orders_split_backwards_and_draws_them():
    # one stage per rank, backward split by hand: W waits for its own I, the previous stage's I for the next one's
    orders = {0: [("F", 0, 0), ("I", 0, 0), ("W", 0, 0)], 1: [("F", 1, 0), ("I", 1, 0), ("W", 1, 0)]}
    cost = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
    assert ideal_step(orders, 2, cost) == 5.0  # F0 F1 I1 I0 W0, with rank 1's W beside rank 0's I
    assert picture(orders, 2, cost, 0.5) == "rank 0: F0....I0W0\nrank 1: ..F0I0W0"
    with pytest.raises(ValueError, match="deadlock"):
        ideal_step({0: [("I", 0, 0), ("F", 0, 0)]}, 1, cost)


def test_sleep_blocks_compute_tanh_of_a_product():
    torch.manual_seed(0)
    net = SleepNet(2, 8, 0.0, 0.0, 0.0)
    x = torch.randn(4, 8)
    expected = torch.tanh(torch.tanh(x @ net.blocks[0].weight) @ net.blocks[1].weight)
    torch.testing.assert_close(net(x), expected)
    net(x).sum().backward()
    assert all(p.grad is not None for p in net.parameters())


@pytest.mark.parametrize("input_grad", [False, True])
def test_every_sleep_block_pays_f_i_w_even_the_first_on_an_input_without_gradient(monkeypatch, input_grad):
    # the raw input needs no gradient (the pipeline's stage 0): the first block's i is slept on its weight's backward
    slept: list[float] = []
    monkeypatch.setattr("lightning_accel.benchmarks.pipeline_schedules.time.sleep", slept.append)
    net = SleepNet(2, 8, 0.001, 0.01, 0.1)
    net(torch.randn(4, 8, requires_grad=input_grad)).sum().backward()
    first_block = [0.01, 0.1] if input_grad else [0.11]  # its i on the input's backward, else beside its w
    assert sorted(slept) == pytest.approx(sorted([0.001, 0.001, 0.01, 0.1, *first_block]))
    assert sum(slept) == pytest.approx(2 * (0.001 + 0.01 + 0.1))  # 2 blocks x (f + i + w)


def test_busy_clock_takes_each_sleep_as_it_ran_on_the_nets_one_clock():
    net = SleepNet(2, 8, 0.002, 0.002, 0.002)
    assert all(block.clock is net.clock for block in net.blocks)
    net(torch.randn(4, 8)).sum().backward()  # 2 blocks x (f + i + w), the first block's i beside its w
    busy = net.clock.take()
    assert 2 * 0.006 <= busy < 1.0  # a sleep never ends early; late, it is still the rank's time
    assert net.clock.take() == 0.0  # taken: the next step starts from nothing


@pytest.mark.slow  # 2 subprocess ranks, 2 schedules: ~15 s on a quiet 2-core machine
def test_shrunk_schedule_table_prints_a_row_per_schedule_and_the_v_timeline(capsys):
    from lightning_accel.benchmarks.pipeline import main

    assert main(["--schedules", "1f1b,zbv", "--steps", "1", "--cost-f", "1", "--cost-i", "1", "--cost-w", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("1f1b ", "zbv "))}
    assert set(rows) == {"1f1b", "zbv"}
    assert rows["1f1b"][7] == "0.111"  # the fill-drain ideal bubble: (S - 1) / (M + S - 1) with S=2, M=8
    assert "zbv: " in out and "below 1f1b's step" in out and "half of 1f1b's idle bubble" in out
    assert "target >= 0.95x" in out
    # idle time is what is left of the step beyond the busy time, and a sleep never ends early: busy >= nominal work
    work = 8 * 2 * 3e-3  # M x blocks per rank x (f + i + w)
    for row in rows.values():
        raw, ours, raw_idle, ours_idle, nominal = (float(row[k]) for k in (1, 2, 4, 5, 6))
        assert 0 <= ours_idle <= nominal and 0 <= raw_idle <= 1 - work / raw + 1e-3  # 1e-3: the printed rounding
        busy = [float(row[k]) for k in (9, 11)]  # ours, rank 0 / rank 1
        assert all(b >= work - 5e-4 for b in busy) and max(busy) == pytest.approx(ours * (1 - ours_idle), abs=2e-3)
    # the V: rank 0 runs stage 0's forwards (upper case) and the last stage's (lower case); rank 1 starts idle
    timeline = out[out.index("zbv, the schedule's order"):].splitlines()
    assert timeline[1].startswith("rank 0: F0F1F2f0") and timeline[2].startswith("rank 1: ..F0f0")
