"""Conformance features: what a run leaves behind and how it comes back. Loggers (CSVLogger's files, the
hyper-parameters a logger is handed), checkpoint hooks (on_save_checkpoint / on_load_checkpoint, a callback's own
state), a saved checkpoint's contents, load_from_checkpoint, resuming a fit, and the module after fit on every rank."""

from __future__ import annotations

import csv
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor

from tests.support.conformance.features_callbacks import checkpoint_contents
from tests.support.conformance.run import Run
from tests.support.conformance.task import Task, dataset, loader, val_loader


class Hyper(Task):
    """save_hyperparameters of the constructor's arguments: what loggers and checkpoints record."""

    def __init__(self, lr: float = 0.05, width: int = 8, note: str = "conformance") -> None:
        super().__init__(lr)
        self.save_hyperparameters()


def csv_logger(run: Run) -> None:
    """CSVLogger's metrics.csv rows and hparams.yaml, as written."""

    class Both(Hyper):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("epoch_loss", loss, on_step=False, on_epoch=True)
            return loss

    logger = CSVLogger(run.root, name="csv", version=0)
    run.fit(Both(), loader(), val_loader(), logger=logger, log_every_n_steps=1)
    if run.rank == 0:
        with open(run.root / "csv" / "version_0" / "metrics.csv") as f:
            rows = [{k: float(v) if v else None for k, v in row.items()} for row in csv.DictReader(f)]
        run.see_r0("metrics_csv", rows)
        run.see_r0("hparams_yaml", (run.root / "csv" / "version_0" / "hparams.yaml").read_text())


def hyperparameters(run: Run) -> None:
    """What log_hyperparams is handed (the recording logger), and hparams on the module."""
    task = Hyper(lr=0.04, width=8)
    run.fit(task, loader(), val_loader())
    run.see("hparams", dict(task.hparams))


class Stateful(Callback):
    """A callback with state of its own (state_dict / load_state_dict) and entries it adds to each checkpoint."""

    def __init__(self) -> None:
        self.batches = 0
        self.loaded: list[Any] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded.append(dict(state_dict))
        self.batches = state_dict["batches"]

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint["stateful_epoch"] = trainer.current_epoch


class Hooked(Task):
    """on_save_checkpoint adds an entry computed from the weights; on_load_checkpoint keeps what it found."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[Any] = []

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["head_sum"] = self.net.head.weight.detach().sum().clone()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded.append([checkpoint["head_sum"], checkpoint["epoch"], checkpoint["global_step"]])


def checkpoint_hooks(run: Run) -> None:
    """trainer.save_checkpoint after fit: its contents; then load_from_checkpoint and a second fit from it."""
    task = Hooked()
    stateful = Stateful()
    trainer = run.fit(task, loader(), val_loader(), callbacks=[stateful])
    path = run.root / "saved.ckpt"
    trainer.save_checkpoint(path)
    run.see_r0("contents", checkpoint_contents(str(path)) if run.rank == 0 else None)
    loaded = Hooked.load_from_checkpoint(path)
    run.see("loaded", [loaded.loaded, loaded.state_dict()])
    again, resumed_stateful = Hooked(), Stateful()
    run.fit(again, loader(), val_loader(), max_epochs=3, ckpt_path=str(path), callbacks=[resumed_stateful], prefix="resumed_")
    run.see("on_load", [again.loaded, resumed_stateful.loaded, resumed_stateful.batches])


def resume(run: Run) -> None:
    """Fit 1 epoch saving last.ckpt, then a new Trainer and module resume to 3 epochs: weights, logs and loop counters."""
    saver = ModelCheckpoint(dirpath=run.root / "ckpt", save_last=True)
    run.fit(Task(), loader(), val_loader(), max_epochs=1, callbacks=[saver], enable_checkpointing=True, prefix="first_")
    run.fit(Task(), loader(), val_loader(), max_epochs=3, ckpt_path=str(run.root / "ckpt" / "last.ckpt"),
            callbacks=[ModelCheckpoint(dirpath=run.root / "ckpt2", save_last=True)], enable_checkpointing=True)
    if run.rank == 0:
        run.see_r0("last", checkpoint_contents(str(run.root / "ckpt2" / "last.ckpt")))


def module_after_fit(run: Run) -> None:
    """After fit, on every rank, the module is the trained model: real tensors in its state_dict, a forward that runs,
    its device and mode, each parameter's requires_grad."""
    task = Task()
    run.fit(task, loader(), val_loader())
    run.see("state_dict", task.state_dict())
    with torch.no_grad():
        run.see("forward", task(dataset(4, seed=9).tensors[0]))
    run.see("module", [str(task.device), task.training, {n: p.requires_grad for n, p in task.named_parameters()}])


FEATURES = {f.__name__: f for f in (csv_logger, hyperparameters, checkpoint_hooks, resume, module_after_fit)}
