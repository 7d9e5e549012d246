"""Lightning's own tests, with ``l2l_offload`` swapped in, found what a user's code sees differ from plain Lightning
(issue 60); each case here runs the same float64 model under plain Lightning and under ``l2l_offload`` and compares the
weights (and what the user's code saw):

- ``param.grad`` between ``manual_backward`` and ``opt.step()`` (clipping there, by Lightning's ``clip_gradients`` or
  torch's ``clip_grad_norm_``), and in a validation run that starts inside a gradient-accumulation window;
- a model with no block container (each direct child with parameters streams as a block);
- blocks in an ``nn.Sequential(OrderedDict(...))`` (named as registered);
- ``copy.deepcopy`` of a streamed block, or of the model, during fit;
- ``Strategy.backward`` wrapped on the base class (as Lightning's tests mock it).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Callable
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import Strategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import L2LOffloadStrategy
from lightning_accel.offload.plan import make_plan


def _data(n: int = 32, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=batch_size)


class Stacked(pl.LightningModule):
    """Blocks in a ModuleList between an input and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.stack = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.stack:
            h = block(h)
        return self.out(h)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def _fit(model: pl.LightningModule, strategy: Any = "auto", **trainer: Any) -> pl.Trainer:
    model = model.to(torch.float64)
    kwargs: dict[str, Any] = dict(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    kwargs.update(trainer)
    fitter = pl.Trainer(strategy=strategy, **kwargs)
    fitter.fit(model, _data(), _data(8) if kwargs.get("limit_val_batches") else None)
    return fitter


def _assert_same_weights(plain: nn.Module, offload: nn.Module) -> None:
    theirs, mine = plain.state_dict(), offload.state_dict()
    assert list(mine) == list(theirs)
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-12, atol=1e-14, msg=name)


def _both(make: Callable[[], pl.LightningModule], **trainer: Any) -> tuple[pl.LightningModule, pl.LightningModule]:
    plain, offload = make(), make()
    _fit(plain, **trainer)
    _fit(offload, L2LOffloadStrategy(), **trainer)
    _assert_same_weights(plain, offload)
    return plain, offload


# -- param.grad where plain Lightning shows it ------------------------------------------------------------------------

class ManualClipped(Stacked):
    """Manual optimization, the gradients clipped between manual_backward and opt.step(); what each clip saw kept."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.how = how
        self.norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.loss(batch) * 50)  # big enough that a clip to 0.1 bites
        if self.how == "lightning":
            self.clip_gradients(opt, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
            self.norms.append(sum(float(p.grad.norm()) ** 2 for p in self.parameters()) ** 0.5)
        else:
            self.norms.append(float(nn.utils.clip_grad_norm_(self.parameters(), 0.1)))
        opt.step()


@pytest.mark.parametrize("how", ["lightning", "torch"])
def test_clipping_between_manual_backward_and_step(how: str) -> None:
    plain, offload = _both(lambda: ManualClipped(how))
    assert len(offload.norms) == 8
    torch.testing.assert_close(offload.norms, plain.norms, rtol=1e-10, atol=0)
    if how == "lightning":  # after the clip: every gradient (host ones included) was clipped
        assert max(offload.norms) < 0.1 + 1e-9
    else:  # the norm before the clip: it bit
        assert min(offload.norms) > 0.1


class SeesGradsInValidation(Stacked):
    """Validation every 3 batches while 2 are accumulated: it starts inside an accumulation window."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, torch.Tensor | None]] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.seen.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in self.named_parameters()})


def test_validation_inside_an_accumulation_window_sees_the_partial_gradients() -> None:
    plain, offload = _both(SeesGradsInValidation, accumulate_grad_batches=2, val_check_interval=3, limit_val_batches=1)
    assert len(offload.seen) == len(plain.seen) >= 2
    partial = 0
    for mine, theirs in zip(offload.seen, plain.seen):
        for name, grad in theirs.items():
            assert (mine[name] is None) == (grad is None), name
            if grad is not None:
                partial += 1
                torch.testing.assert_close(mine[name], grad, rtol=1e-12, atol=1e-14, msg=name)
    assert partial  # (batch 3 ends inside a window: plain Lightning shows its gradients)


# -- Strategy.backward wrapped on the base class ---------------------------------------------------------------------

class ManualWithHook(ManualClipped):
    def on_after_backward(self) -> None:  # (the gradients are landed for this hook: on the plugin, not in backward)
        self.after = [p.grad is not None for p in self.parameters()]


def test_strategy_backward_mocked_on_the_base_class_does_not_recurse() -> None:
    """Lightning's tests wrap the instance's method in a mock put on the class; a ``backward`` of ours that called
    ``super().backward()`` would call the mock again, forever. ``backward`` is Lightning's own."""
    plain = ManualWithHook("torch")
    _fit(plain)
    offload = ManualWithHook("torch").to(torch.float64)
    trainer = pl.Trainer(accelerator="cpu", strategy=L2LOffloadStrategy(), max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward) as backward:
        trainer.fit(offload, _data())
    assert backward.call_count == 8
    assert all(offload.after)
    _assert_same_weights(plain, offload)


# -- models without a block container; blocks named as registered ------------------------------------------------------

class Boring(pl.LightningModule):
    """Lightning's BoringModel (tests_pytorch/helpers/boring_model.py): one Linear as an attribute, SGD(lr=0.1)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class FewLayers(Boring):
    """Layers as attributes, registered in another order than forward calls them, a parameterless child between, a
    parameter of the module's own, and a wrapper around a net of attributes (looked into)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 1)
        self.act = nn.Tanh()
        self.scale = nn.Parameter(torch.ones(1))
        self.body = nn.Module()
        self.body.c1, self.body.c2 = nn.Linear(6, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.body.c2(self.act(self.body.c1(x))))) * self.scale + self.layer(x)


class Wrapped(Boring):
    def __init__(self) -> None:
        super().__init__()
        del self.layer
        self.net = nn.Module()
        self.net.a, self.net.b = nn.Linear(6, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.b(torch.relu(self.net.a(x)))


class Named(Stacked):
    """Blocks in an nn.Sequential(OrderedDict(...)): named as registered (``layer.mlp_1``), not by position."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.Sequential(OrderedDict((f"mlp_{i}", nn.Sequential(nn.Linear(8, 8), nn.Tanh())) for i in range(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.stack(self.inp(x)))


@pytest.mark.parametrize(("make", "blocks"), [
    (Boring, ["layer"]),
    (FewLayers, ["layer", "head", "body"]),
    (Wrapped, ["net.a", "net.b"]),
    (Named, ["stack.mlp_0", "stack.mlp_1", "stack.mlp_2"]),
])
def test_models_without_a_block_list_train_as_plain_lightning(make: Callable[[], pl.LightningModule], blocks: list[str]) -> None:
    plain, offload = make(), make()
    _fit(plain)
    trainer = _fit(offload, L2LOffloadStrategy())
    _assert_same_weights(plain, offload)
    assert trainer.strategy.offload_stats.steps == 8
    assert [unit.name for unit in make_plan(make()).blocks] == blocks


# -- copy.deepcopy during fit -----------------------------------------------------------------------------------------

class Copied(Stacked):
    """Copies a streamed block and the whole model after each training batch (as EMA/SWA-like callbacks do)."""

    def __init__(self) -> None:
        super().__init__()
        self.checked = 0

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        block, model = copy.deepcopy(self.stack[1]), copy.deepcopy(self)
        assert "forward" not in vars(block) or vars(block)["forward"].__self__ is block  # an ordinary module
        x = torch.randn(2, 6, dtype=torch.float64)
        with torch.no_grad():
            h = self.inp(x)
            torch.testing.assert_close(block(h.cpu()), self.stack[1](h).cpu(), rtol=0, atol=0)
            torch.testing.assert_close(model(x.cpu()), self(x).cpu(), rtol=0, atol=0)
        for (name, mine), theirs in zip(self.state_dict().items(), model.state_dict().values()):
            torch.testing.assert_close(theirs.cpu(), mine.cpu(), rtol=0, atol=0, msg=name)  # the current weights
        self.checked += 1


def test_deepcopy_of_a_streamed_block_or_the_model_during_fit() -> None:
    plain, offload = _both(Copied)
    assert offload.checked == 8


def test_a_model_without_parameters_validates_and_predicts() -> None:
    """An evaluation-only LightningModule (Lightning's loop tests have several): nothing to stream, nothing refused."""

    class NoParameters(pl.LightningModule):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("mean", batch[0].mean())

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return batch[0].sum()

    kwargs: dict[str, Any] = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    plain = pl.Trainer(**kwargs)
    offload = pl.Trainer(strategy=L2LOffloadStrategy(), **kwargs)
    assert offload.validate(NoParameters(), _data()) == plain.validate(NoParameters(), _data())
    assert offload.predict(NoParameters(), _data()) == plain.predict(NoParameters(), _data())
