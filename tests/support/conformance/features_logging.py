"""Conformance features: ``self.log`` / ``log_dict`` and their options, torchmetrics, ``all_gather``, step outputs
collected at epoch end, the sanity check, several dataloaders, and the logging cadence, as Lightning 2.6 documents them
(LightningModule.log: on_step, on_epoch, prog_bar, logger, reduce_fx, sync_dist, batch_size, add_dataloader_idx)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tests.support.conformance.run import Run
from tests.support.conformance.task import Task, loader, val_loader


def log_on_step_on_epoch(run: Run) -> None:
    """on_step / on_epoch / prog_bar / logger=False in training and validation."""

    class Logged(Task):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("a", loss, on_step=True, on_epoch=True, prog_bar=True)
            self.log("b", 2 * loss, on_step=False, on_epoch=True, prog_bar=True, logger=False)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            loss = self.loss(batch)
            self.log("va", loss, on_step=True, on_epoch=True, prog_bar=True)

    run.fit(Logged(), loader(), val_loader())


def log_reduce_fx(run: Run) -> None:
    """Epoch values reduced by max, min, sum and a callable."""

    class Reduced(Task):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            for fx in ("max", "min", "sum", "mean"):
                self.log(f"loss_{fx}", loss, on_step=False, on_epoch=True, reduce_fx=fx)
            self.log("loss_callable_max", loss, on_step=False, on_epoch=True, reduce_fx=torch.max)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_max", self.loss(batch), reduce_fx="max")

    run.fit(Reduced(), loader(), val_loader())


def log_batch_size(run: Run) -> None:
    """Epoch means weighted by the batch size given (and the one Lightning infers), on a ragged last batch."""

    class Weighted(Task):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("weighted", loss, on_step=False, on_epoch=True, batch_size=len(batch[0]))
            self.log("unweighted", loss, on_step=False, on_epoch=True, batch_size=1)
            self.log("inferred", loss, on_step=False, on_epoch=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_weighted", self.loss(batch), batch_size=len(batch[0]))

    run.fit(Weighted(), loader(14), loader(6, seed=2))  # batches of 4, 4, 4, 2 (DDP: 4, 3 a rank)


def log_sync_dist(run: Run) -> None:
    """``sync_dist=True`` (mean and max) in training and validation."""

    class Synced(Task):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("synced", loss, on_step=True, on_epoch=True, sync_dist=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            loss = self.loss(batch)
            self.log("val_synced", loss, sync_dist=True)
            self.log("val_synced_max", loss, sync_dist=True, reduce_fx="max")

    run.fit(Synced(), loader(), val_loader())


def log_dict(run: Run) -> None:

    class Dict(Task):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log_dict({"d1": loss, "d2": loss.detach() ** 2}, on_step=True, on_epoch=True, prog_bar=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            loss = self.loss(batch)
            self.log_dict({"val_d1": loss, "val_d2": 3 * loss})

    run.fit(Dict(), loader(), val_loader())


def log_torchmetrics(run: Run) -> None:
    """A torchmetrics ``Metric`` called per step and logged as an object, and one updated and logged at epoch end."""
    import torchmetrics

    class Metrics(Task):
        def __init__(self) -> None:
            super().__init__()
            self.train_mse = torchmetrics.MeanSquaredError().set_dtype(torch.float64)
            self.val_mae = torchmetrics.MeanAbsoluteError().set_dtype(torch.float64)

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            pred = self(x)
            self.train_mse(pred, y)
            self.log("train_mse", self.train_mse, on_step=True, on_epoch=True)
            return torch.nn.functional.mse_loss(pred, y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.val_mae.update(self(x), y)
            self.log("val_mae", self.val_mae)

    run.fit(Metrics(), loader(), val_loader())


def log_every_n_steps(run: Run) -> None:
    run.fit(Task(), loader(), val_loader(), log_every_n_steps=3)


def multiple_val_dataloaders(run: Run) -> None:
    """Two validation loaders: ``dataloader_idx``, the automatic ``/dataloader_idx_N`` suffix and add_dataloader_idx=False."""

    class TwoLoaders(Task):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            loss = self.loss(batch)
            self.log("val_loss", loss)
            self.log(f"val_{dataloader_idx}", loss, add_dataloader_idx=False)

    task = TwoLoaders()
    trainer = run.fit(task, loader(), [val_loader(), val_loader(seed=3)])
    run.see("validate", trainer.validate(task, [val_loader(), val_loader(seed=3)], verbose=False))


def multiple_train_dataloaders(run: Run) -> None:
    """A dict of training loaders (Lightning's CombinedLoader, max_size_cycle): the step gets a dict of batches."""

    class Combined(Task):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = self.loss(batch["a"]) + 0.5 * self.loss(batch["b"])
            self.log("train_loss", loss)
            return loss

    run.fit(Combined(), {"a": loader(), "b": loader(8, seed=6)}, val_loader())


def all_gather_training(run: Run) -> None:
    """``self.all_gather`` of each sample's loss in ``training_step``: what a user counts and averages over every rank."""

    class Gathered(Task):
        def __init__(self) -> None:
            super().__init__()
            self.gathered: list[list[float]] = []

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            per_sample = ((self(x) - y) ** 2).mean(dim=1)
            everyone = self.all_gather(per_sample.detach())
            self.gathered.append([everyone.numel(), float(everyone.sum())])
            self.log("gathered_mean", everyone.mean())
            return per_sample.mean()

    task = Gathered()
    run.fit(task, loader(), val_loader())
    run.see("gathered", task.gathered)


def all_gather_validation(run: Run) -> None:
    """``self.all_gather`` in ``validation_step`` (sanity check included)."""

    class Gathered(Task):
        def __init__(self) -> None:
            super().__init__()
            self.gathered: list[list[float]] = []

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            everyone = self.all_gather(((self(x) - y) ** 2).mean(dim=1))
            self.gathered.append([everyone.numel(), float(everyone.sum())])
            self.calls += 1  # a counter, not a list: what this rank's own step ran
            self.rows += everyone.numel()
            self.log("val_gathered_mean", everyone.mean())

        def on_validation_epoch_end(self) -> None:
            self.epoch_rows.append(sum(int(g[0]) for g in self.gathered))  # every row gathered so far

    task = Gathered()
    task.calls, task.rows, task.epoch_rows = 0, 0, []
    run.fit(task, loader(), val_loader(), num_sanity_val_steps=1)
    run.see("gathered", task.gathered)
    run.see("calls", [task.calls, task.rows, task.epoch_rows])


def epoch_end_outputs(run: Run) -> None:
    """Lightning 2's pattern: steps append their outputs, ``on_*_epoch_end`` stacks them and logs, then clears."""

    class Collected(Task):
        def __init__(self) -> None:
            super().__init__()
            self.train_out: list[Tensor] = []
            self.val_out: list[Tensor] = []
            self.epoch_means: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            self.train_out.append(loss.detach())
            return loss

        def on_train_epoch_end(self) -> None:
            mean = torch.stack(self.train_out).mean()
            self.epoch_means.append(float(mean))
            self.log("train_epoch_mean", mean)
            self.train_out.clear()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.val_out.append(self.loss(batch))

        def on_validation_epoch_end(self) -> None:
            self.log("val_epoch_mean", torch.stack(self.val_out).mean())
            self.val_out.clear()

    task = Collected()
    run.fit(task, loader(), val_loader())
    run.see("epoch_means", task.epoch_means)


def sanity_check(run: Run) -> None:
    """Lightning's sanity check: ``trainer.sanity_checking`` in the steps it runs, its logs kept from the loggers."""

    class Sane(Task):
        def __init__(self) -> None:
            super().__init__()
            self.validated: list[list[Any]] = []

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            loss = self.loss(batch)
            self.validated.append([self.trainer.sanity_checking, batch_idx, float(loss)])
            self.steps["sanity" if self.trainer.sanity_checking else "validation"] += 1  # each rank's own runs
            self.log("val_loss", loss)

    task = Sane()
    task.steps = {"sanity": 0, "validation": 0}
    run.fit(task, loader(), loader(12, seed=2), num_sanity_val_steps=2)
    run.see("validated", task.validated)
    run.see("steps", task.steps)


def training_step_dict(run: Run) -> None:
    """``training_step`` returning a dict with keys beyond ``loss``: what ``on_train_batch_end`` is handed, and what
    the step's outputs kept for epoch end hold."""

    class Dicts(Task):
        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            x, y = batch
            out = self(x)
            loss = ((out - y) ** 2).mean()
            result = {"loss": loss, "close": ((out - y).abs() < 1).sum(), "n": len(x), "pred": out.detach()}
            self.kept.append(result)
            return result

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.ends.append({k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in outputs.items()})

        def on_train_epoch_end(self) -> None:
            self.log("close_in_epoch", float(sum(int(r["close"]) for r in self.kept)))
            self.kept.clear()

    task = Dicts()
    task.kept, task.ends = [], []
    run.fit(task, loader(), val_loader())
    run.see("batch_end_outputs", task.ends)


FEATURES = {f.__name__: f for f in (
    log_on_step_on_epoch, log_reduce_fx, log_batch_size, log_sync_dist, log_dict, log_torchmetrics, log_every_n_steps,
    multiple_val_dataloaders, multiple_train_dataloaders, all_gather_training, all_gather_validation, epoch_end_outputs,
    sanity_check, training_step_dict,
)}
