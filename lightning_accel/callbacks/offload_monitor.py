"""Logging what the L2L offload moved, and one summary line at the end of fit."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class OffloadMonitor(Callback):
    """Logs ``offload/*`` metrics (bytes per step, copy seconds, overlap, peaks; with
    ``offload_activations`` the boundary-activation bytes parked on the host, with
    ``delayed_update`` the count of host updates deferred one step) every
    ``log_every_n_steps`` and prints ``strategy.offload_stats.summary()`` when fit ends.

    Does nothing (and says so once) under a strategy without ``offload_stats``.
    """

    def __init__(self, log_every_n_steps: int = 10) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps
        self._warned = False

    def _stats(self, trainer: pl.Trainer) -> Any:
        stats = getattr(trainer.strategy, "offload_stats", None)
        if stats is None and not self._warned:
            self._warned = True
            print(f"OffloadMonitor: {type(trainer.strategy).__name__} does not offload; nothing to report")
        return stats

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        stats = self._stats(trainer)
        if stats is None or trainer.global_step % self.log_every_n_steps:
            return
        for logger in trainer.loggers:
            logger.log_metrics(stats.as_metrics(), step=trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stats = self._stats(trainer)
        if stats is not None and trainer.is_global_zero:
            print(stats.summary())
