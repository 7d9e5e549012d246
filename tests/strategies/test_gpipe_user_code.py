"""What a user's LightningModule sees under single-process ``gpipe``: ``training_step`` once per batch, with the whole
batch's loss, logs and torchmetrics values, manual optimization stepping once per batch, and an epoch's smaller last
batch trained, each equal to plain Lightning (float64).

Before, the strategy ran the user's ``training_step`` once per micro-batch: the logged step value and a torchmetrics step
value were the last micro-batch's (1.69 vs 1.55, 0.75 vs 0.5 in the issue), manual optimization stepped once per
micro-batch (``global_step`` 16 vs 8), and a last batch smaller than ``chunks`` stopped the run.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_accel import GPipeStrategy


class Classifier(pl.LightningModule):
    """4 blocks; logs the loss and a torchmetrics accuracy per step; records every training_step's batch size."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(16, 3)
        self.acc = MulticlassAccuracy(3, average="micro")
        self.automatic_optimization = not manual
        self.sizes: list[int] = []
        self.logged: list[tuple[float, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.sizes.append(len(x))
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.acc(logits, y)
        self.log("loss", loss, on_step=True)
        self.log("acc", self.acc, on_step=True)
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss if self.automatic_optimization else None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        metrics = self.trainer.callback_metrics
        if "loss" in metrics:
            self.logged.append((float(metrics["loss"]), float(metrics["acc"])))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _loader(n: int = 32, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    return DataLoader(TensorDataset(x, torch.randint(0, 3, (n,), generator=g)), batch_size=batch_size)


def _fit(module: pl.LightningModule, strategy: Any, loader: DataLoader, **kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", strategy=strategy, precision="64-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )
    trainer.fit(module, loader)
    return trainer


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_training_step_runs_once_per_batch_and_sees_plain_lightnings_values(manual: bool) -> None:
    plain, piped = Classifier(manual), Classifier(manual)
    trainer = _fit(plain, "auto", _loader(), max_epochs=2)
    piped_trainer = _fit(piped, GPipeStrategy(chunks=4, devices=2, checkpoint="always"), _loader(), max_epochs=2)
    assert piped.sizes == plain.sizes == [8] * 8  # once per batch, the whole batch
    assert piped_trainer.global_step == trainer.global_step == 8
    torch.testing.assert_close(piped.logged, plain.logged, rtol=1e-12, atol=0)
    for (name, a), b in zip(plain.state_dict().items(), piped.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)


def test_an_epochs_smaller_last_batch_trains_in_fewer_micro_batches() -> None:
    """18 samples in batches of 8, chunks=4: the last batch of 2 runs as 2 micro-batches, said once, as plain trains it."""
    plain, piped = Classifier(), Classifier()
    _fit(plain, "auto", _loader(18), max_epochs=2)
    with pytest.warns(UserWarning, match=r"GPipeStrategy\(chunks=4\): a batch of 2 samples runs as 2 micro-batches"):
        _fit(piped, GPipeStrategy(chunks=4, devices=2), _loader(18), max_epochs=2)
    assert piped.sizes == plain.sizes == [8, 8, 2] * 2
    for (name, a), b in zip(plain.state_dict().items(), piped.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)


def test_a_first_batch_smaller_than_chunks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"chunks=4 is greater than the batch size 2: .*set chunks <= 2"):
        _fit(Classifier(), GPipeStrategy(chunks=4, devices=2), _loader(8, batch_size=2), max_steps=1)


def test_a_training_step_that_never_calls_the_network_is_told() -> None:
    class Direct(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            h = self.embed(x)
            for layer in self.layers:
                h = layer(h)
            return nn.functional.cross_entropy(self.head(h), y)

    with pytest.warns(UserWarning, match=r"training_step did not call Direct.forward, so nothing was split into micro-batches"):
        _fit(Direct(), GPipeStrategy(chunks=2, devices=2), _loader(), max_steps=2)


def test_a_scalar_the_network_returns_is_averaged_and_said() -> None:
    class WithLoss(Classifier):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = super().forward(x)
            return logits, logits.pow(2).mean()  # an auxiliary loss the network computes itself

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            logits, aux = self(batch[0])
            return nn.functional.cross_entropy(logits, batch[1]) + aux

    plain, piped = WithLoss(), WithLoss()
    _fit(plain, "auto", _loader(), max_steps=2)
    with pytest.warns(UserWarning, match=r"returned a scalar .* per micro-batch; it is their size-weighted mean"):
        _fit(piped, GPipeStrategy(chunks=4, devices=2), _loader(), max_steps=2)
    for (name, a), b in zip(plain.state_dict().items(), piped.state_dict().values()):  # a mean of equal halves: exact
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)


def test_a_profiler_sees_each_micro_batchs_forward() -> None:
    """Trainer(profiler=...) or torch.profiler around fit attributes time to each micro-batch (torch's pipelining
    schedules label gpipe_distributed's "Forward i"/"Backward i" themselves)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _fit(Classifier(), GPipeStrategy(chunks=4, devices=2), _loader(), max_steps=1)
    names = {e.name for e in prof.events()}
    assert {f"gpipe/forward microbatch {i}" for i in range(4)} <= names
