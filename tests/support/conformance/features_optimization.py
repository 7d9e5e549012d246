"""Conformance features: optimization as a LightningModule writes it. The gradients its hooks see (on_before_backward,
on_after_backward, on_before_optimizer_step, on_before_zero_grad), manual optimization (one optimizer with a scheduler,
accumulation by hand, two optimizers toggled), gradient clipping (the Trainer's, and configure_gradient_clipping),
accumulate_grad_batches, learning-rate schedulers (lr_scheduler_step, ReduceLROnPlateau) and overridden
optimizer_step / optimizer_zero_grad."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import grad_norm
from torch import Tensor

from tests.support.conformance.run import Run
from tests.support.conformance.task import Task, loader, val_loader


def _lr(task: Task) -> float:
    return float(task.optimizers().param_groups[0]["lr"]) if not isinstance(task.optimizers(), list) else float("nan")


def gradient_hooks(run: Run) -> None:
    """Each parameter's gradient in on_after_backward and on_before_optimizer_step, the loss on_before_backward gets,
    the whole model's norm, on_before_zero_grad's calls. A pipeline rank holds its stages' gradients only (it says so):
    those must equal, and its strategy's ``grad_norm`` must give the whole model's."""

    class Watched(Task):
        def __init__(self) -> None:
            super().__init__()
            self.losses: list[Tensor] = []
            self.after: list[dict[str, Tensor]] = []
            self.before: list[dict[str, Tensor]] = []
            self.norms: list[float] = []
            self.zeroed = 0

        def _grads(self) -> dict[str, Tensor]:
            return {n: p.grad for n, p in self.named_parameters() if p.grad is not None and not p.grad.is_meta}

        def on_before_backward(self, loss: Tensor) -> None:
            self.losses.append(loss.detach().clone())

        def on_after_backward(self) -> None:
            self.after.append({n: g.clone() for n, g in self._grads().items()})

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.before.append({n: g.clone() for n, g in self._grads().items()})
            strategy = self.trainer.strategy
            norm = strategy.grad_norm(2) if hasattr(strategy, "grad_norm") else grad_norm(self, 2)["grad_2.0_norm_total"]
            self.norms.append(float(norm))

        def on_before_zero_grad(self, optimizer: Any) -> None:
            self.zeroed += 1

    task = Watched()
    run.fit(task, loader(), val_loader(), max_epochs=1, accumulate_grad_batches=2)
    run.see("losses", task.losses)
    run.see("held:after_backward", task.after)
    run.see("held:before_optimizer_step", task.before)
    run.see("norms", task.norms)
    run.see("zeroed", task.zeroed)


def manual_optimization(run: Run) -> None:
    """automatic_optimization=False: zero_grad, manual_backward, step once per batch; the scheduler stepped by hand."""

    class Manual(Task):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.lrs: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            loss = self.loss(batch)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.lrs.append(float(opt.param_groups[0]["lr"]))
            self.log("train_loss", loss)

        def on_train_epoch_end(self) -> None:
            self.lr_schedulers().step()

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    task = Manual()
    run.fit(task, loader(), val_loader())
    run.see("lrs", task.lrs)


def manual_accumulation(run: Run) -> None:
    """Manual optimization that steps every second batch, gradients accumulated in between."""

    class Accumulating(Task):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            loss = self.loss(batch)
            self.manual_backward(loss / 2)
            if (batch_idx + 1) % 2 == 0:
                opt.step()
                opt.zero_grad()
            self.log("train_loss", loss)

    run.fit(Accumulating(), loader(), val_loader())


def toggle_optimizer(run: Run) -> None:
    """Two optimizers (body, head) stepped in turn, each inside toggle_optimizer / toggled_optimizer (a GAN's loop)."""

    class Toggled(Task):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.trainable_inside: list[list[int]] = []

        def training_step(self, batch: Any, batch_idx: int) -> None:
            body, head = self.optimizers()
            self.toggle_optimizer(body)
            first = sum(p.requires_grad for p in self.parameters())
            loss = self.loss(batch)
            self.manual_backward(loss)
            body.step()
            body.zero_grad()
            self.untoggle_optimizer(body)
            with self.toggled_optimizer(head):
                second = sum(p.requires_grad for p in self.parameters())
                loss2 = 2 * self.loss(batch)
                self.manual_backward(loss2)
                head.step()
                head.zero_grad()
            self.trainable_inside.append([first, second, sum(p.requires_grad for p in self.parameters())])
            self.log_dict({"loss_body": loss, "loss_head": loss2})

        def configure_optimizers(self) -> Any:
            body = [*self.net.inp.parameters(), *self.net.blocks.parameters()]
            return [torch.optim.SGD(body, lr=self.lr, momentum=0.9), torch.optim.SGD(self.net.head.parameters(), lr=2 * self.lr)]

    task = Toggled()
    run.fit(task, loader(), val_loader())
    run.see("trainable_inside", task.trainable_inside)


def gradient_clip_norm(run: Run) -> None:
    run.fit(Task(), loader(), val_loader(), gradient_clip_val=0.05, gradient_clip_algorithm="norm")


def gradient_clip_value(run: Run) -> None:
    run.fit(Task(), loader(), val_loader(), gradient_clip_val=0.01, gradient_clip_algorithm="value")


def configure_gradient_clipping(run: Run) -> None:
    """An overridden configure_gradient_clipping clipping by norm on every second step (the Trainer sets none: Lightning
    refuses a value in both places)."""

    class Clipping(Task):
        def __init__(self) -> None:
            super().__init__()
            self.clip_calls: list[list[Any]] = []

        def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None) -> None:
            self.clip_calls.append([gradient_clip_val, gradient_clip_algorithm, self.global_step])
            if self.global_step % 2 == 0:
                self.clip_gradients(optimizer, gradient_clip_val=0.02, gradient_clip_algorithm="norm")

    task = Clipping()
    run.fit(task, loader(), val_loader())
    run.see("clip_calls", task.clip_calls)


def accumulate_grad_batches(run: Run) -> None:
    run.fit(Task(), loader(), val_loader(), accumulate_grad_batches=2)


def lr_scheduler_step(run: Run) -> None:
    """A step-interval scheduler stepped through an overridden lr_scheduler_step; the learning rate at each batch."""

    class Scheduled(Task):
        def __init__(self) -> None:
            super().__init__()
            self.scheduled: list[list[Any]] = []
            self.lrs: list[float] = []

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), "interval": "step"}}

        def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
            self.scheduled.append([self.global_step, metric])
            scheduler.step()

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.lrs.append(_lr(self))

    task = Scheduled()
    run.fit(task, loader(), val_loader())
    run.see("scheduled", task.scheduled)
    run.see("lrs", task.lrs)


def reduce_lr_on_plateau(run: Run) -> None:
    """ReduceLROnPlateau monitoring val_loss once an epoch."""

    class Plateau(Task):
        def __init__(self) -> None:
            super().__init__()
            self.lrs: list[float] = []

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}

        def on_train_epoch_start(self) -> None:
            self.lrs.append(_lr(self))

    task = Plateau()
    run.fit(task, loader(), val_loader(), max_epochs=3)
    run.see("lrs", task.lrs)


def optimizer_step_override(run: Run) -> None:
    """Learning-rate warm-up in an overridden optimizer_step, as Lightning's docs write it."""

    class WarmUp(Task):
        def __init__(self) -> None:
            super().__init__()
            self.stepped: list[list[int]] = []

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            for group in optimizer.param_groups:
                group["lr"] = self.lr * min(1.0, (self.trainer.global_step + 1) / 4)
            optimizer.step(closure=optimizer_closure)
            self.stepped.append([epoch, batch_idx])

    task = WarmUp()
    run.fit(task, loader(), val_loader())
    run.see("stepped", task.stepped)


def optimizer_zero_grad_override(run: Run) -> None:
    """zero_grad(set_to_none=False) from an overridden optimizer_zero_grad, with accumulation."""

    class Zeroing(Task):
        def __init__(self) -> None:
            super().__init__()
            self.zeroed: list[list[int]] = []

        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            self.zeroed.append([epoch, batch_idx])
            optimizer.zero_grad(set_to_none=False)

    task = Zeroing()
    run.fit(task, loader(), val_loader(), accumulate_grad_batches=2)
    run.see("zeroed", task.zeroed)


FEATURES = {f.__name__: f for f in (
    gradient_hooks, manual_optimization, manual_accumulation, toggle_optimizer, gradient_clip_norm, gradient_clip_value,
    configure_gradient_clipping, accumulate_grad_batches, lr_scheduler_step, reduce_lr_on_plateau, optimizer_step_override,
    optimizer_zero_grad_override,
)}
