"""Lightning features that touch every parameter or every rank's outputs, as cases a strategy runs and plain Lightning
runs in one process for the reference (float64, the same data order); :func:`run_on_two_ranks` runs them all as one
section of a 2-rank worker (``workers/semantics_worker.py``, one launch for both test files).

Each case is one ``Trainer.fit`` of :class:`Features` (a 3-block MLP: blocks ``net.0``, ``net.2``, ``net.4``, and a
BatchNorm in ``net.2`` for the SWA case) and, after it, what a user's script does with the trained module on every rank:
``model(x)``, ``trainer.validate``, ``test``, ``predict``, ``save_checkpoint``. :func:`run_case` returns what this rank
saw; :data:`CASES` says what each case turns on:

- ``finetune``: ``BaseFinetuning`` (``net.0`` frozen, unfrozen at epoch 1 with a new param group), a ``StepLR`` and
  ``LearningRateMonitor``, clipping by norm, ``self.log(sync_dist=True)``, Lightning 2's epoch-end outputs (the loss and
  per-sample predictions appended in ``training_step``, a dict in ``validation_step``), ``self.all_gather`` in
  validation, ``EarlyStopping`` on a value computed at epoch end from the last stage's outputs, the model summary,
  ``EMAWeightAveraging`` (validation and the end of fit on the averaged weights, which a checkpoint's ``state_dict``
  holds), what ``on_validation_batch_end`` is handed;
- ``swa``: ``StochasticWeightAveraging(swa_epoch_start=1)`` with a BatchNorm (its recomputed statistics epoch included);
- ``pruning``: ``ModelPruning``, which a pipeline strategy refuses before the first step;
- ``no_room``: a plain fit, for a strategy told the host cannot hold the whole module after it;
- ``stopped``: ``Timer(duration=0)``, which stops fit before training begins (no ``on_train_end``).
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    EarlyStopping,
    EMAWeightAveraging,
    LearningRateMonitor,
    ModelPruning,
    StochasticWeightAveraging,
    Timer,
)
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy

CASES = {  # case: (strategy chunks, batch norm, max_epochs)
    "finetune": (4, False, 4),
    "swa": (1, True, 2),  # one micro-batch: BatchNorm normalizes what plain training's does
    "pruning": (2, False, 1),
    "no_room": (2, False, 1),  # the strategy told the host has no room to gather the module after fit
    "stopped": (2, False, 1),  # a Timer with no time left: fit stops before training begins
}


class Features(pl.LightningModule):
    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        norm = [nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))] if batch_norm else [nn.Linear(8, 8)]
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), *norm, nn.Tanh(), nn.Linear(8, 3))
        self.train_outputs: list[torch.Tensor] = []
        self.train_predictions: list[torch.Tensor] = []
        self.val_outputs: list[dict[str, torch.Tensor]] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        loss = F.mse_loss(out, y)
        self.log("train_loss", loss, sync_dist=True)
        self.train_outputs.append(loss)  # Lightning 2's pattern: the step's outputs kept for epoch end
        self.train_predictions.append(out.detach())
        return loss

    def on_train_epoch_end(self):
        self.log("train_epoch_mean", torch.stack(self.train_outputs).mean())
        self.log("train_outputs", float(len(self.train_outputs)))
        self.log("train_predictions", torch.cat(self.train_predictions).sum())
        self.train_outputs.clear()
        self.train_predictions.clear()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_gathered", self.all_gather(loss).mean())
        self.val_outputs.append({"loss": loss, "count": torch.tensor(len(x))})
        return {"loss": loss}  # what on_validation_batch_end is handed, on every rank

    def on_validation_epoch_end(self):
        if self.val_outputs:
            losses = torch.stack([o["loss"] for o in self.val_outputs])
            counts = torch.stack([o["count"] for o in self.val_outputs])
            self.log("val_epoch_mean", losses.mean())
            self.log("val_samples", counts.sum().double())
        self.val_outputs.clear()

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


class Unfreeze(BaseFinetuning):
    """The first block frozen before training, unfrozen at epoch 1 as a new param group (lr: the first group's / 10)."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.net[0])

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net[0], optimizer)


class ListLogger(Logger):
    """What Lightning hands a logger (on rank 0), kept in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "list"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((step or 0, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def data(n: int, seed: int = 2) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g))


class BatchOutputs(pl.Callback):
    """What ``on_validation_batch_end`` is handed as the step's outputs."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.seen.append({k: v.detach().clone() for k, v in outputs.items()} if isinstance(outputs, dict) else outputs)


def _callbacks(case: str) -> list[pl.Callback]:
    if case == "finetune":
        early = EarlyStopping("val_epoch_mean", patience=1, mode="max", check_on_train_epoch_end=False)
        return [Unfreeze(), LearningRateMonitor(), early, EMAWeightAveraging(decay=0.5), BatchOutputs()]
    if case == "swa":
        return [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)]
    if case == "pruning":
        return [ModelPruning("l1_unstructured", amount=0.3)]
    if case == "stopped":
        return [Timer(duration=timedelta(0))]
    return []


def fit_case(case: str, strategy: Any, devices: int, out: str) -> tuple[pl.Trainer, Features, ListLogger]:
    """Fit ``case`` under ``strategy`` on ``devices`` CPU processes (float64, the same data order everywhere)."""
    chunks, batch_norm, epochs = CASES[case]
    model, logger = Features(batch_norm), ListLogger()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, precision="64-true", max_epochs=epochs, logger=logger,
        callbacks=_callbacks(case), gradient_clip_val=0.5 if case == "finetune" else None, enable_progress_bar=False,
        use_distributed_sampler=False, default_root_dir=os.path.join(out, f"{case}-{devices}"),
    )
    trainer.fit(model, DataLoader(data(16), batch_size=8), DataLoader(data(16, seed=3), batch_size=8))
    return trainer, model, logger


def probe() -> torch.Tensor:
    """Four samples the trained module is called on after fit."""
    return data(4, seed=4).tensors[0].double()


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_case(case: str, strategy: Any, devices: int, out: str) -> dict[str, Any]:
    """Fit ``case``, then use the trained module as a script would; returns what this rank saw (rank 0 also saves
    ``{case}-{devices}.ckpt`` in ``out``), or ``{"refused": message}`` where fit raised ValueError."""
    try:
        trainer, model, logger = fit_case(case, strategy, devices, out)
    except ValueError as err:
        return {"refused": str(err)}
    seen: dict[str, Any] = {
        "state": state_of(model),
        "probe": model(probe()).detach(),  # the module after fit, on this rank
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "epoch": trainer.current_epoch,
        "logged": logger.metrics,
        "batch_outputs": next((c.seen for c in trainer.callbacks if isinstance(c, BatchOutputs)), None),
    }
    trainer.save_checkpoint(os.path.join(out, f"{case}-{devices}.ckpt"))
    seen["validate"] = trainer.validate(model, DataLoader(data(16, seed=3), batch_size=8), verbose=False)
    seen["test"] = trainer.test(model, DataLoader(data(12, seed=5), batch_size=4), verbose=False)
    seen["predict"] = torch.cat(trainer.predict(model, DataLoader(data(12, seed=5), batch_size=4)))
    seen["after_eval"] = state_of(model)
    return seen


def _no_room(strategy: DistributedGPipeStrategy, out: str) -> dict[str, Any]:
    """A fit whose strategy is told the host has 1 byte free: what each rank holds and was told after it, then after
    ``trainer.strategy.gather_module()``."""
    with mock.patch("lightning_accel.strategies.gpipe_split_state.available_host_bytes", lambda: 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer, model, _ = fit_case("no_room", strategy, 2, out)
    said = [str(w.message) for w in caught if "gather_module" in str(w.message)]
    placeholders = sorted(n for n, t in model.state_dict().items() if t.is_meta)
    trainer.strategy.gather_module()
    return {"said": said, "placeholders": placeholders, "state": state_of(model), "probe": model(probe()).detach()}


def run_on_two_ranks(out: str) -> None:
    """Every case under ``DistributedGPipeStrategy`` on this rank of 2 (a worker script's section): the three layers with
    weights are the blocks, rank 0 holding the first; each rank saves what it saw as ``{case}-rank{r}.pt`` (rank 0 also
    ``{case}-2.ckpt``); ``no_room`` runs with the host's free memory said to be 1 byte."""
    for case, (chunks, _, _) in CASES.items():
        strategy = DistributedGPipeStrategy(
            chunks=chunks, balance=[1, 2], blocks=lambda net: [m for m in net if not isinstance(m, nn.Tanh)], timeout=60,
        )
        seen = _no_room(strategy, out) if case == "no_room" else run_case(case, strategy, 2, out)
        torch.save(seen, os.path.join(out, f"{case}-rank{int(os.environ.get('LOCAL_RANK', '0'))}.pt"))
