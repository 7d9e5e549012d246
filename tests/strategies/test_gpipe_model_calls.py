"""The model called otherwise than once per training step, under ``gpipe`` and ``gpipe_distributed``: each way runs as
under plain Lightning (one process) or DDP, or is refused before any work in one line.

Members enumerated from torch and Lightning: every optimizer ``torch.optim`` exports, each counted calling its closure
in one step (one that calls it several times, as ``LBFGS``, searches the whole parameter vector, of which a pipeline rank
holds a share: refused by ``gpipe_distributed``, run by ``gpipe``); every evaluation step of ``LightningModule``
(``validation_step``, ``test_step``, ``predict_step``), each taking gradients (refused by ``gpipe_distributed``, whose
evaluation runs forward only; run by ``gpipe``); every callback hook Lightning calls, each calling the model (run on
every rank: the conformance feature ``model_in_every_hook``). The runs that show each way equal to Lightning's own, or
refused, on 2 processes against DDP: the conformance features of tests/support/conformance/features_model_calls.py
(``two_calls_in_a_step``, ``call_without_gradients``, ``backward_twice``, ``closure_optimizer``,
``gradients_in_validation``, ``model_in_every_hook``), in tests/strategies/conformance."""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_accel import DistributedGPipeStrategy
from lightning_accel.strategies.pipeline_checks import refuse_closure_optimizers, refuse_gradients_in_evaluation
from tests.support.conformance import FEATURES
from tests.support.conformance.task import HOOKS, Task

OPTIMIZERS = sorted((c for c in vars(torch.optim).values() if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer)
                     and c is not torch.optim.Optimizer), key=lambda c: c.__name__)
EVALUATION_STEPS = sorted(n for n in vars(pl.LightningModule)  # the steps Lightning's evaluation loops call
                          if n.endswith("_step") and n not in ("global_step", "training_step", "optimizer_step",
                                                               "lr_scheduler_step"))


def _optimizer(cls: type) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 3))  # a matrix: Muon orthogonalizes matrices
    return cls([w], lr=0.1) if "lr" in inspect.signature(cls).parameters else cls([w])


def _closure_calls(optimizer: torch.optim.Optimizer) -> int:
    """How often one ``step(closure)`` calls the closure, on a small least-squares problem."""
    (w,) = optimizer.param_groups[0]["params"]
    calls = 0

    def closure() -> torch.Tensor:
        nonlocal calls
        calls += 1
        optimizer.zero_grad()
        loss = ((w - 1) ** 2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return calls


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_an_optimizer_that_evaluates_the_closure_several_times_is_refused_by_the_multi_process_pipeline(cls) -> None:
    if cls is torch.optim.SparseAdam:
        pytest.skip("SparseAdam steps sparse gradients only (an nn.Embedding(sparse=True)'s); its closure is optional")
    optimizer = _optimizer(cls)
    if _closure_calls(_optimizer(cls)) > 1:
        with pytest.raises(ValueError, match=rf"^X cannot step {cls.__name__}: it evaluates the training step's closure "
                                             r"itself, several times a step, .*; use a first-order optimizer .*, or "
                                             r"strategy='gpipe' in one process$"):
            refuse_closure_optimizers("X", [optimizer])
    else:
        refuse_closure_optimizers("X", [optimizer])


class Grads(Task):
    """An evaluation step that takes the input gradient: each of the three is given it by the test."""


def _taking_gradients(hook: str) -> pl.LightningModule:
    def step(self: Task, batch: object, batch_idx: int) -> None:
        x, y = batch
        with torch.enable_grad():
            x = x.clone().requires_grad_()
            torch.autograd.grad(((self(x) - y) ** 2).mean(), x)

    return type(f"GradsIn{hook}", (Grads,), {hook: step})()


@pytest.mark.parametrize("hook", EVALUATION_STEPS)
def test_gradients_in_an_evaluation_step_are_refused_by_the_multi_process_pipeline_before_any_work(hook) -> None:
    with pytest.raises(ValueError, match=rf"^DistributedGPipeStrategy cannot take gradients in {hook} \(it calls "
                                         r"enable_grad\): a pipeline runs evaluation forward only, each rank its own "
                                         r"stages; take them in training_step, or use strategy='gpipe' in one process$"):
        refuse_gradients_in_evaluation("DistributedGPipeStrategy", _taking_gradients(hook))
    refuse_gradients_in_evaluation("DistributedGPipeStrategy", Task())  # the plain steps take none


def test_the_refusals_are_made_at_setup_and_every_way_has_a_conformance_run() -> None:
    """The strategy's setup asks both (read from its source: what a fit or an evaluation runs first), and each way the
    model is called has its feature in the conformance suite, where it runs under every strategy and its reference."""
    setup = inspect.getsource(DistributedGPipeStrategy.setup)
    assert "refuse_closure_optimizers(" in setup and "refuse_gradients_in_evaluation(" in setup
    for feature in ("model_in_every_hook", "two_calls_in_a_step", "call_without_gradients", "backward_twice",
                    "closure_optimizer", "gradients_in_validation", "multiple_train_dataloaders"):
        assert feature in FEATURES
    assert [h for h in HOOKS if h.startswith("on_")], "the hooks the callback of model_in_every_hook calls the model in"
