"""Conformance features: Lightning 2.6's built-in callbacks. ModelCheckpoint, EarlyStopping, LearningRateMonitor,
ModelPruning, StochasticWeightAveraging, BaseFinetuning and BackboneFinetuning (gradual unfreezing), GradientAccumulation-
Scheduler, Timer, ModelSummary, LambdaCallback, and callbacks a module brings (configure_callbacks)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning, BaseFinetuning, EarlyStopping, GradientAccumulationScheduler, LambdaCallback, LearningRateMonitor,
    ModelCheckpoint, ModelPruning, ModelSummary, StochasticWeightAveraging, Timer,
)
from torch import Tensor, nn

from tests.support.conformance.run import Run
from tests.support.conformance.task import Task, loader, val_loader


def checkpoint_contents(path: str) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def model_checkpoint(run: Run) -> None:
    """Top-2 by val_loss plus last: which files, the best score, and every file's contents."""
    saver = ModelCheckpoint(dirpath=run.root / "ckpt", monitor="val_loss", save_top_k=2, save_last=True)
    run.fit(Task(), loader(), val_loader(), max_epochs=3, callbacks=[saver], enable_checkpointing=True)
    run.see("best", [saver.best_model_path, saver.best_model_score, sorted(saver.best_k_models)])
    if run.rank == 0:
        files = sorted((run.root / "ckpt").glob("*.ckpt"))
        run.see_r0("files", {f.name: checkpoint_contents(str(f)) for f in files})


def early_stopping(run: Run) -> None:
    """Stops when val_loss has not improved by min_delta for 1 epoch: the epoch it stops at, its counters."""
    stopper = EarlyStopping(monitor="val_loss", min_delta=0.5, patience=1)
    run.fit(Task(), loader(), val_loader(), max_epochs=6, callbacks=[stopper])
    run.see("stopper", [stopper.wait_count, stopper.stopped_epoch, stopper.best_score])


def lr_monitor(run: Run) -> None:
    """LearningRateMonitor at every step, momentum included, on a step scheduler."""

    class Scheduled(Task):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5), "interval": "step"}}

    run.fit(Scheduled(), loader(), val_loader(), callbacks=[LearningRateMonitor(logging_interval="step", log_momentum=True)])


def model_pruning(run: Run) -> None:
    """30% of every Linear weight pruned by L1 magnitude after epoch 1, trained a further epoch masked, made permanent."""
    pruning = ModelPruning("l1_unstructured", amount=0.3, apply_pruning=lambda epoch: epoch == 1, verbose=0)
    run.fit(Task(), loader(), val_loader(), max_epochs=3, callbacks=[pruning])


def stochastic_weight_averaging(run: Run) -> None:
    swa = StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=1)
    run.fit(Task(), loader(), val_loader(), max_epochs=4, callbacks=[swa])


class Unfreeze(BaseFinetuning):
    """The blocks frozen before training, unfrozen at epoch 1 with a param group of their own."""

    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module.net.blocks)

    def finetune_function(self, pl_module: Any, current_epoch: int, optimizer: Any) -> None:
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net.blocks, optimizer, lr=0.02)


def base_finetuning(run: Run) -> None:
    run.fit(Task(), loader(), val_loader(), max_epochs=3, callbacks=[Unfreeze()])


def backbone_finetuning(run: Run) -> None:
    """BackboneFinetuning on ``module.backbone`` (the blocks): unfrozen at epoch 1 at a tenth of the learning rate."""

    class WithBackbone(Task):
        @property
        def backbone(self) -> nn.Module:
            return self.net.blocks

    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5, backbone_initial_ratio_lr=0.1)
    run.fit(WithBackbone(), loader(), val_loader(), max_epochs=3, callbacks=[finetuning])


def gradient_accumulation_scheduler(run: Run) -> None:
    run.fit(Task(), loader(), val_loader(), max_epochs=3, callbacks=[GradientAccumulationScheduler(scheduling={1: 2, 2: 4})])


def timer(run: Run) -> None:
    """A Timer with no time left stops training after the first step; one without a limit measures every stage."""
    run.fit(Task(), loader(), val_loader(), callbacks=[Timer(duration=timedelta(0), interval="step")], prefix="stopped_")
    measuring = Timer()
    run.fit(Task(), loader(), val_loader(), callbacks=[measuring])
    run.see("measured", [measuring.time_elapsed("train") > 0, measuring.time_elapsed("validate") > 0, sorted(measuring.state_dict())])


class Summary(ModelSummary):
    """ModelSummary whose printed table is kept: what the user reads."""

    table: dict[str, Any] = {}

    @staticmethod
    def summarize(summary_data: Any, total_parameters: int, trainable_parameters: int, model_size: float,
                  total_training_modes: dict[str, int], total_flops: int = 0, **kwargs: Any) -> None:
        Summary.table = {"data": summary_data, "total": total_parameters, "trainable": trainable_parameters,
                         "size_mb": round(model_size, 6), "modes": total_training_modes}


def model_summary(run: Run) -> None:
    """ModelSummary to depth 2, the example input's sizes included."""

    class Example(Task):
        def __init__(self) -> None:
            super().__init__()
            self.example_input_array = torch.zeros(2, 4, dtype=torch.float64)

    Summary.table = {}
    run.fit(Example(), loader(), val_loader(), max_epochs=1, callbacks=[Summary(max_depth=2)], enable_model_summary=True)
    run.see_r0("summary", Summary.table)


def lambda_callback(run: Run) -> None:
    """A LambdaCallback sees each step's outputs and the module's state at batch and epoch ends."""
    seen: list[Any] = []

    def train_batch_end(trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        seen.append(["train", batch_idx, outputs["loss"] if isinstance(outputs, dict) else outputs])

    def validation_batch_end(trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        seen.append(["val", batch_idx, outputs, trainer.sanity_checking])

    def epoch_end(trainer: Any, module: Any) -> None:
        seen.append(["epoch", trainer.current_epoch, float(module.net.head.weight.sum())])

    callback = LambdaCallback(on_train_batch_end=train_batch_end, on_validation_batch_end=validation_batch_end,
                              on_train_epoch_end=epoch_end)

    class Returning(Task):
        def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = self.loss(batch)
            self.log("val_loss", loss)
            return loss

    run.fit(Returning(), loader(), val_loader(), callbacks=[callback])
    run.see("seen", seen)


def configure_callbacks(run: Run) -> None:
    """Callbacks the module brings: an EarlyStopping that replaces the Trainer's and a checkpoint saver added."""

    class Bringing(Task):
        def configure_callbacks(self) -> list[Any]:
            return [EarlyStopping(monitor="val_loss", min_delta=0.5, patience=1),
                    ModelCheckpoint(dirpath=run.root / "brought", monitor="val_loss")]

    trainer = run.fit(Bringing(), loader(), val_loader(), max_epochs=5, enable_checkpointing=True,
                      callbacks=[EarlyStopping(monitor="val_loss", patience=10)])
    run.see("callbacks", [type(c).__name__ for c in trainer.callbacks])
    run.see("stopped", [trainer.early_stopping_callback.stopped_epoch, trainer.checkpoint_callback.best_model_score])


FEATURES = {f.__name__: f for f in (
    model_checkpoint, early_stopping, lr_monitor, model_pruning, stochastic_weight_averaging, base_finetuning,
    backbone_finetuning, gradient_accumulation_scheduler, timer, model_summary, lambda_callback, configure_callbacks,
)}
