"""A second Trainer in the same process, handed the same callback and precision plugin objects, is unaffected by
the first one's pipeline strategy: it sees Lightning's own methods, after a fit that finished and after one that
raised (issue 34).

DistributedGPipeStrategy replaces ``ModelSummary._summary`` (its split module cannot run the example input) and the
precision plugin's ``clip_grad_by_norm`` and, with a GradScaler, ``_after_closure`` (both across ranks) for its fit.
One rank in this process is enough to see them put in place and taken away. XLAPJRTStrategy runs the Trainer's
evaluation loops outside inference mode for its run; the Trainer's own setting comes back at teardown.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import MLP
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from lightning_accel.strategies.xla_pjrt import XLAPJRTStrategy

# the objects a user hands to both Trainers, and the methods the strategy replaces on them
REPLACED = {"summary": ("_summary",), "precision": ("clip_grad_by_norm", "_after_closure")}


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(4, 2, hidden=8, depth=2)
        self.example_input_array = torch.zeros(2, 4)  # the summary runs it, unless the strategy takes it away

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Seen(pl.Callback):
    """At the first training batch: which replaced methods are Lightning's own (True) or something else (False)."""

    def __init__(self, objects: dict[str, object], fail: bool = False) -> None:
        self.objects, self.fail = objects, fail
        self.own: dict[str, bool] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.own = _lightnings_own(self.objects)
        if self.fail:
            raise RuntimeError("a fit that fails")


def _lightnings_own(objects: dict[str, object]) -> dict[str, bool]:
    return {
        f"{key}.{name}": name not in vars(obj) and getattr(obj, name).__func__ is getattr(type(obj), name)
        for key, obj in objects.items() for name in REPLACED[key]
    }


def _fit(objects: dict[str, object], strategy: object, fail: bool = False) -> dict[str, bool]:
    seen = Seen(objects, fail)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, plugins=[objects["precision"]], max_steps=1,
        gradient_clip_val=1.0, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, callbacks=[objects["summary"], seen],
    )
    data = TensorDataset(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), torch.randn(4, 2))
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))
    return seen.own


def test_plain_lightning_after_the_pipeline_sees_its_own_methods(one_rank) -> None:
    objects = {"summary": ModelSummary(), "precision": MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))}
    during = _fit(objects, DistributedGPipeStrategy(chunks=2, timeout=60))
    assert not any(during.values()), f"the pipeline's fit ran on Lightning's own methods: {during}"
    assert all(_lightnings_own(objects).values()), f"left replaced after the pipeline's fit: {_lightnings_own(objects)}"
    second = _fit(objects, "auto")
    assert all(second.values()), f"plain Lightning's fit saw replacements: {second}"

    with pytest.raises(RuntimeError, match="a fit that fails"):
        _fit(objects, DistributedGPipeStrategy(chunks=2, timeout=60), fail=True)
    assert all(_lightnings_own(objects).values()), f"left replaced after a failed fit: {_lightnings_own(objects)}"


class CausalLM(pl.LightningModule):
    """A transformers Llama at its defaults apart from the size (``use_cache=True``, as downloaded)."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers", reason="needs the hf extra")
        self.net = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=16,
        ))
        self.use_cache_in_fit: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.use_cache_in_fit.append(self.net.config.use_cache)
        (ids,) = batch
        return self.net(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_models_use_cache_is_off_for_the_pipelines_fit_and_back_after(one_rank, caplog: pytest.LogCaptureFixture) -> None:
    model = CausalLM()
    assert model.net.config.use_cache is True
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=DistributedGPipeStrategy(chunks=2, timeout=60), max_steps=1,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    with caplog.at_level("INFO"):
        trainer.fit(model, DataLoader(TensorDataset(torch.randint(0, 32, (4, 8))), batch_size=4))
    assert model.use_cache_in_fit and not any(model.use_cache_in_fit)  # every call of the step saw it off
    assert model.net.config.use_cache is True  # the user's config as it was, after fit
    assert caplog.text.count("set config.use_cache = False for training") == 1, caplog.text


@pytest.mark.parametrize("inference_mode", [True, False])
def test_xla_pjrt_gives_the_evaluation_loops_their_inference_mode_back(monkeypatch, inference_mode: bool) -> None:
    """A stand-in, as torch_xla is not installed here (the XLA tests run in their own venv): Lightning's own
    ``Strategy.setup`` and ``teardown`` (which move the model to and from the XLA device) are stubbed, the strategy's
    own ``setup`` and ``teardown`` run against a real Trainer's loops."""
    from lightning.pytorch.strategies import Strategy

    monkeypatch.setattr(Strategy, "setup", lambda self, trainer: None)
    monkeypatch.setattr(Strategy, "teardown", lambda self: None)
    trainer = pl.Trainer(accelerator="cpu", devices=1, inference_mode=inference_mode, logger=False, enable_progress_bar=False)
    loops = [trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop]
    own = [loop.inference_mode for loop in loops]  # Lightning's: fit's validation loop never uses it
    assert own == [False] + [inference_mode] * 3
    strategy = XLAPJRTStrategy()
    strategy.setup(trainer)
    strategy.setup(trainer)  # a second setup before teardown patches once, not over its own patch
    assert [loop.inference_mode for loop in loops] == [False] * 4  # torch_xla's tensors have no inference mode
    strategy.teardown()
    assert [loop.inference_mode for loop in loops] == own  # the Trainer's own, not a default
