"""``gpipe`` on a model with no block container (a few layers as attributes, as Lightning's own test models are): the
children with parameters are its stages where the forward runs them as a chain, and training equals plain Lightning's
(float64); a forward that does not run them as a chain is refused before any work, in one line naming ``blocks=``."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.strategies import GPipeStrategy


class Attributes(pl.LightningModule):
    """Layers as plain attributes, called in order; a parameterless activation among them, a functional one after."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(5, 8)
        self.act = nn.Tanh()
        self.l2 = nn.Linear(8, 8)
        self.l3 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(self.act(self.l1(x)))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Branches(Attributes):
    """l1 and l2 both read the input: not a chain."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(self.act(self.l1(x)) + self.l2(torch.cat([x, x[:, :3]], 1)))


class Reordered(Attributes):
    """A chain, but not in the order the model registers its children."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(5, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(self.l1(self.act(self.l2(x))))


class Branching(Attributes):
    """Control flow on a tensor's value: the trace cannot follow it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        return self.l3(self.l2(h if h.sum() > 0 else -h))


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 5, generator=g, dtype=torch.float64)
    return DataLoader(TensorDataset(x, torch.stack([x.sum(1).sin(), x[:, 0]], 1)), batch_size=8)


def _fit(model: pl.LightningModule, strategy: Any) -> None:
    pl.Trainer(max_epochs=2, strategy=strategy, accelerator="cpu", precision="64-true", logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model, _loader())


@pytest.mark.parametrize(("chunks", "balance"), [(2, "by_size"), (4, "by_time")])
def test_children_chain_trains_as_plain_lightning(chunks: int, balance: str) -> None:
    plain, piped = Attributes(), Attributes()
    _fit(plain, "auto")
    strategy = GPipeStrategy(chunks=chunks, balance=balance, devices=["cpu", "cpu"])
    _fit(piped, strategy)
    for (name, mine), theirs in zip(piped.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-13, msg=name)
    assert not torch.equal(piped.l1.weight, Attributes().l1.weight.double())  # it trained


def test_the_children_are_the_stages() -> None:
    strategy = GPipeStrategy(chunks=2, devices=["cpu", "cpu"])
    seen: list[tuple[list[str], list[int]]] = []

    class Look(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            seen.append(([b.name for b in strategy.pipeline.blocks], strategy.pipeline.balance))

    pl.Trainer(max_steps=1, strategy=strategy, accelerator="cpu", precision="64-true", logger=False, callbacks=[Look()],
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(Attributes(), _loader())
    assert seen[0][0] == ["l1", "l2", "l3"] and sum(seen[0][1]) == 3 and len(seen[0][1]) == 2


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (Branches, r"Branches\.forward calls l2 on something that does not come from l1's output"),
        (Reordered, r"Reordered\.forward calls l2 before l1 \(registered first\)"),
        (Branching, r"Branching\.forward could not be traced to check that \(TraceError: "),
    ],
)
def test_children_not_a_chain_are_refused_in_one_line(model: type, reason: str) -> None:
    task = model()
    before = copy.deepcopy(task.state_dict())
    with pytest.raises(ValueError, match=r"^GPipeStrategy: no blocks found in \w+ under 'auto' .*, and its children with "
                                         rf"parameters \(l1, l2, l3\) cannot be cut into pipeline stages: {reason}.*; "
                                         r"pass blocks=") as refused:
        _fit(task, GPipeStrategy(chunks=2, devices=["cpu", "cpu"]))
    assert "\n" not in str(refused.value)
    for name, value in task.state_dict().items():
        assert torch.equal(value.to(before[name].dtype), before[name]), name


class NoParameters(pl.LightningModule):
    """Nothing to place: evaluated, it runs whole (Lightning's loop tests validate and predict such models)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("mean", batch[0].mean())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return batch[0].sum(1)


def test_a_model_without_parameters_is_evaluated_as_under_plain_lightning() -> None:
    def run(strategy: Any) -> tuple[list, list]:
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False)
        return trainer.validate(NoParameters(), _loader(), verbose=False), trainer.predict(NoParameters(), _loader())

    (metrics, predictions), (plain_metrics, plain_predictions) = run(GPipeStrategy(devices=["cpu", "cpu"])), run("auto")
    assert metrics == plain_metrics
    torch.testing.assert_close(torch.cat(predictions), torch.cat(plain_predictions), rtol=0, atol=0)


class NoForward(Attributes):
    """The steps call the layers themselves; forward is LightningModule's."""

    forward = pl.LightningModule.forward

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.l3(self.l2(self.act(self.l1(x)))), y)


def test_a_model_without_forward_is_refused_naming_why() -> None:
    with pytest.raises(ValueError, match=r"NoForward\.forward is not the model's own \(its steps call the layers "
                                         r"themselves: there is no call to micro-batch\); pass blocks="):
        _fit(NoForward(), GPipeStrategy(chunks=2))


def test_a_forward_defined_by_a_library_class_is_the_models_own() -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel  # its forward lives in lightning's package

    from lightning_accel.models.block_policy import find_blocks
    from lightning_accel.pipeline.child_chain import chain_break

    model = BoringModel()
    assert chain_break(model, find_blocks(model, "auto", children=True)) is None


class Recording(Attributes):
    """A forward that counts its calls and keeps what it saw: the chain's trace must not add to either."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.shapes = 0, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.shapes.append(x.shape[0])
        return super().forward(x)


def test_the_trace_leaves_the_models_state_as_plain_lightning_does() -> None:
    plain, piped = Recording(), Recording()
    _fit(plain, "auto")
    _fit(piped, GPipeStrategy(chunks=1, devices=["cpu", "cpu"]))
    assert (piped.calls, piped.shapes) == (plain.calls, plain.shapes) == (6, [8] * 6)
