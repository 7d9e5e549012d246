"""Logging what the L2L offload moved, once per optimizer step, and one summary line at the end of fit."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override


class OffloadMonitor(Callback):
    """Logs ``offload/*`` metrics (bytes per step, copy seconds, overlap, peaks; with
    ``offload_activations`` the boundary-activation bytes parked on the host, with
    ``delayed_update`` the count of host updates deferred one step) every
    ``log_every_n_steps`` optimizer steps, and says ``strategy.offload_stats.summary()``
    (rank zero, through Lightning's ``rank_zero_info``) when fit ends.

    As Lightning's ``LearningRateMonitor``: to ``trainer.loggers``, at the step Lightning logs
    ``self.log`` values of the same batch under, and once per optimizer step, not per
    micro-batch of a gradient accumulation.

    Does nothing (and says so once) under a strategy without ``offload_stats``.
    """

    def __init__(self, log_every_n_steps: int = 10) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps
        self._warned = False
        self._seen_step = 0  # trainer.global_step at the end of the previous batch

    def _stats(self, trainer: pl.Trainer) -> Any:
        stats = getattr(trainer.strategy, "offload_stats", None)
        if stats is None and not self._warned:
            self._warned = True
            rank_zero_warn(f"OffloadMonitor: {type(trainer.strategy).__name__} does not offload; nothing to report")
        return stats

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen_step = trainer.global_step  # a resumed fit counts on from its checkpoint

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        # optimizer steps taken: unchanged by an accumulating micro-batch; a row when they pass a multiple of n
        step, seen, self._seen_step = trainer.global_step, self._seen_step, trainer.global_step
        if step // self.log_every_n_steps == seen // self.log_every_n_steps:
            return
        stats = self._stats(trainer)
        if stats is None:
            return
        # Lightning's own step index for this batch's logs (the optimizer step just taken, counted from 0)
        logged_at = trainer.fit_loop.epoch_loop._batches_that_stepped
        for logger in trainer.loggers:
            logger.log_metrics(stats.as_metrics(), step=logged_at)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stats = self._stats(trainer)
        if stats is not None:
            rank_zero_info(stats.summary())
