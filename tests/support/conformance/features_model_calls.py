"""Conformance features: the model called otherwise than once per training step. From every hook Lightning calls (a
callback computing predictions there), twice in one step (a consistency loss), without gradients inside the step (a
target or teacher), by a second backward through the loss (``LightningModule.backward``), by an optimizer that evaluates
the closure itself (``LBFGS``), and with gradients inside validation (``inference_mode=False``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from tests.support.conformance.run import Run
from tests.support.conformance.task import HOOKS, IN, Task, loader, val_loader

PROBE = torch.linspace(-1.0, 1.0, 2 * IN, dtype=torch.float64).reshape(2, IN)  # what the callback asks the model about


class CallsTheModel(Callback):
    """In every callback hook Lightning calls (the names :data:`HOOKS` enumerates from ``Callback``), the model's output
    on :data:`PROBE`, without gradients: what a callback plotting predictions does."""

    def __init__(self) -> None:
        self.seen: list[list[Any]] = []


def _calling(name: str) -> Any:
    def hook(self: CallsTheModel, trainer: Any, pl_module: Any = None, *args: Any, **kwargs: Any) -> None:
        if pl_module is None or not hasattr(pl_module, "net") or pl_module.net is None:
            return
        with torch.no_grad():
            out = pl_module(PROBE.to(pl_module.device))
        self.seen.append([name, float(out.sum())])

    hook.__name__ = name
    return hook


for _name in HOOKS:
    if _name.startswith("on_") and _name not in ("on_exception",):
        setattr(CallsTheModel, _name, _calling(_name))


def model_in_every_hook(run: Run) -> None:
    """A callback calls the model in every hook of fit (sanity check included), validate, test and predict."""
    task, calls = Task(), CallsTheModel()
    trainer = run.fit(task, loader(8), val_loader(), callbacks=[calls], max_epochs=1, num_sanity_val_steps=1)
    trainer.validate(task, val_loader(), verbose=False)
    trainer.test(task, val_loader(), verbose=False)
    trainer.predict(task, val_loader())
    run.see("calls", calls.seen)


def two_calls_in_a_step(run: Run) -> None:
    """A consistency loss: the model on the batch and on a perturbed copy, in one training step."""

    class Consistent(Task):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            out, perturbed = self(x), self(x + 0.1)
            loss = F.mse_loss(out, y) + 0.5 * F.mse_loss(out, perturbed)
            self.log("train_loss", loss)
            return loss

    run.fit(Consistent(), loader(), val_loader())


def call_without_gradients(run: Run) -> None:
    """A target the model computes itself without gradients (a teacher, a pseudo-label), in the training step."""

    class Distilled(Task):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            with torch.no_grad():
                target = self(x.flip(0))
            loss = F.mse_loss(self(x), 0.5 * (y + target.flip(0)))
            self.log("train_loss", loss)
            return loss

    run.fit(Distilled(), loader(), val_loader())


def backward_twice(run: Run) -> None:
    """``LightningModule.backward`` overridden: the loss backpropagated twice through one graph (retain_graph)."""

    class Twice(Task):
        def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
            loss.backward(retain_graph=True)
            (0.5 * loss).backward()

    run.fit(Twice(), loader(), val_loader())


def closure_optimizer(run: Run) -> None:
    """LBFGS, which evaluates the training step's closure several times per step."""

    class Lbfgs(Task):
        def configure_optimizers(self) -> Any:
            return torch.optim.LBFGS(self.trainable(), lr=0.1, max_iter=3)

    run.fit(Lbfgs(), loader(8), val_loader(), max_epochs=1)


def gradients_in_validation(run: Run) -> None:
    """``Trainer(inference_mode=False)`` and a validation_step that takes the input gradient (a saliency)."""

    class Saliency(Task):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            with torch.enable_grad():
                x = x.clone().requires_grad_()
                (grad,) = torch.autograd.grad(F.mse_loss(self(x), y), x)
            self.log("saliency", grad.abs().mean())

    run.fit(Saliency(), loader(8), val_loader(), max_epochs=1, inference_mode=False)


FEATURES = {f.__name__: f for f in (
    model_in_every_hook, two_calls_in_a_step, call_without_gradients, backward_twice, closure_optimizer,
    gradients_in_validation,
)}
