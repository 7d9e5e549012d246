"""A tiny model and datasets with known costs, handed to the callback tests as fixtures."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import Dataset


class SleepyIndices(Dataset):
    """Item ``i`` is ``(i, x)``; each item sleeps ``latency_s`` and records the time it took."""

    def __init__(self, n: int, latency_s: float = 0.0) -> None:
        self.n, self.latency_s = n, latency_s
        self.spent: list[float] = []  # filled in the main process only (num_workers=0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        t0 = time.perf_counter()
        if self.latency_s:
            time.sleep(self.latency_s)
        item = (torch.tensor(i), torch.full((4,), float(i)))
        self.spent.append(time.perf_counter() - t0)
        return item


class EndlessIndices(torch.utils.data.IterableDataset):
    """A stream without a length: item ``i`` is ``(i, x)`` as :class:`SleepyIndices` makes it, for ever (Lightning's
    fetcher reads a batch of such a loader ahead before the first hook)."""

    def __iter__(self):
        i = 0
        while True:
            yield torch.tensor(i), torch.full((4,), float(i))
            i += 1


class Recorder(pl.LightningModule):
    """Linear model; records the sample indices and batch objects it trained on; optional step sleep."""

    def __init__(self, step_s: float = 0.0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.step_s = step_s
        self.indices: list[int] = []
        self.batches: list = []

    def training_step(self, batch, batch_idx):
        idx, x = batch
        self.indices += idx.tolist()
        self.batches.append(batch)
        if self.step_s:
            time.sleep(self.step_s)
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(callbacks, **kwargs) -> pl.Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


@pytest.fixture
def sleepy() -> type[SleepyIndices]:
    return SleepyIndices


@pytest.fixture
def endless() -> type[EndlessIndices]:
    return EndlessIndices


@pytest.fixture
def recorder() -> type[Recorder]:
    return Recorder


@pytest.fixture
def make_trainer():
    return _trainer
