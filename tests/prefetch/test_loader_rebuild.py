"""Rebuilding loaders with new worker settings: same samples, same order, clear refusals."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Subset

from lightning_accel.data.synthetic import SyntheticStream
from lightning_accel.prefetch import LoaderSettings, RebuildError, TunableLoader, check_rebuildable, rebuild_loader
from lightning_accel.prefetch.probe import batch_nbytes, measure_loader


class Indices(Dataset):
    """Item ``i`` is ``i``: what a loader served says exactly which samples it served."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class Unpicklable(Indices):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.hook = lambda x: x  # lambdas cannot be pickled


class EvenBatches(BatchSampler):
    """A custom batch sampler: nothing tells us how to re-create it."""


def served(loader) -> list[int]:
    return [int(i) for batch in loader for i in batch.reshape(-1)]


def shuffled_loader(n: int = 40, **kwargs) -> DataLoader:
    return DataLoader(Indices(n), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7), **kwargs)


def test_rebuild_keeps_everything_but_the_settings():
    loader = shuffled_loader(drop_last=True)
    new = rebuild_loader(loader, LoaderSettings(2, 3, persistent_workers=True))
    assert (new.num_workers, new.prefetch_factor, new.persistent_workers) == (2, 3, True)
    assert new.batch_sampler is loader.batch_sampler and new.dataset is loader.dataset
    assert new.collate_fn is loader.collate_fn and new.generator is loader.generator
    # Same generator state, same shuffle: the rebuilt loader serves what the original would have.
    reference = served(shuffled_loader(drop_last=True))
    assert served(new) == reference


def test_switch_mid_epoch_loses_and_repeats_nothing():
    loader = TunableLoader(shuffled_loader())
    reference = served(TunableLoader(shuffled_loader()))  # the same epoch without a switch
    assert sorted(reference) == list(range(40))
    seen = []
    for k, batch in enumerate(loader):
        seen += [int(i) for i in batch]
        if k == 2:
            loader.switch(LoaderSettings(2, 2, persistent_workers=True))  # old loader had batches in flight
    assert loader.switches == 1 and loader.settings.num_workers == 2
    assert seen == reference  # same order: nothing lost, nothing repeated, nothing reordered
    # The next epoch draws a fresh order from the user's sampler, served by the new workers.
    second = served(loader)
    assert sorted(second) == list(range(40)) and second != seen
    loader.close()


def test_switch_with_batch_size_none_resumes_in_order():
    base = DataLoader(Indices(12), batch_size=None, sampler=RandomSampler(range(12), generator=torch.Generator().manual_seed(3)))
    reference = list(RandomSampler(range(12), generator=torch.Generator().manual_seed(3)))
    loader = TunableLoader(base)
    seen = []
    for k, x in enumerate(loader):
        seen.append(int(x))
        if k == 4:
            loader.switch(LoaderSettings(1))
    assert seen == reference
    loader.close()


def test_iterable_dataset_shards_across_workers_and_switches_at_epoch_end():
    stream = SyntheticStream(Subset(Indices(30), range(30)), chunk=3)
    loader = TunableLoader(DataLoader(stream, batch_size=3))
    first = []
    for k, batch in enumerate(loader):
        first += [int(i) for i in batch]
        if k == 1:
            loader.switch(LoaderSettings(3, 2))
    assert sorted(first) == list(range(30)) and loader.settings.num_workers == 0  # still the old loader this epoch
    second = served(loader)
    assert loader.settings.num_workers == 3
    assert sorted(second) == list(range(30))  # three workers, each sample exactly once
    loader.close()


def test_custom_batch_sampler_is_refused_in_one_line():
    loader = DataLoader(Indices(8), batch_sampler=EvenBatches(range(8), batch_size=2, drop_last=False))
    with pytest.raises(RebuildError, match=r"custom batch_sampler EvenBatches cannot be re-created; tune num_workers by hand"):
        TunableLoader(loader)


def test_dataset_that_cannot_be_pickled_for_spawned_workers_is_refused():
    loader = DataLoader(Unpicklable(8), batch_size=2, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(RebuildError, match=r"dataset Unpicklable cannot be pickled for 'spawn' workers .*keep num_workers=0"):
        check_rebuildable(loader)
    check_rebuildable(DataLoader(Unpicklable(8), batch_size=2), workers=False)  # fine without workers


def test_dataset_that_cannot_be_pickled_is_fine_with_fork(monkeypatch):
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda *a, **k: "fork")
    check_rebuildable(DataLoader(Unpicklable(8), batch_size=2))


def test_probe_measures_a_known_latency():
    class Slow(Indices):
        def __getitem__(self, i):
            import time

            time.sleep(0.02)
            return torch.zeros(10)

    probe = measure_loader(DataLoader(Slow(100), batch_size=1), LoaderSettings(0), min_batches=6)
    assert probe.batches == 6 and probe.batch_bytes == 40 == batch_nbytes(torch.zeros(1, 10))
    assert 0.015 < probe.interval_s < 0.2  # 20 ms of sleep per batch; generous for a shared machine


def test_wrapping_frees_the_users_persistent_workers():
    user = DataLoader(Indices(8), batch_size=2, num_workers=1, persistent_workers=True)
    iter(user)  # what Lightning does before on_train_start: workers are now alive
    worker = user._iterator._workers[0]
    loader = TunableLoader(user)
    assert user._iterator is None and not worker.is_alive()
    assert sorted(served(loader)) == list(range(8))  # served by the wrapper's own workers
    loader.close()


def test_probe_spans_whole_rounds_of_workers():
    from lightning_accel.prefetch.probe import probe_batches

    assert [probe_batches(LoaderSettings(w), 4) for w in (0, 1, 2, 4, 8)] == [4, 4, 5, 5, 9]


class SlowIndices(Indices):
    """Item ``i`` is ``i`` after 30 ms of (sleeping) I/O."""

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.03)
        return torch.tensor(i)


def slow_loader(n: int = 24) -> DataLoader:
    return DataLoader(SlowIndices(n), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(5))


def test_prepare_starts_workers_in_the_background_and_hands_over_at_the_boundary():
    reference = served(TunableLoader(slow_loader()))
    loader = TunableLoader(slow_loader())
    seen, asked_for_handover = [], None
    for k, batch in enumerate(loader):
        seen += [int(i) for i in batch]
        if k == 1:  # 2 batches handed out: the new workers serve from batch 2 + 4 = 6 on
            loader.prepare(LoaderSettings(2, 2), lead=4)
            assert loader.settings == LoaderSettings(0) and loader.preparing == LoaderSettings(2, 2)
        if k in (2, 3, 4):
            assert loader.settings == LoaderSettings(0)  # the old loader still serves its batches
        if k == 5:
            assert loader.settings == LoaderSettings(0)
            asked_for_handover = time.monotonic()  # the loop asks for batch 6 right after this
        if k == 6:
            assert loader.settings == LoaderSettings(2, 2) and loader.switches == 1
            # Its workers finished batch 6 while the old loader was still serving batches 2-5 in
            # line (240 ms); started at the hand-over instead, it would be ready 60 ms after it.
            assert loader.stamps[0] < asked_for_handover
    assert seen == reference  # nothing lost, repeated or reordered across the hand-over
    assert len(loader.stamps) == len(reference) // 2 - 6  # stamps count the new settings' batches only
    loader.close()


def test_prepare_that_the_epoch_does_not_reach_applies_at_the_next_epoch():
    loader = TunableLoader(slow_loader(12))  # 6 batches
    first = []
    for k, batch in enumerate(loader):
        first += [int(i) for i in batch]
        if k == 3:
            loader.prepare(LoaderSettings(2, 2), lead=5)  # batch 9 does not exist
    assert sorted(first) == list(range(12)) and loader.settings == LoaderSettings(0)
    # An epoch cut short (max_steps, limit_train_batches) before a hand-over that was under way.
    for k, _ in enumerate(loader):
        assert loader.settings == LoaderSettings(2, 2)
        if k == 1:
            loader.prepare(LoaderSettings(1, 2), lead=2)
            break
    assert sorted(served(loader)) == list(range(12)) and loader.settings == LoaderSettings(1, 2)
    assert loader.switches == 2
    loader.close()


def test_starting_settings_serve_from_the_first_batch():
    loader = TunableLoader(slow_loader(8), LoaderSettings(2, 2))
    assert sorted(served(loader)) == list(range(8)) and loader.switches == 0
    assert loader.settings == LoaderSettings(2, 2) and len(loader.stamps) == 4
    loader.close()
