"""The policy for workers started while the first batch loads: which, whether they stay, the start restated."""

from __future__ import annotations

from lightning_accel.cpu_budget import CpuBudget
from lightning_accel.prefetch import Budget, LoaderSettings, Trial
from lightning_accel.prefetch.first_batch import FirstBatchWorkers, restate_start
from lightning_accel.prefetch.wait_meter import WaitStats

START = LoaderSettings(0)
TWO_CORES = CpuBudget(2, "affinity", 1, "default")


def policy(max_workers: int = 8, memory: int = 10**9) -> FirstBatchWorkers:
    return FirstBatchWorkers(START, Budget(max_workers, memory), TWO_CORES)


def test_io_bound_loading_gets_the_worker_budget_and_cpu_bound_a_worker_per_core():
    assert policy().choose(cpu_share=0.05) == LoaderSettings(8, 2, persistent_workers=True)
    assert policy().choose(cpu_share=0.9) == LoaderSettings(2, 2, persistent_workers=True)
    assert policy(max_workers=1).choose(cpu_share=0.9).num_workers == 1  # never past the worker budget
    assert FirstBatchWorkers(START, Budget(8, 10**9), cuda=True).choose(0.9) == LoaderSettings(1, 2, True, True)


def test_they_stay_only_after_a_data_bound_first_step_within_the_budgets():
    eight, two = LoaderSettings(8, 2, persistent_workers=True), LoaderSettings(2, 2, persistent_workers=True)
    io_step = WaitStats(1, wait_s=0.54, step_s=0.1, wait_cpu_s=0.0)
    assert policy().keeps(eight, io_step, batch_bytes=48 << 20)
    assert not policy().keeps(eight, WaitStats(1, 0.08, 0.1), batch_bytes=1)  # waited less than it computed
    assert not policy(memory=500 << 20).keeps(eight, io_step, batch_bytes=48 << 20)  # 16 batches of 48 MiB
    cpu_step = WaitStats(1, wait_s=0.03, step_s=0.01, wait_cpu_s=0.027)  # decoding: 90% on a CPU
    assert policy().keeps(two, cpu_step, batch_bytes=1) and not policy().keeps(eight, cpu_step, batch_bytes=1)


def test_the_start_is_restated_from_the_workers_only_downwards_and_without_a_spread_of_its_own():
    start = Trial(START, interval_s=0.305, wait_s=0.305, spread_s=0.0, fastest_s=0.305)
    assert restate_start(start, item_s=0.003)  # a cold first item: the workers made batches in 3 ms
    assert (start.interval_s, start.wait_s, start.spread_s, start.fastest_s) == (0.003, 0.003, 0.0, None)
    warm = Trial(START, interval_s=0.54, wait_s=0.54)
    assert not restate_start(warm, item_s=0.72)  # workers sharing the cores took longer: the step stands
    assert warm.interval_s == 0.54
