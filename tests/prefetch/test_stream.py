"""Streams handed over mid-epoch: every position delivered exactly once across worker-count changes."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_accel.prefetch import LoaderSettings, TunableLoader
from lightning_accel.prefetch.stream import PositionStream, handover_at, stream_state, why_not_resumable


class Positions(PositionStream):
    """Item at position ``p`` is ``p`` itself, after ``latency_s``: what was served says exactly what was read."""

    def __init__(self, length: int | None = None, chunk: int = 1, latency_s: float = 0.0) -> None:
        super().__init__(length, chunk)
        self.latency_s = latency_s

    def read(self, position: int) -> torch.Tensor:
        if self.latency_s:
            time.sleep(self.latency_s)
        return torch.tensor(position)


class Plain(IterableDataset):
    """A stream with no state: worker k of W yields k, k + W, ... below ``n``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        k, w = (0, 1) if info is None else (info.id, info.num_workers)
        yield from (torch.tensor(i) for i in range(k, self.n, w))


def flat(batch) -> list[int]:
    return [int(i) for i in batch.reshape(-1)]


def test_handover_waits_for_whole_rounds_and_whole_chunks():
    assert handover_at(5, first=0, workers=0, batch_size=4, chunk=1) == 5  # one stream: any boundary
    assert handover_at(5, first=0, workers=3, batch_size=4, chunk=1) == 6  # 2 rounds of 3 batches
    assert handover_at(6, first=0, workers=3, batch_size=4, chunk=1) == 6
    assert handover_at(7, first=2, workers=2, batch_size=4, chunk=1) == 8  # rounds count from the loader's start
    # chunk 8, batch 4: a worker has finished a chunk only every 2 of its batches (2 rounds).
    assert handover_at(3, first=0, workers=2, batch_size=4, chunk=8) == 4
    assert handover_at(5, first=0, workers=2, batch_size=4, chunk=8) == 8
    assert handover_at(1, first=0, workers=2, batch_size=4, chunk=2) == 2


@pytest.mark.parametrize(
    ("start", "switches", "chunk", "batch_size"),
    [
        (0, [3], 1, 4),  # the held-out case: defaults, then workers, mid-epoch
        (2, [3, 1], 1, 4),  # worker counts that do not divide each other, there and back
        (3, [0], 1, 3),  # workers back to none
        (2, [4], 4, 2),  # chunked sharding: hand-over on chunk boundaries
        (2, [2], 1, 4),  # same workers, other prefetch_factor
    ],
)
def test_every_position_exactly_once_across_switches(start, switches, chunk, batch_size):
    stream = Positions(length=120, chunk=chunk)
    user = DataLoader(stream, batch_size=batch_size, num_workers=start)
    loader = TunableLoader(user)
    served: list[int] = []
    plan = iter(switches)
    for k, batch in enumerate(loader):
        served += flat(batch)
        if k in (3, 11):  # switch twice (or once) while batches are in flight
            workers = next(plan, None)
            if workers is not None:
                loader.switch(LoaderSettings(workers, 4 if workers == start else (2 if workers else None)))
    assert len(served) == 120 and sorted(served) == list(range(120))  # nothing lost, nothing repeated
    assert loader.switches == len(switches) and loader.restarts == 0
    assert stream.position == 0  # the user's dataset was never iterated itself
    # The next epoch reads the whole stream again under the last settings.
    assert sorted(i for b in loader for i in flat(b)) == list(range(120))
    loader.close()


def test_endless_stream_switched_mid_epoch_reads_on_without_gaps():
    loader = TunableLoader(DataLoader(Positions(), batch_size=2))
    served: list[int] = []
    for k, batch in enumerate(itertools.islice(loader, 40)):
        served += flat(batch)
        if k == 2:
            loader.prepare(LoaderSettings(4, 2), lead=3)
        if k == 20:
            loader.prepare(LoaderSettings(3, 2), lead=1)
    assert loader.switches == 2 and loader.settings.num_workers == 3
    assert len(set(served)) == len(served) == 80
    # Stopped mid-round of 3 workers: all but the last round's positions form an unbroken prefix.
    assert sorted(served)[: 80 - 3 * 2] == list(range(80 - 3 * 2))
    loader.close()


def test_stream_without_position_waits_for_the_next_epoch_by_default():
    loader = TunableLoader(DataLoader(Plain(24), batch_size=4))
    assert not loader.switches_mid_epoch
    first = []
    for k, batch in enumerate(loader):
        first += flat(batch)
        if k == 1:
            loader.switch(LoaderSettings(2, 2))
    assert sorted(first) == list(range(24)) and loader.settings.num_workers == 0
    assert sorted(i for b in loader for i in flat(b)) == list(range(24)) and loader.settings.num_workers == 2
    loader.close()


def test_stream_without_position_restarts_now_when_asked():
    loader = TunableLoader(DataLoader(Plain(24), batch_size=4), stream_switch="restart")
    served = []
    for k, batch in enumerate(loader):
        served += flat(batch)
        if k == 1:
            loader.switch(LoaderSettings(2, 2))
    # Two batches from the old loader, then the whole stream again from the new one: 8 repeated.
    assert loader.settings.num_workers == 2 and loader.restarts == 1
    assert len(served) == 8 + 24 and sorted(set(served)) == list(range(24))
    loader.close()


def test_protocol_detection_and_reasons():
    assert stream_state(Positions()) == {"position": 0, "chunk": 1}
    assert stream_state(Plain(3)) is None
    assert why_not_resumable(Plain(3)) == "Plain cannot report its position (no state_dict/load_state_dict)"

    class OtherState(Plain):
        def state_dict(self):
            return {"shard_idx": 0}

        def load_state_dict(self, state):
            pass

    assert stream_state(OtherState(3)) is None
    assert "OtherState.state_dict() has no integer 'position'" in why_not_resumable(OtherState(3))


def test_bad_values_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"stream_switch='now' is not one of .*pass 'next_epoch'"):
        TunableLoader(DataLoader(Plain(4)), stream_switch="now")
    with pytest.raises(ValueError, match=r"chunk=0 must be a positive integer"):
        Positions(chunk=0)
    with pytest.raises(ValueError, match=r"length=-1 must be a count >= 0"):
        Positions(length=-1)


def test_plain_dataloader_over_a_position_stream_resumes_from_a_loaded_state():
    stream = Positions(length=10)
    it = iter(DataLoader(stream, batch_size=None))
    assert [int(next(it)) for _ in range(4)] == [0, 1, 2, 3] and stream.state_dict()["position"] == 4
    twin = Positions(length=10)
    twin.load_state_dict(stream.state_dict())
    assert [int(x) for x in DataLoader(twin, batch_size=None, num_workers=2)] == [4, 5, 6, 7, 8, 9]
