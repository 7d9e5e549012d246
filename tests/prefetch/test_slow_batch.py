"""Workers started while a slow batch loads in this process: they serve from the batch after it, losing nothing."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_accel.prefetch import LoaderSettings, TunableLoader
from lightning_accel.prefetch.slow_batch import SlowBatchWatch
from lightning_accel.prefetch.stream import PositionStream


class Indexed(Dataset):
    """Item ``i`` is ``i``; item 0 takes ``first_s``, the others ``latency_s``; records the loading process (the
    last one to load it) and whether the process that made the dataset loaded it."""

    def __init__(self, n: int, first_s: float, latency_s: float = 0.0) -> None:
        self.n, self.first_s, self.latency_s = n, first_s, latency_s
        self.pids = torch.zeros(n, dtype=torch.int64).share_memory_()
        self.home, self.loaded_home = os.getpid(), torch.zeros(n, dtype=torch.bool).share_memory_()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.first_s if i == 0 else self.latency_s)
        self.pids[i] = os.getpid()
        if os.getpid() == self.home:
            self.loaded_home[i] = True
        return torch.tensor(i)


class SlowStart(PositionStream):
    """Position ``p`` is ``p``; the first read takes ``first_s``."""

    def __init__(self, first_s: float) -> None:
        super().__init__(length=40)
        self.first_s = first_s

    def read(self, position: int) -> torch.Tensor:
        if position == 0:
            time.sleep(self.first_s)
        return torch.tensor(position)


def served(loader: TunableLoader) -> list[int]:
    return [int(i) for batch in loader for i in batch.reshape(-1)]


def test_the_watch_fires_only_on_a_slow_batch_and_measures_the_loading_threads_cpu():
    shares: list[float] = []
    watch = SlowBatchWatch(0.02, lambda share: shares.append(share) or "started")
    time.sleep(0.1)  # a batch waiting on I/O
    assert watch.stop() == "started" and watch.fired and shares[0] < 0.5
    busy = SlowBatchWatch(0.02, lambda share: shares.append(share) or "started")
    end = time.perf_counter() + 0.1
    while time.perf_counter() < end:  # a batch decoded in this thread
        pass
    assert busy.stop() == "started" and shares[1] > 0.5
    quick = SlowBatchWatch(1.0, lambda share: "started")
    assert quick.stop() is None and not quick.fired
    failing = SlowBatchWatch(0.0, lambda share: 1 / 0)
    time.sleep(0.05)
    assert failing.stop() is None  # a failed guess does not fail the batch
    assert not any(t.name == "prefetch-slow-batch" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("batch_size", [1, 3])
def test_map_style_speculation_serves_from_the_next_batch(batch_size):
    dataset = Indexed(30, first_s=0.3)
    loader = TunableLoader(DataLoader(dataset, batch_size=batch_size))
    asked: list[float] = []
    loader.speculate(0.02, lambda share: asked.append(share) or LoaderSettings(2, 2))
    out = served(loader)
    assert sorted(out) == list(range(30)) and len(out) == 30  # nothing lost, nothing repeated
    assert loader.speculated == LoaderSettings(2, 2) and loader.settings == LoaderSettings(2, 2) and loader.switches == 1
    here = [i for i in range(30) if dataset.pids[i] == os.getpid()]
    assert here == list(range(batch_size)), here  # only the slow first batch was loaded in this process
    assert len(asked) == 1 and asked[0] < 0.5  # it slept: I/O-bound
    loader.close()


def test_speculation_is_one_shot_and_waits_for_a_slow_batch():
    dataset = Indexed(12, first_s=0.0)
    loader = TunableLoader(DataLoader(dataset, batch_size=2))
    loader.speculate(0.2, lambda share: LoaderSettings(2, 2))
    assert sorted(served(loader)) == list(range(12))
    assert loader.speculated is None and loader.switches == 0
    dataset.first_s = 0.3  # the next epoch's first batch is slow, but the watch was for one batch only
    assert sorted(served(loader)) == list(range(12)) and loader.speculated is None
    loader.close()


def test_speculated_workers_dropped_before_their_hand_over_lose_nothing():
    dataset = Indexed(20, first_s=0.3)
    loader = TunableLoader(DataLoader(dataset, batch_size=2))
    loader.speculate(0.02, lambda share: LoaderSettings(2, 2))
    out: list[int] = []
    for k, batch in enumerate(loader):
        out += [int(i) for i in batch]
        if k == 0:
            assert loader.preparing == LoaderSettings(2, 2)
            loader.prepare(LoaderSettings(0), lead=0)  # e.g. the first step turned out compute-bound
    assert sorted(out) == list(range(20)) and len(out) == 20
    # Every item was loaded here (not: here last; a dropped worker still stopping on a loaded machine may
    # load one of the next items after this process did, a wasted load that serves nothing).
    assert loader.switches == 0 and bool(dataset.loaded_home.all())
    loader.close()


def test_a_position_stream_speculated_on_resumes_at_the_exact_position():
    stream = SlowStart(first_s=0.3)
    loader = TunableLoader(DataLoader(stream, batch_size=2))
    loader.speculate(0.02, lambda share: LoaderSettings(3, 2))
    out = served(loader)
    assert sorted(out) == list(range(40)) and len(out) == 40
    assert loader.speculated == LoaderSettings(3, 2) and loader.switches == 1
    assert stream.position == 0  # the user's dataset was never iterated itself
    loader.close()
