"""The regression rows of docs/models.md: architectures and set-ups people bring, tiny, float64, one task for all.

BERT (masked LM), GPT-NeoX, Gemma 3 (sliding window and full attention layers), Mamba (state space), ViT (images), and a
Llama with frozen layers, with peft LoRA, with the model's own gradient checkpointing and with every layer compiled
(``torch.compile`` per layer, the ``aot_eager`` backend: dynamo and AOTAutograd trace the layer as inductor's would, without
inductor's C++ build, which costs ~10 s a layer on the 2-core CI machine). transformers configs at tiny sizes, random
weights, dropout 0 (micro-batches draw other dropout masks than one batch), nothing downloaded. Mixtral and Qwen3-MoE
(mixtures of experts) too, in float32: their experts' grouped_mm has no float64.

Every strategy compares with one reference per row: plain Lightning, batches of 8 in the order Lightning's distributed
sampler gives (seed 0), float64 (float32 for the mixtures). No padding and equal target counts per sample, so a mean loss over a micro-batch
accumulated over micro-batches equals the whole batch's: one reference serves ``l2l_offload``, ``gpipe`` (one process)
and ``gpipe_distributed`` (2 ranks, the user's shuffling loader with Lightning's defaults).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

VOCAB, SEQ, SAMPLES, BATCH, STEPS = 64, 12, 24, 8, 3
MASK_ID = 1  # BERT's [MASK] here: every 4th position of a sequence
IMAGE = 8  # ViT: 8x8 images of 3 channels in 4x4 patches, 4 classes


def _llama(layers: int = 2) -> nn.Module:
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32))


def build_bert() -> nn.Module:
    import transformers

    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def build_gpt_neox() -> nn.Module:
    import transformers

    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0))


def build_gemma3() -> nn.Module:
    """Gemma 3's text model: a sliding-window layer (window 4, shorter than the sequence) then a full-attention one."""
    import transformers

    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=32, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"]))


def build_mamba() -> nn.Module:
    import transformers

    return transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=3))


def build_vit() -> nn.Module:
    import transformers

    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def build_llama_frozen() -> nn.Module:
    """The embedding and the first layer frozen (requires_grad False), the rest trained: no adapters."""
    net = _llama()
    for p in [*net.model.embed_tokens.parameters(), *net.model.layers[0].parameters()]:
        p.requires_grad_(False)
    return net


def build_llama_lora() -> nn.Module:
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def build_llama_own_checkpointing() -> nn.Module:
    net = _llama()
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return net


def build_llama_compiled() -> nn.Module:
    net = _llama()
    for layer in net.model.layers:
        layer.compile(backend="aot_eager")
    return net


def build_mixtral() -> nn.Module:
    """Mixtral's mixture of experts (4 experts, 2 per token; the experts' grouped_mm has no float64: float32 rows)."""
    import transformers

    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32))


def build_qwen3_moe() -> nn.Module:
    import transformers

    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32))


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "bert": build_bert, "gpt-neox": build_gpt_neox, "gemma3": build_gemma3, "mamba": build_mamba, "vit": build_vit,
    "llama-frozen": build_llama_frozen, "llama-lora": build_llama_lora,
    "llama-own-checkpointing": build_llama_own_checkpointing, "llama-compiled": build_llama_compiled,
    "mixtral": build_mixtral, "qwen3-moe": build_qwen3_moe,
}
MIXTURES = {"mixtral", "qwen3-moe"}  # trained in float32: transformers' experts (grouped_mm) refuse float64
ROWS = tuple(BUILDERS)


class RowTask(pl.LightningModule):
    """Cross-entropy of the network's logits against ``targets`` (-100: not a target); AdamW on what requires grad.

    Batches are ``(inputs, targets)``: token ids or images, and per token (a language model, masked or causal) or per
    image (ViT) the class."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        logits = self.net(pixel_values=inputs).logits if inputs.is_floating_point() else self.net(input_ids=inputs).logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def task(name: str) -> RowTask:
    """Row ``name`` built with seed 0, in a :class:`RowTask`: float64, or float32 for a mixture of experts."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    module = RowTask(BUILDERS[name]())
    return module.float() if name in MIXTURES else module.double()


def dataset(name: str) -> Dataset:
    """``SAMPLES`` samples for row ``name``: images and labels (ViT), masked tokens and the masked ones' ids (BERT: 3
    per sequence), or tokens and the next ones (causal LMs)."""
    g = torch.Generator().manual_seed(0)
    if name == "vit":
        return TensorDataset(torch.randn(SAMPLES, 3, IMAGE, IMAGE, generator=g, dtype=torch.float64), torch.randint(0, 4, (SAMPLES,), generator=g))
    tokens = torch.randint(2, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    if name == "bert":
        masked = torch.zeros(SEQ, dtype=torch.bool)
        masked[::4] = True
        return TensorDataset(tokens[:, :-1].masked_fill(masked, MASK_ID), tokens[:, :-1].masked_fill(~masked, -100))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def sampled_order(n: int = SAMPLES) -> list[int]:
    """The order Lightning's DistributedSampler gives one pipeline replica of a shuffling loader (seed 0, epoch 0)."""
    from torch.utils.data import DistributedSampler

    return list(DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=0))


def loader(name: str, accumulate: int = 1) -> DataLoader:
    """Row ``name``'s data in the distributed sampler's order (one process), in batches of ``BATCH / accumulate``."""
    return DataLoader(dataset(name), batch_size=BATCH // accumulate, sampler=sampled_order())


def fit(module: pl.LightningModule, name: str, strategy: Any = "auto", precision: str = "32-true", accumulate: int = 1) -> None:
    """``STEPS`` steps of batches of ``BATCH`` (``accumulate``: each in that many micro-batches, accumulated), on one
    thread as the 2-rank launch's workers run: tiny models gain nothing from more, and CPU kernels split their sums by
    thread (bf16-mixed Mixtral: 7.6e-6 apart with two threads, 0.0 with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pl.Trainer(
            accelerator="cpu", devices=1, strategy=strategy, max_steps=STEPS, precision=precision, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            accumulate_grad_batches=accumulate,
        ).fit(module, loader(name, accumulate))
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def reference(name: str, precision: str = "32-true", accumulate: int = 1) -> dict[str, Tensor]:
    """Row ``name`` after plain Lightning's ``STEPS`` steps: its state dict (one fit per row, precision and accumulation
    and test session). ``accumulate``: the same micro-batches a pipeline runs, where rounding depends on them (bf16)."""
    plain = task(name)
    fit(plain, name, precision=precision, accumulate=accumulate)
    return {k: v.detach().clone() for k, v in plain.state_dict().items()}


# rows that compute parts in float32 inside a float64 model, so their rounding changes with the micro-batch layout: Gemma
# 3's RMSNorm (x.float()), Mamba's reference scan (dt.float(), the state in float32); measured 1.3e-8 and 7.6e-9 under
# gpipe, against the ~1e-2 a wrong step or gradient moves a weight
FLOAT32_INSIDE = {"gemma3", "mamba"}


def tolerance(name: str) -> float:
    """The largest absolute weight difference from :func:`reference` that row ``name`` may show under a strategy: float32
    rounding for a mixture of experts (the batch layout changes it)."""
    return 2e-5 if name in MIXTURES else 1e-7 if name in FLOAT32_INSIDE else 1e-12


def max_difference(name: str, state: dict[str, Tensor], precision: str = "32-true", accumulate: int = 1) -> float:
    """Largest absolute difference of ``state`` from :func:`reference` (the same names required)."""
    ref = reference(name, precision, accumulate)
    assert state.keys() == ref.keys()
    return max(float((state[k].double() - ref[k].double()).abs().max()) for k in ref if ref[k].is_floating_point())
