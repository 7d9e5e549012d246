"""One conformance feature under one strategy: the Trainers it builds and what it saw.

A feature is a function of a :class:`Run`. It builds its ``LightningModule`` and data, fits through :meth:`Run.fit`
(or builds Trainers with :meth:`Run.trainer`), and keeps what a user's code would see with :meth:`Run.see`: weights,
logged metrics, hook calls, checkpoint contents, return values. What it saw is plain data (tensors, numbers, strings,
lists, dicts) saved per rank; the test compares it with the reference strategy's (:mod:`.compare`). Keys
starting ``r0:`` are seen on global rank 0 only (loggers write there; after a pipeline's fit rank 0 holds the whole
model), the rest on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from tests.support.conformance.task import HookRecorder, RecordingLogger

HANG_S = 120.0  # a feature past this is a hang (each takes well under a second; the 2-core CI machine is shared)
IDLE_S = 3.0  # or no rank making progress for this long (see the worker's Watchdog): every rank waits on another


@dataclass(frozen=True)
class Strategy:
    """How a strategy under test is built, on how many processes, and the run it must equal."""

    devices: int
    make: Callable[[], Any]
    reference: str
    holds_share: bool = False  # each rank holds only its stages' parameters (and gradients), by design


def _ddp() -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    # unused parameters found: a GAN-style loop toggles half the model off, which Lightning's docs pair with this
    return DDPStrategy(find_unused_parameters=True, timeout=timedelta(seconds=HANG_S))


def _l2l() -> Any:
    from lightning_accel import L2LOffloadStrategy

    return L2LOffloadStrategy()


def _gpipe() -> Any:
    from lightning_accel import GPipeStrategy

    return GPipeStrategy(chunks=2, devices=2)


def _l2l_ddp() -> Any:
    from lightning_accel import L2LOffloadDDPStrategy

    return L2LOffloadDDPStrategy(timeout=timedelta(seconds=HANG_S))


def _gpipe_distributed() -> Any:
    from lightning_accel import DistributedGPipeStrategy

    return DistributedGPipeStrategy(chunks=2, timeout=HANG_S)


# The references are Lightning's own: plain (one device) for the one-process strategies, DDP on 2 ranks for
# l2l_offload_ddp, and DDP on one rank for gpipe_distributed: 2 stages of one pipeline are one data-parallel replica,
# and Lightning gives any DDP-family strategy its DistributedSampler (a training loader shuffled by seed 0), which
# plain Lightning on one device does not.
STRATEGIES: dict[str, Strategy] = {
    "plain": Strategy(1, lambda: "auto", "plain"),
    "ddp": Strategy(2, _ddp, "ddp"),
    "ddp1": Strategy(1, _ddp, "ddp1"),
    "l2l_offload": Strategy(1, _l2l, "plain"),
    "gpipe": Strategy(1, _gpipe, "plain"),  # one process, 2 CPU stages, 2 micro-batches
    "l2l_offload_ddp": Strategy(2, _l2l_ddp, "ddp", holds_share=True),  # host step partitioned: own blocks' gradients
    "gpipe_distributed": Strategy(2, _gpipe_distributed, "ddp1", holds_share=True),  # one pipeline of 2 stages
}
UNDER_TEST = ("l2l_offload", "gpipe", "l2l_offload_ddp", "gpipe_distributed")


class Run:
    """What one feature does and sees under ``strategy`` in this process (one rank)."""

    def __init__(self, strategy: str, root: Path) -> None:
        self.name, self.strategy, self.root = strategy, STRATEGIES[strategy], root
        self.seen: dict[str, Any] = {}
        self.recorders: list[HookRecorder] = []
        self.rank = 0

    def trainer(self, callbacks: list[Any] | None = None, **kwargs: Any) -> pl.Trainer:
        """A CPU Trainer with the strategy under test, 2 epochs, no sanity check (the sanity_check feature has one), a
        :class:`RecordingLogger` handed every step's metrics and a :class:`HookRecorder` (first among the callbacks);
        ``kwargs`` override."""
        recorder = HookRecorder()
        self.recorders.append(recorder)
        options: dict[str, Any] = dict(
            accelerator="cpu", devices=self.strategy.devices, strategy=self.strategy.make(), max_epochs=2,
            logger=RecordingLogger(), enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, log_every_n_steps=1, default_root_dir=str(self.root),
        )
        options.update(kwargs)
        trainer = pl.Trainer(callbacks=[recorder, *(callbacks or [])], **options)
        self.rank = trainer.global_rank
        return trainer

    def fit(self, task: pl.LightningModule, *loaders: Any, ckpt_path: str | None = None, callbacks: list[Any] | None = None,
            datamodule: Any = None, prefix: str = "", **kwargs: Any) -> pl.Trainer:
        """``trainer(...).fit`` on the loaders (train, then validation), then :meth:`observe` (under ``prefix``: a
        feature that fits twice keeps both)."""
        trainer = self.trainer(callbacks, **kwargs)
        trainer.fit(task, *loaders, datamodule=datamodule, ckpt_path=ckpt_path)
        self.observe(trainer, task, prefix)
        return trainer

    def observe(self, trainer: pl.Trainer, task: pl.LightningModule, prefix: str = "") -> None:
        """What every feature compares: weights (rank 0), hook counts, loop counters, callback and progress-bar metrics,
        and what the logger was handed (rank 0)."""
        self.see_r0(f"{prefix}weights", task.state_dict())
        self.see(f"{prefix}hooks", self.recorders[-1].counts())
        self.see(f"{prefix}loop", {"global_step": trainer.global_step, "epoch": trainer.current_epoch})
        self.see(f"{prefix}callback_metrics", dict(trainer.callback_metrics))
        self.see(f"{prefix}progress_bar_metrics", dict(trainer.progress_bar_metrics))
        if isinstance(trainer.logger, RecordingLogger):
            self.see_r0(f"{prefix}logged", trainer.logger.calls)

    def see(self, key: str, value: Any) -> None:
        self.seen[key] = plain(value, self.root)

    def see_r0(self, key: str, value: Any) -> None:
        if self.rank == 0:
            self.see(f"r0:{key}", value)

    def started(self) -> bool:
        """Whether any training batch began (a refusal must come before)."""
        return any("on_train_batch_start" in r.calls for r in self.recorders)


def plain(value: Any, root: Path | None = None) -> Any:
    """``value`` as saved data: tensors detached and copied to the CPU (meta tensors kept as such), containers as
    dicts and lists, numbers and strings as they are (this run's directory as ``<root>``), anything else by its repr."""
    if isinstance(value, Tensor):
        return value.detach().clone() if value.is_meta else value.detach().cpu().clone()
    if isinstance(value, dict):
        return {plain(str(k), root): plain(v, root) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, root) for v in value]
    if isinstance(value, str):
        return value.replace(str(root), "<root>") if root is not None else value
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return plain(repr(value), root)
