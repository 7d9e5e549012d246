"""Resumable loaders: a shuffled order that is a function of the seed, and a position that survives a checkpoint.

Every data module here builds its loaders through :func:`seeded_loader`, which returns
torchdata's ``StatefulDataLoader``. Lightning saves a stateful loader's ``state_dict`` in
each checkpoint and loads it on resume, so a run killed mid-epoch continues with the next
batch of the same permutation instead of replaying the epoch's first batches.
:class:`LoaderDataModule` is the base that turns a module's ``train_set`` / ``val_set`` /
``test_set`` into such loaders.

Under a distributed strategy the loader shards itself (:func:`distributed_shard`) with
torchdata's ``StatefulDistributedSampler``. Left to Lightning (``use_distributed_sampler``),
the loader's sampler, torchdata's ``RandomSampler``, is not a ``torch.utils.data.RandomSampler``,
so Lightning wraps it in a ``DistributedSamplerWrapper``: that draws a fresh permutation from
the loader's generator at every ``iter()``, and restoring a loader's state calls ``iter()``
three times (torchdata fast-forwards a sampler it cannot restore), so a resumed DDP run
trained on a different permutation than the run it replaces.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from typing_extensions import override

__all__ = ["EpochStatefulDistributedSampler", "LoaderDataModule", "check_num_workers", "distributed_shard", "seeded_loader"]


class EpochStatefulDistributedSampler(StatefulDistributedSampler):
    """torchdata's ``StatefulDistributedSampler`` whose state also holds its epoch.

    On resume Lightning loads the loader's state and calls ``iter()`` (``FitLoop.setup_data``)
    before it calls ``set_epoch`` (``FitLoop.on_advance_start``). A loader with workers
    draws its first indices inside that ``iter()``, so without the epoch in the state a run
    resumed mid-way through epoch 1 would continue in epoch 0's permutation.
    """

    _EPOCH = "epoch"

    @override
    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {self._EPOCH: self.epoch}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.set_epoch(int(state_dict.get(self._EPOCH, self.epoch)))


def distributed_shard(trainer: L.Trainer | None) -> dict[str, int] | None:
    """``{"num_replicas": ..., "rank": ...}`` where Lightning would put a ``DistributedSampler``
    into this trainer's loaders (a distributed strategy with ``use_distributed_sampler``), else None.

    The strategy's own ``distributed_sampler_kwargs`` decide the shard (a pipeline's stages
    share one), exactly as in Lightning's sampler replacement, whose condition this repeats.
    """
    if trainer is None:
        return None
    connector = trainer._accelerator_connector
    if not (connector.use_distributed_sampler and connector.is_distributed):
        return None
    kwargs = trainer.distributed_sampler_kwargs
    return None if kwargs is None else {"num_replicas": int(kwargs["num_replicas"]), "rank": int(kwargs["rank"])}


def _process_limit() -> tuple[int, str] | None:
    """How many processes this user may start, and what says so: ``ulimit -u`` where it is finite, else the kernel's
    ``pid_max``; None where neither can be read."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        if soft != resource.RLIM_INFINITY:
            return int(soft), "ulimit -u"
    except (ImportError, ValueError, OSError, AttributeError):
        pass
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text()), "the kernel's pid_max"
    except (OSError, ValueError):
        return None


def check_num_workers(num_workers: Any) -> None:
    """``num_workers``: an integer >= 0, and no more worker processes than this machine lets one user start (a
    DataLoader asked for more forks until the machine refuses, then hangs waiting for workers that never start).
    Every data module here asks it of its ``num_workers``."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers={num_workers!r} is not an integer >= 0; pass data.num_workers=<0 or more>")
    limit = _process_limit()
    if limit is not None and num_workers > limit[0]:
        cores = os.cpu_count() or 1
        raise ValueError(f"num_workers={num_workers} is more worker processes than this machine lets one user start "
                         f"({limit[0]}, {limit[1]}); pass data.num_workers=<0 to about {cores}, one per core>")


def seeded_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    shuffle: bool,
    seed: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    shard: dict[str, int] | None = None,
    **kwargs: Any,
) -> StatefulDataLoader:
    """A resumable loader whose order and worker seeds come from its own ``torch.Generator``.

    The generator is seeded with ``seed`` for every loader, shuffled or not: a DataLoader
    without one draws its workers' base seed from the *global* RNG each time an epoch
    starts, so a validation pass would shift the dropout masks of the training that
    follows, and a resumed run (which skips that pass) would diverge. Workers stay alive
    between epochs when there are any.

    ``shard`` (:func:`distributed_shard`'s answer) gives each replica its part of the
    dataset through an :class:`EpochStatefulDistributedSampler` seeded with ``seed``: its
    permutation is a function of the seed and the epoch alone, and its position and epoch
    are part of the loader's state, so a resume mid-epoch continues each rank's shard where
    it stopped (every rank yields as many samples, so rank 0's state, the one Lightning
    saves, serves all). Lightning leaves a loader that has a
    ``DistributedSampler`` as it is.
    """
    sampling: dict[str, Any] = {"shuffle": shuffle}
    if shard is not None:
        sampling = {"sampler": EpochStatefulDistributedSampler(dataset, shuffle=shuffle, seed=seed, **shard)}  # type: ignore[arg-type]
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        **sampling,
        generator=torch.Generator().manual_seed(seed),
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        **kwargs,
    )


class LoaderDataModule(L.LightningDataModule):
    """A data module whose ``setup`` fills ``train_set``, ``val_set`` and ``test_set``;
    this base serves them as :func:`seeded_loader` loaders.

    An empty validation split gives ``[]`` (Lightning then skips validation); an empty
    test split is refused with the option that sizes it (``test_option``).
    """

    test_option = "data.test_fraction=<a fraction such as 0.1>"

    def __init__(self, *, batch_size: int, seed: int, num_workers: int, pin_memory: bool) -> None:
        super().__init__()
        check_num_workers(num_workers)
        self.batch_size = batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> StatefulDataLoader:
        assert dataset is not None, "setup() fills the splits"
        return seeded_loader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            seed=self.seed,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            shard=distributed_shard(self.trainer),
        )

    def train_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        self.setup()
        return self._loader(self.val_set, shuffle=False) if len(self.val_set or ()) else []  # type: ignore[arg-type]

    def test_dataloader(self) -> DataLoader:
        self.setup()
        if not len(self.test_set or ()):  # type: ignore[arg-type]
            raise ValueError(f"the test split is empty; pass {self.test_option}")
        return self._loader(self.test_set, shuffle=False)
