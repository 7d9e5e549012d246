"""A user's code that calls the model otherwise than once per training step, where a multi-process pipeline cannot run
it as DDP does: refused before any work, in one line.

Under :class:`~lightning_accel.strategies.gpipe_distributed.DistributedGPipeStrategy` each rank holds only its stages,
and the model's call inside a step runs the pipeline (:mod:`lightning_accel.pipeline.whole_step`). What that honours:
several calls in one step (two loaders, a consistency loss), a call without gradients (a target, a teacher), a second
backward through the loss (``LightningModule.backward``), the model called from a hook or callback on every rank. What it
cannot: an optimizer that evaluates its closure itself (``torch.optim.LBFGS``: several forward and backward passes per
step, its line search and its curvature pairs over the whole parameter vector, of which each rank holds a share), and
gradients taken in an evaluation step (``torch.enable_grad()`` under ``Trainer(inference_mode=False)``: evaluation runs
the stages forward only). ``GPipeStrategy`` holds the whole model in one process and runs both.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer

from lightning_accel.strategies.user_hooks import calls_in

__all__ = ["evaluates_closure", "refuse_closure_optimizers", "refuse_gradients_in_evaluation"]

_GRADIENT_CALLS = ("enable_grad", "set_grad_enabled", "backward")  # also torch.autograd.grad: its attribute name
_EVALUATION_STEPS = ("validation_step", "test_step", "predict_step")


def evaluates_closure(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step`` needs the closure (no default for it): it runs forward and backward itself, as often
    as it likes (``LBFGS``), not once per step."""
    parameter = inspect.signature(type(optimizer).step).parameters.get("closure")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def refuse_closure_optimizers(owner: str, optimizers: Sequence[Optimizer]) -> None:
    for optimizer in optimizers:
        if evaluates_closure(optimizer):
            raise ValueError(
                f"{owner} cannot step {type(optimizer).__name__}: it evaluates the training step's closure itself, "
                "several times a step, and searches over the whole parameter vector, of which each pipeline rank holds "
                "a share; use a first-order optimizer (SGD, Adam, ...), or strategy='gpipe' in one process"
            )


def refuse_gradients_in_evaluation(owner: str, module: Any) -> None:
    """An evaluation step whose own code takes gradients (seen in its source; a call the source does not show is
    refused when the model is called with gradients enabled)."""
    for hook in _EVALUATION_STEPS:
        called = next((c for c in (*_GRADIENT_CALLS, "grad") if calls_in(module, hook, c)), None)
        if called is not None:
            raise ValueError(
                f"{owner} cannot take gradients in {hook} (it calls {called}): a pipeline runs evaluation forward only, "
                "each rank its own stages; take them in training_step, or use strategy='gpipe' in one process"
            )
