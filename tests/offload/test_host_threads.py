"""HostThreads: the host step's threads within the rank's CPU budget."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lightning_accel.cpu_budget import CpuBudget
from lightning_accel.offload.host_threads import HostThreads


@pytest.fixture
def two_threads() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def test_threads_are_lowered_to_the_budget_in_the_main_and_the_worker_threads(two_threads: None) -> None:
    # a worker that ran a kernel before the budget keeps its count: only the initializer reaches it
    early = ThreadPoolExecutor(1)
    assert early.submit(lambda: (torch.ones(4).sum(), torch.get_num_threads())[1]).result() == 2
    threads = HostThreads.plan(CpuBudget(1, "SLURM_CPUS_PER_TASK", 1, "default", {"SLURM_CPUS_PER_TASK": 1.0}))
    threads.apply()
    assert torch.get_num_threads() == 1
    assert early.submit(torch.get_num_threads).result() == 2
    worker = ThreadPoolExecutor(1, initializer=threads.init_worker)
    assert worker.submit(torch.get_num_threads).result() == 1
    assert threads.describe().startswith("host step and copies on 1 intra-op thread; budget 1 CPU core per rank (from SLURM_CPUS_PER_TASK")
    threads.restore()
    assert torch.get_num_threads() == 2
    early.shutdown()
    worker.shutdown()


def test_a_lower_count_the_user_set_is_kept(two_threads: None) -> None:
    threads = HostThreads.plan(CpuBudget(8, "affinity", 1, "default", {"affinity": 8.0}))
    threads.apply()
    assert torch.get_num_threads() == 2
    assert "(kept the 2 already set)" in threads.describe()
