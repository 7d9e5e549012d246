"""seeded_loader under a distributed strategy: the shard it serves, and a mid-epoch state
that a fresh loader continues exactly (in the order Lightning's fit loop restores it)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_accel.data.loaders import EpochStatefulDistributedSampler, distributed_shard, seeded_loader

ITEMS = TensorDataset(torch.arange(40))


def _loader(rank: int, workers: int = 0) -> torch.utils.data.DataLoader:
    return seeded_loader(ITEMS, batch_size=4, shuffle=True, seed=3, num_workers=workers, shard={"num_replicas": 2, "rank": rank})


def _epoch(loader: torch.utils.data.DataLoader, epoch: int) -> list[list[int]]:
    loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
    return [batch.tolist() for (batch,) in loader]


def test_the_two_shards_split_each_epoch_and_the_order_changes_with_the_epoch() -> None:
    for epoch in (0, 1):
        shards = [sum(_epoch(_loader(rank), epoch), []) for rank in (0, 1)]
        assert sorted(shards[0] + shards[1]) == list(range(40))
    assert _epoch(_loader(0), 0) != _epoch(_loader(0), 1)
    assert _epoch(_loader(0), 1) == _epoch(_loader(0), 1)  # a function of seed and epoch alone


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("epoch", [0, 1])
def test_a_mid_epoch_state_continues_each_ranks_shard(epoch: int, workers: int) -> None:
    for rank in (0, 1):
        reference = _loader(rank, workers)
        if epoch:
            _epoch(reference, 0)
        reference.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        it = iter(reference)
        seen = [next(it)[0].tolist() for _ in range(2)]
        state = reference.state_dict()
        rest = [batch.tolist() for (batch,) in it]

        # Lightning's order on resume: load the state, iter() (FitLoop.setup_data), then set_epoch
        # (a loader with workers draws its first indices inside iter(): the epoch travels in the state)
        resumed = _loader(rank, workers)
        resumed.load_state_dict(state)
        it = iter(resumed)
        resumed.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        assert [batch.tolist() for (batch,) in it] == rest, (rank, seen)
        assert len(rest) == 3


def test_distributed_shard_follows_lightnings_sampler_replacement() -> None:
    assert distributed_shard(None) is None
    assert distributed_shard(pl.Trainer(accelerator="cpu", devices=1, logger=False)) is None
    ddp = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, logger=False)
    assert distributed_shard(ddp) == {"num_replicas": 2, "rank": 0}
    assert distributed_shard(pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, logger=False,
                                        use_distributed_sampler=False)) is None
    # a loader that shards itself is left as it is: no DistributedSamplerWrapper around its sampler
    loader = seeded_loader(ITEMS, batch_size=4, shuffle=True, seed=3, shard=distributed_shard(ddp))
    assert isinstance(loader.sampler, EpochStatefulDistributedSampler)
    assert not ddp._data_connector._requires_distributed_sampler(loader)
    # while the unsharded loader would be wrapped (the cause of the inexact DDP resume)
    assert ddp._data_connector._requires_distributed_sampler(seeded_loader(ITEMS, batch_size=4, shuffle=True, seed=3))
