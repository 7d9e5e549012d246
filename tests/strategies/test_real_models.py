"""l2l_offload and gpipe on models this project did not write: weights equal plain Lightning's.

transformers Llama and GPT-2 with their default configs except sizes (``use_cache`` on, as
users get it; batches carry a padding ``attention_mask`` as a tokenizer's do), litgpt's GPT and
a mixed ``nn.Sequential``, 4 AdamW steps from the same start. Before
:mod:`lightning_accel.models.side_effects`, both strategies crashed on the two transformers
models with "The size of tensor a (32) must match the size of tensor b (16)": the recomputed
block appended its keys and values to the KV cache a second time.

float64 shows the strategies exact (atol 1e-10); fp32 is held to rtol 1e-4 (see
``real_models.GRADIENT_FREE`` for the elements only float64 can compare).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel.strategies.l2l_offload_hooks as l2l_module  # where the strategies build their executor
from lightning_accel.offload import L2LExecutor
from lightning_accel.strategies.gpipe import GPipeStrategy
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy
from tests.support.real_models import CausalLM, assert_same_weights, cache_kwarg, fit, real_task, train_save_resume

MODELS = ("llama", "gpt2", "litgpt", "sequential")
STRATEGIES = ("l2l", "l2l-copies", "gpipe-always", "gpipe-except_last", "gpipe-never")


def _strategy(kind: str) -> Any:
    if kind.startswith("l2l"):
        return L2LOffloadStrategy()
    return GPipeStrategy(devices=2, chunks=2, checkpoint=kind.split("-", 1)[1])


def _model_for(model: str, kind: str) -> str:
    # micro-batches draw other dropout masks than the whole batch: GPipe equals plain training without dropout
    return "gpt2-no-dropout" if model == "gpt2" and kind.startswith("gpipe") else model


@functools.lru_cache(maxsize=None)
def _plain(model: str, dtype: torch.dtype) -> CausalLM:
    task = real_task(model, dtype)
    fit(task)
    return task


@pytest.fixture
def real_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """L2L with real host-to-device copies on the CPU: every block is copied to a fresh tensor when
    acquired and its buffers written back when released, instead of computing on the host masters."""
    monkeypatch.setattr(l2l_module, "L2LExecutor", functools.partial(L2LExecutor, alias=False))


def _train(model: str, kind: str, dtype: torch.dtype, request: pytest.FixtureRequest) -> tuple[CausalLM, Any]:
    if kind == "l2l-copies":
        request.getfixturevalue("real_copies")
    task, strategy = real_task(_model_for(model, kind), dtype), _strategy(kind)
    said = pytest.warns(UserWarning, match=r"Setting `use_cache=False` \(net.config.use_cache\)")
    recomputes = kind != "gpipe-never"  # without re-materialization the cache is harmless and use_cache stays
    with said if model in ("llama", "gpt2") and recomputes else contextlib.nullcontext():
        fit(task, strategy)
    if kind == "l2l-copies":
        stats = strategy.offload_stats
        assert stats.h2d_bytes > 0 and stats.d2h_bytes > 0  # the copy path ran, not the alias
    return task, strategy


@pytest.mark.parametrize("kind", STRATEGIES)
@pytest.mark.parametrize("model", MODELS)
def test_float64_weights_equal_plain_lightning(model: str, kind: str, request: pytest.FixtureRequest) -> None:
    task, _ = _train(model, kind, torch.float64, request)
    reference = _plain(_model_for(model, kind), torch.float64)
    assert_same_weights(reference, task, rtol=0, atol=1e-10)


def test_gpt2_dropout_replays_in_gpipe_re_materialization() -> None:
    # with its default dropout GPT-2 equals plain training under gpipe when the batch is one micro-batch: the
    # recomputation draws the same masks (torch.utils.checkpoint restores the RNG); chunks=2 draws other ones
    task = real_task("gpt2", torch.float64)
    fit(task, GPipeStrategy(devices=2, chunks=1, checkpoint="always"))
    assert_same_weights(_plain("gpt2", torch.float64), task, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["l2l-copies", "gpipe-except_last"])  # the aliased L2L path: float64 above
@pytest.mark.parametrize("model", MODELS)
def test_float32_weights_equal_plain_lightning(model: str, kind: str, request: pytest.FixtureRequest) -> None:
    task, _ = _train(model, kind, torch.float32, request)
    reference = _plain(_model_for(model, kind), torch.float32)
    assert_same_weights(reference, task, rtol=1e-4, atol=1e-5, skip_gradient_free=True)


def test_use_cache_is_restored_after_fit_and_the_cache_is_never_built() -> None:
    task = real_task("llama")
    assert task.net.config.use_cache is True
    caches: list[Any] = []
    task.net.model.layers[0].register_forward_pre_hook(lambda m, a, k: caches.append(k.get(cache_kwarg(), "absent")), with_kwargs=True)
    with pytest.warns(UserWarning, match=r"L2LOffloadStrategy: `use_cache=True` is incompatible with recomputing blocks"):
        fit(task, L2LOffloadStrategy(), steps=1)
    assert caches and all(c is None for c in caches)
    assert task.net.config.use_cache is True  # the user's setting, back after fit


@pytest.mark.parametrize("kind", ["l2l", "gpipe-always"])
def test_litgpt_with_a_kv_cache_set_trains_like_plain_lightning(kind: str) -> None:
    # litgpt writes its KVCache only when forward gets input_pos (generation); a training forward leaves it
    # alone, so a model prepared for generation trains as it is, neither refused nor changed
    def with_cache() -> CausalLM:
        task = real_task("litgpt", torch.float64)
        task.net.set_kv_cache(batch_size=8, dtype=torch.float64)
        return task

    plain, task = with_cache(), with_cache()
    fit(plain)
    fit(task, _strategy(kind))
    assert_same_weights(plain, task, rtol=0, atol=1e-10)
    assert task.net.transformer.h[0].attn.kv_cache is not None


class CachingLM(CausalLM):
    """Asks for the KV cache explicitly, which no config setting can turn off."""

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(tokens, attention_mask=mask, use_cache=True).logits


@pytest.mark.parametrize("kind", ["l2l", "gpipe-always"])
def test_a_block_called_with_a_kv_cache_is_refused_naming_it(kind: str) -> None:
    torch.manual_seed(0)
    task = CachingLM(real_task("llama").net)
    owner = "L2LOffloadStrategy" if kind == "l2l" else "GPipeStrategy"
    why = "recomputing it in backward" if kind == "l2l" else "re-materializing it in backward"
    name = "net.model.layers.0" if kind == "l2l" else "model.layers.0"  # L2L plans the LightningModule, GPipe its net
    with pytest.raises(RuntimeError, match=rf"{owner}: block '{name}' \(LlamaDecoderLayer\) was called with a DynamicCache \({cache_kwarg()}\); {why} would write"):
        fit(task, _strategy(kind), steps=1)


class Counting(nn.Module):
    """A block with state its forward writes: a call counter and BatchNorm statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.norm(torch.tanh(self.lin(x)))


class CountingRegressor(CausalLM):
    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Linear(4, 8), *(Counting() for _ in range(3)), nn.Linear(8, 1)))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


def _regression(steps: int, strategy: Any) -> CountingRegressor:
    torch.manual_seed(0)
    task = CountingRegressor()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(task, DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8))
    return task


def test_l2l_puts_back_what_a_recomputation_writes_so_buffers_equal_plain_lightning() -> None:
    plain, offloaded = _regression(3, "auto"), _regression(3, L2LOffloadStrategy())
    for block in list(offloaded.net)[1:4]:
        assert block.calls.item() == 3  # once per step, not again in the recomputation
    assert_same_weights(plain, offloaded, rtol=1e-5, atol=1e-6)  # running mean/var included


def test_gpipe_refuses_a_buffer_written_once_per_micro_batch() -> None:
    with pytest.raises(RuntimeError, match=r"GPipeStrategy: block '1' \(Counting\) writes buffer 1.calls in its forward, which runs once per micro-batch.*; set chunks=1"):
        _regression(1, GPipeStrategy(devices=2, chunks=2, deferred_batch_norm=True))  # its BatchNorm: micro-batch statistics asked for


def test_gpipe_one_micro_batch_recomputed_keeps_buffers_like_plain_lightning() -> None:
    plain, piped = _regression(3, "auto"), _regression(3, GPipeStrategy(devices=2, chunks=1, checkpoint="always"))
    assert all(block.calls.item() == 3 for block in list(piped.net)[1:4])
    assert_same_weights(plain, piped, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("model", "kind"), [("llama", "l2l"), ("litgpt", "l2l-copies"), ("gpt2", "gpipe-always"), ("sequential", "gpipe-except_last")])
def test_resume_from_a_checkpoint_like_plain_lightning(model: str, kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if kind == "l2l-copies":
        request.getfixturevalue("real_copies")
    initial = real_task(_model_for(model, kind), torch.float64)
    straight, resumed = train_save_resume(initial, lambda: _strategy(kind), tmp_path / "strategy")
    plain_straight, plain_resumed = train_save_resume(initial, lambda: "auto", tmp_path / "plain")
    # the checkpoint holds the user's names and loads into the plain model
    state = torch.load(tmp_path / "strategy" / "mid.ckpt", weights_only=False)["state_dict"]
    copy.deepcopy(initial).load_state_dict(state)
    assert_same_weights(plain_straight, straight, rtol=0, atol=1e-10)
    assert_same_weights(plain_resumed, resumed, rtol=0, atol=1e-10)

