"""The XLA tests' reference: a small regression fitted the same way on the CPU and on an XLA device.

Shared by ``tests/accelerators`` (through its ``xla`` fixture) and ``workers/xla_devices_worker.py``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def register() -> None:
    """Make ``accelerator="xla_pjrt"``/``strategy="xla_pjrt"`` resolvable (idempotent)."""
    from lightning_accel._registry import register as register_strategy
    from lightning_accel.accelerators import register_accelerators
    from lightning_accel.strategies.xla_pjrt import XLAPJRTStrategy

    register_accelerators()
    register_strategy(StrategyRegistry, "xla_pjrt", XLAPJRTStrategy, "one torch_xla device, or SPMD data parallel over all")


class Regression(pl.LightningModule):
    """An MLP fitting sin(sum(x)); records each step's loss and where its batch came from."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        self.losses: list[torch.Tensor] = []
        self.batch_devices: list[str] = []  # device of each train batch before Lightning moves it
        self.step_devices: list[str] = []  # device the training step computed on

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer.training:
            self.batch_devices.append(batch[0].device.type)
        return batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.step_devices.append(x.device.type)
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())
        self.log("train/loss", loss)
        self.losses.append(loss.detach())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self.net(x).float(), y.float()))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=self.trainer.max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(n: int = 256, batch_size: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = 0.5 * x[:, :4].sum(1, keepdim=True)  # linear: Adam halves the loss within a few dozen steps
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, drop_last=True)


def fit(accelerator: str, max_steps: int, batch_size: int = 16, **trainer_kwargs: Any) -> tuple[Regression, pl.Trainer]:
    """Fit a freshly seeded :class:`Regression`; ``accelerator="xla_pjrt"`` also picks our strategy."""
    pl.seed_everything(0, verbose=False)
    model = Regression()
    if accelerator == "xla_pjrt":
        trainer_kwargs.setdefault("strategy", "xla_pjrt")
    trainer_kwargs.setdefault("val_check_interval", 10)
    trainer_kwargs.setdefault("devices", 1)
    trainer = pl.Trainer(
        accelerator=accelerator,
        max_steps=max_steps,
        limit_val_batches=4,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(model, loader(batch_size=batch_size), loader(64, batch_size))
    return model, trainer


def losses(model: Regression) -> torch.Tensor:
    return torch.stack([loss.float().cpu() for loss in model.losses])
