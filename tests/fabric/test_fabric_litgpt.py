"""litgpt's own loops (``finetune/full.py``, ``pretrain.py``, LoRA) under each of our Fabric strategies: the weights
equal the same loop under Fabric's default strategy (one device) in float64; the LoRA fine-tune under
``l2l_offload`` trains the adapters as Fabric's default does and keeps its frozen bf16 base at its stored size."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

import lightning_accel  # noqa: F401  (registers the names with Fabric)
from lightning_accel.fabric import GPipeStrategy, L2LOffloadStrategy

from tests.support.fabric_loops import batches, finetune_full, fresh, gpt, lora_gpt, max_difference, pretrain, weights

# Each of our Fabric strategies, as a user would pass it (by name, or built with options).
STRATEGIES: dict[str, Any] = {
    "l2l_offload": lambda: "l2l_offload",
    "l2l_offload-resident": lambda: L2LOffloadStrategy(offload_resident=True, prefetch_blocks=2),
    "l2l_offload-activations": lambda: L2LOffloadStrategy(offload_activations=True),
    "gpipe": lambda: GPipeStrategy(chunks=2, devices=["cpu", "cpu"]),
}


def _fabric(strategy: Any, precision: str = "32-true") -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)
    fabric.launch()
    return fabric


@functools.lru_cache(maxsize=None)
def _reference(loop: str) -> dict[str, torch.Tensor]:
    """The loop under Fabric's default strategy, float64."""
    model, _ = LOOPS[loop](_fabric("auto"), fresh(_START), batches(4))
    return weights(model)


LOOPS = {"finetune_full": finetune_full, "pretrain": pretrain}
_START = gpt()


# every strategy on litgpt's fine-tuning loop; the pretraining loop (clipping by norm, the learning rate set each
# iteration) under the two mechanisms
CASES = [("finetune_full", s) for s in STRATEGIES] + [("pretrain", "l2l_offload"), ("pretrain", "gpipe")]


@pytest.mark.parametrize(("loop", "strategy"), CASES)
def test_litgpt_loops_equal_fabrics_default_strategy(loop: str, strategy: str) -> None:
    model, _ = LOOPS[loop](_fabric(STRATEGIES[strategy]()), fresh(_START), batches(4))
    difference = max_difference(_reference(loop), weights(model))
    assert difference < 1e-10, difference  # float64 rounding (fused AdamW, another summation order), amplified by Adam
    assert max_difference(weights(_START), weights(model)) > 1e-3  # it trained


def test_clipping_by_value_equals_fabrics_default_strategy() -> None:
    reference, _ = pretrain(_fabric("auto"), fresh(_START), batches(4), max_norm=None, clip_val=1e-3)
    model, _ = pretrain(_fabric("l2l_offload"), fresh(_START), batches(4), max_norm=None, clip_val=1e-3)
    assert max_difference(weights(reference), weights(model)) < 1e-10


def test_a_wrong_loop_is_told_apart() -> None:
    """The comparison above can fail: one accumulation step fewer moves the weights far beyond its tolerance."""
    model, _ = finetune_full(_fabric("l2l_offload"), fresh(_START), batches(4), accumulation=4)
    assert max_difference(_reference("finetune_full"), weights(model)) > 1e-4


def test_lora_under_l2l_trains_the_adapters_as_fabric_and_keeps_the_base_as_stored(tmp_path: Path) -> None:
    start = lora_gpt()
    base = {n: p.detach().clone() for n, p in start.named_parameters() if not p.requires_grad}
    reference, _ = finetune_full(_fabric("auto", "bf16-mixed"), fresh(start), batches(4), lr=1e-3)
    strategy = L2LOffloadStrategy()
    model, _ = finetune_full(_fabric(strategy, "bf16-mixed"), fresh(start), batches(4), lr=1e-3,
                             save_to=tmp_path / "lora.ckpt")
    adapters = {n: p for n, p in weights(model).items() if "lora_" in n}
    expected = {n: p for n, p in weights(reference).items() if "lora_" in n}
    moved = max_difference(expected, {n: start.state_dict()[n] for n in expected})
    assert max_difference(expected, adapters) < 1e-2 * moved  # bf16 autocast rounding only
    # the frozen base: never written, still bf16, and kept on the host at 2 bytes a parameter
    trained = dict(model.module.named_parameters())
    for name, before in base.items():
        assert trained[name].dtype == torch.bfloat16 and torch.equal(trained[name].cpu(), before), name
    stats = strategy.offload_stats
    blocks = model.module.transformer.h
    frozen = sum(p.numel() for p in blocks.parameters() if not p.requires_grad)
    adapter = sum(p.numel() for p in blocks.parameters() if p.requires_grad)
    assert stats.offloaded_params == frozen + adapter
    assert 2 * frozen < stats.host_bytes <= 2 * frozen + 20 * adapter  # frozen: as stored; adapters: master, shadow, grad
    saved = torch.load(tmp_path / "lora.ckpt", weights_only=True)
    assert torch.equal(saved["model"]["transformer.h.0.attn.qkv.linear.weight"], base["transformer.h.0.attn.qkv.linear.weight"])
    assert torch.equal(saved["model"]["transformer.h.0.attn.qkv.lora_A"], adapters["transformer.h.0.attn.qkv.lora_A"])
