"""LightningModules that train any nn.Module on a task.

A task owns the loss, the metrics and the optimizer; the network is passed in. Keeping
them apart lets one Hydra recipe swap the zoo GPT for a user's own module, and lets the
accelerator strategies see a plain ``task.net``. Nothing here assumes the block
protocol of :mod:`lightning_accel.models.blocks`.

A ``LanguageModelTask`` may fine-tune: given an ``adapter`` (``model.adapter``,
:mod:`lightning_accel.models.adapters`), it applies it to the net in ``__init__``, so the
strategies see the peft model, and its checkpoints hold the trainable state and a record
of the frozen base instead of the base (:mod:`lightning_accel.models.finetune_checkpoint`).

``optimizer`` and ``scheduler`` are factories, as Hydra builds them from a config with
``_partial_: true``: ``optimizer(params) -> Optimizer`` and
``scheduler(optimizer) -> LRScheduler``. They are called in ``configure_optimizers``,
i.e. after the strategy has placed (and maybe wrapped) the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Protocol

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torch.nn import Parameter
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity
from typing_extensions import override

from lightning_accel.config.errors import UserError
from lightning_accel.models.finetune_checkpoint import FrozenBase, adapter_option

OptimizerFactory = Callable[[Iterable[Parameter]], Optimizer]
SchedulerFactory = Callable[[Optimizer], LRScheduler]

# F.cross_entropy's default; Perplexity is told the same so padded targets drop out of both
IGNORE_INDEX = -100


class Adapter(Protocol):
    """What ``model.adapter`` builds (:class:`~lightning_accel.models.adapters.LoRA`, ``QLoRA``)."""

    name: str

    def apply(self, net: nn.Module) -> nn.Module: ...

    def config(self) -> dict[str, Any]: ...


class _Task(L.LightningModule):
    """Shared plumbing: hold the net, build the optimizer and scheduler from factories."""

    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerFactory | None,
        scheduler: SchedulerFactory | None,
        scheduler_interval: str,
    ) -> None:
        super().__init__()
        if scheduler_interval not in ("step", "epoch"):
            raise ValueError(
                f"scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}; "
                "'step' calls scheduler.step() after every optimizer step, 'epoch' after every epoch"
            )
        self.net = net
        self.optimizer_factory: OptimizerFactory = optimizer or partial(torch.optim.AdamW, lr=3e-4)
        self.scheduler_factory = scheduler
        self.scheduler_interval = scheduler_interval

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def configure_optimizers(self) -> OptimizerLRScheduler:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler_interval}}


class LanguageModelTask(_Task):
    """Next-token prediction on batches ``(x, y)`` of token ids, both (B, T), y = x shifted by one.

    The net maps (B, T) -> logits (B, T, V): a tensor (the zoo GPT, litgpt's GPT) or an
    output with a ``logits`` field (transformers' ``CausalLMOutputWithPast``); the loss is
    computed here, not by the model, so every net is trained on the same objective.
    Logs ``train/loss`` every step and
    ``val/loss``, ``val/ppl``, ``test/loss``, ``test/ppl`` per epoch. Perplexity is
    exp(token-weighted mean cross-entropy) over the whole epoch, accumulated by
    torchmetrics so it stays exact across uneven last batches and across devices.

    With an ``adapter``, ``self.net`` is ``adapter.apply(net)`` (the peft model, its base
    frozen), and checkpoints leave the frozen base out and name it instead.
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        scheduler_interval: str = "step",
        adapter: Adapter | None = None,
    ) -> None:
        frozen_base = FrozenBase(net, adapter.config()) if adapter is not None else None  # read before peft wraps it
        super().__init__(adapter.apply(net) if adapter is not None else net, optimizer, scheduler, scheduler_interval)
        self.frozen_base = frozen_base
        # the net is checkpointed through state_dict; the factories are not YAML-serialisable
        # (and Hydra's own config already records them, the adapter's keys too), so only plain values go to hparams
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler", "adapter"])
        self.val_ppl = Perplexity(ignore_index=IGNORE_INDEX)
        self.test_ppl = Perplexity(ignore_index=IGNORE_INDEX)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = batch
        logits = _logits(self.net(x))  # (B, T, V)
        if logits.ndim != 3 or logits.shape[:2] != y.shape:
            raise ValueError(
                f"LanguageModelTask needs the net to return logits (B, T, vocab) matching targets (B, T)="
                f"{tuple(y.shape)}, got {tuple(logits.shape)}; for a classifier use ClassifierTask"
            )
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)  # mean over tokens
        return logits, loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        _, loss = self._loss(batch)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=batch[0].size(0))
        return loss

    def _eval_step(self, batch: tuple[Tensor, Tensor], stage: str, ppl: Perplexity) -> None:
        logits, loss = self._loss(batch)
        # softmax in float32 even under bf16/fp16 autocast: perplexity is exp of a small difference
        ppl.update(logits.float(), batch[1])
        self.log(f"{stage}/loss", loss, on_epoch=True, sync_dist=True, batch_size=batch[0].size(0))
        self.log(f"{stage}/ppl", ppl, on_epoch=True, prog_bar=stage == "val")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val", self.val_ppl)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test", self.test_ppl)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.frozen_base is not None:
            self.frozen_base.save(self, checkpoint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.frozen_base is not None:
            self.frozen_base.load(self, checkpoint)
        elif (option := adapter_option(checkpoint)) is not None:
            raise UserError(f"the checkpoint holds a fine-tune's adapters, not a whole model; resume with its adapter: {option}")

    @override
    def setup(self, stage: str) -> None:
        from lightning_accel.config.setup_checks import check_load_by_block

        check_load_by_block(self, self.trainer.strategy)  # before the strategy copies meta weights (torch's "Cannot copy out of meta tensor")
        if self.frozen_base is not None and stage == "fit":
            self.frozen_base.sha256(self)  # now, while every rank holds the whole base (before a pipeline splits it)

    @override
    def on_fit_end(self) -> None:
        if self.frozen_base is not None:
            self.frozen_base.forget()  # the next fit hashes its base again


def _logits(output: object) -> Tensor:
    """The logits tensor of a net's output: the tensor itself, or its ``logits`` field."""
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    raise TypeError(
        f"LanguageModelTask needs the net to return logits (B, T, vocab) or an output with a .logits tensor "
        f"(transformers' CausalLMOutputWithPast), got {type(output).__name__}; return the logits from forward"
    )


class ClassifierTask(_Task):
    """Classification on batches ``(x, y)``: the net maps x to logits (B, num_classes), y is (B,) class ids.

    Logs ``train/loss`` and ``train/acc`` every step and ``val/*``, ``test/*`` loss and
    accuracy per epoch. Accuracy is micro-averaged (fraction of samples right).
    """

    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        scheduler_interval: str = "step",
    ) -> None:
        super().__init__(net, optimizer, scheduler, scheduler_interval)
        if num_classes < 2:
            raise ValueError(f"ClassifierTask needs num_classes >= 2, got {num_classes}")
        self.num_classes = num_classes
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"])
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def _loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = batch
        logits = self.net(x)  # (B, num_classes)
        if logits.ndim != 2 or logits.shape != (y.size(0), self.num_classes):
            raise ValueError(
                f"ClassifierTask(num_classes={self.num_classes}) needs the net to return logits "
                f"({y.size(0)}, {self.num_classes}), got {tuple(logits.shape)}; "
                "make the net's last layer output num_classes values per sample"
            )
        return logits, F.cross_entropy(logits, y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        logits, loss = self._loss(batch)
        self.train_acc(logits, batch[1])  # forward: updates state and caches this batch's value
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=batch[0].size(0))
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=False, batch_size=batch[0].size(0))
        return loss

    def _eval_step(self, batch: tuple[Tensor, Tensor], stage: str, acc: MulticlassAccuracy) -> None:
        logits, loss = self._loss(batch)
        acc.update(logits, batch[1])
        self.log(f"{stage}/loss", loss, on_epoch=True, sync_dist=True, batch_size=batch[0].size(0))
        self.log(f"{stage}/acc", acc, on_epoch=True, prog_bar=stage == "val")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val", self.val_acc)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test", self.test_acc)

