"""The wait meter's arithmetic on a simulated clock."""

from __future__ import annotations

import pytest

from lightning_accel.prefetch import WaitMeter


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_waits_and_steps_from_a_simulated_loop():
    clock = Clock()
    meter = WaitMeter(clock=clock)
    meter.start()
    for wait, step in [(0.5, 0.1), (0.2, 0.1), (0.0, 0.3)]:
        clock.t += wait
        meter.batch_arrived()
        clock.t += step
        meter.step_ended()
    assert meter.waits == pytest.approx([0.5, 0.2, 0.0])
    assert meter.steps == pytest.approx([0.1, 0.1, 0.3])
    stats = meter.stats(skip=1)
    assert (stats.steps, stats.wait_s, stats.step_s) == (2, pytest.approx(0.1), pytest.approx(0.2))
    assert stats.wait_fraction == pytest.approx(1 / 3)
    assert meter.stats(last=1).wait_s == 0.0


def test_empty_meter_reports_zero_steps():
    stats = WaitMeter().stats()
    assert stats.steps == 0 and stats.throughput == 0.0 and stats.wait_fraction == 0.0


def test_cpu_share_of_the_waits_from_a_simulated_cpu_clock():
    clock, cpu = Clock(), Clock()
    meter = WaitMeter(clock=clock, cpu_clock=cpu)
    meter.start()
    for wait, busy in [(0.5, 0.05), (0.5, 0.15)]:  # waits of 0.5 s, 10% and 30% of them on the CPU
        clock.t += wait
        cpu.t += busy
        meter.batch_arrived()
        clock.t += 0.1
        cpu.t += 0.1  # the step's own CPU time is not the wait's
        meter.step_ended()
    assert meter.wait_cpus == pytest.approx([0.05, 0.15])
    stats = meter.stats()
    assert stats.wait_cpu_s == pytest.approx(0.1) and stats.wait_cpu_share == pytest.approx(0.2)


def test_time_queued_for_a_cpu_is_left_out_of_the_cpu_share():
    # 0.5 s waits, 0.1 s on a CPU, 0.3 s queued for one (a busy machine): the loading computed
    # for 0.1 of the 0.2 s it was not queued, a share of 0.5 (CPU over wall time would say 0.2).
    t = iter([0.0, 0.5, 0.6, 1.1, 1.2])
    c = iter([0.0, 0.1, 0.1, 0.2, 0.2])
    q = iter([0.0, 0.3, 0.3, 0.6, 0.6])
    meter = WaitMeter(clock=lambda: next(t), cpu_clock=lambda: next(c), queue_clock=lambda: next(q))
    meter.start()
    for _ in range(2):
        meter.batch_arrived()
        meter.step_ended()
    stats = meter.stats()
    assert stats.wait_queued_s == pytest.approx(0.3) and stats.wait_cpu_share == pytest.approx(0.5)
