"""Conformance features: the loop around the user's code. The order of every hook through fit, validate, test and
predict; predict_step, test_step and validate after fit; a LightningDataModule with the batch-transfer hooks;
validation inside an epoch; configure_model; and the ways a fit ends early: detect_anomaly on a NaN gradient, the
user's exception reaching on_exception."""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from tests.support.conformance.run import Run
from tests.support.conformance.task import HookRecorder, Net, Task, loader, val_loader


class Ordered(Task):
    """Appends each step method's call to the trainer's hook recorder, so one list holds hooks and steps in order."""

    def _mark(self, name: str) -> None:
        next(c for c in self.trainer.callbacks if isinstance(c, HookRecorder)).calls.append(name)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self._mark("training_step")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._mark("validation_step")
        super().validation_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._mark("test_step")
        super().test_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        self._mark("predict_step")
        return super().predict_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        self._mark("configure_optimizers")
        return super().configure_optimizers()


def hook_order(run: Run) -> None:
    """Every callback hook and step method in the order Lightning calls them, for fit, validate, test and predict."""
    task = Ordered()
    trainer = run.trainer(max_epochs=1, num_sanity_val_steps=2)
    trainer.fit(task, loader(8), val_loader())
    trainer.validate(task, val_loader(), verbose=False)
    trainer.test(task, val_loader(), verbose=False)
    trainer.predict(task, val_loader())
    run.see("order", run.recorders[-1].calls)


def predict_step(run: Run) -> None:
    task = Task()
    trainer = run.fit(task, loader(), val_loader())
    run.see("predictions", trainer.predict(task, loader(8, seed=4)))


def test_step(run: Run) -> None:
    task = Task()
    trainer = run.fit(task, loader(), val_loader())
    run.see("tested", trainer.test(task, loader(8, seed=5), verbose=False))
    run.see("test_callback_metrics", dict(trainer.callback_metrics))


def validate_after_fit(run: Run) -> None:
    task = Task()
    trainer = run.fit(task, loader(), val_loader())
    run.see("validated", trainer.validate(task, loader(8, seed=5), verbose=False))


class Data(pl.LightningDataModule):
    """A data module with setup and both loaders; its batch-transfer hook doubles the inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{stage}")

    def train_dataloader(self) -> Any:
        return loader()

    def val_dataloader(self) -> Any:
        return val_loader()

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        return 2 * x, y


def datamodule(run: Run) -> None:
    """A LightningDataModule, and the module's own on_before_batch_transfer (scales the targets)."""

    class Transferring(Task):
        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            x, y = batch
            return x, 0.5 * y

    data = Data()
    run.fit(Transferring(), datamodule=data)
    run.see("datamodule_calls", data.calls)


def val_check_interval(run: Run) -> None:
    """Validation every second training batch, and only every second epoch."""
    run.fit(Task(), loader(), val_loader(), max_epochs=2, val_check_interval=2, check_val_every_n_epoch=1, prefix="inside_")
    run.fit(Task(), loader(), val_loader(), max_epochs=3, check_val_every_n_epoch=2)


def configure_model(run: Run) -> None:
    """The network built in configure_model (Lightning's hook for large models), seeded there."""

    class Deferred(Task):
        def __init__(self) -> None:
            pl.LightningModule.__init__(self)
            self.lr = 0.05
            self.net: Net | None = None

        def configure_model(self) -> None:
            if self.net is None:
                torch.manual_seed(0)
                self.net = Net().double()

    run.fit(Deferred(), loader(), val_loader())


def _failed(err: BaseException) -> list[str]:
    """The exception's type and first line; where a pipeline says it was raised (after the user's message, as
    gpipe_distributed adds ``(raised by pipeline stage S on rank R)``) is left out."""
    line = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return [type(err).__name__, re.sub(r" \(raised by pipeline stage \d+ on rank \d+\)$", "", line)]


def detect_anomaly(run: Run) -> None:
    """detect_anomaly=True and a NaN gradient in the third step: the error's type and first line, the step it stopped
    at, the weights left (the two good steps)."""

    class Nan(Task):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            if self.global_step == 2:
                loss = loss + 0 * torch.sqrt(loss.detach() * 0 - 1 + 0 * loss)
            return loss

    task = Nan()
    trainer = run.trainer(detect_anomaly=True)
    try:
        trainer.fit(task, loader(), val_loader())
        run.see("raised", None)
    except RuntimeError as err:
        run.see("raised", _failed(err))
    run.observe(trainer, task)


class MyError(Exception):
    """The user's own exception type."""


class Cleanup(Callback):
    """Keeps what on_exception was handed."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.seen.append(_failed(exception) + [trainer.global_step])


def on_exception(run: Run) -> None:
    """The user's training_step raises MyError at the third step: fit raises it with its own type and message, and
    callbacks get it in on_exception."""

    class Raising(Task):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            if self.global_step == 2:
                raise MyError(f"boom at step {self.global_step}")
            return super().training_step(batch, batch_idx)

    cleanup, task = Cleanup(), Raising()
    trainer = run.trainer(callbacks=[cleanup])
    try:
        trainer.fit(task, loader(), val_loader())
        run.see("raised", None)
    except MyError as err:
        run.see("raised", _failed(err))
    run.see("on_exception", cleanup.seen)
    run.observe(trainer, task)


FEATURES = {f.__name__: f for f in (
    hook_order, predict_step, test_step, validate_after_fit, datamodule, val_check_interval, configure_model,
    detect_anomaly, on_exception,
)}
