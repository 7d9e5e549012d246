"""Models this project did not write, tiny and random-init, and a causal-LM task over them.

Shared by the strategy tests (l2l_offload, gpipe, gpipe_distributed): transformers Llama and
GPT-2 with their default configs except sizes (so ``use_cache`` stays on, as users get it),
litgpt's GPT from a small ``litgpt.Config``, and a mixed ``nn.Sequential`` (the torchgpipe
input). Each builder imports its library lazily and skips the calling test when it is
missing. Nothing is downloaded.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 128
SEQ = 16
REAL_MODELS = ("llama", "gpt2", "litgpt", "sequential")


def build_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg)


def build_gpt2(dropout: bool = True) -> nn.Module:
    """GPT-2 with its default dropout (0.1), or none: micro-batches draw other dropout masks
    than one whole batch does, so GPipe with chunks > 1 can equal plain training only without."""
    transformers = pytest.importorskip("transformers")
    off = {} if dropout else {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=64, **off)
    return transformers.GPT2LMHeadModel(cfg)


def build_litgpt() -> nn.Module:
    litgpt = pytest.importorskip("litgpt")
    cfg = litgpt.Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=3, n_head=4, n_embd=32)
    return litgpt.GPT(cfg)


class TokenMLP(nn.Sequential):
    """A mixed nn.Sequential over tokens: embedding, four (Linear, GELU) layers, a head."""

    def __init__(self) -> None:
        super().__init__(
            nn.Embedding(VOCAB, 32),
            *(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)),
            nn.Linear(32, VOCAB),
        )


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "llama": build_llama, "gpt2": build_gpt2, "gpt2-no-dropout": lambda: build_gpt2(dropout=False),
    "litgpt": build_litgpt, "sequential": TokenMLP,
}

# Elements whose gradient is zero in exact arithmetic: the attention key bias adds the same q.b to
# every logit of a query, which softmax ignores (litgpt rotates a quarter of each head, those do
# get gradients). In fp32 their gradient is rounding noise, which AdamW scales up to lr-sized
# steps, so two correct runs that round differently disagree there by ~lr; float64 runs compare them.
GRADIENT_FREE = {"attn.c_attn.bias": slice(32, 64), "attn.qkv.bias": slice(32, 64)}


def cache_kwarg() -> str:
    """The keyword transformers hands a decoder layer its KV cache by: ``cache`` from 5.24, ``past_key_values`` before."""
    import inspect

    transformers = pytest.importorskip("transformers")
    return "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"


def logits_of(output: Any) -> Tensor:
    """Logits from whatever a causal LM returns: a tensor (litgpt, nn.Sequential) or a
    transformers ``ModelOutput`` / tuple (logits first)."""
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    return logits if logits is not None else output[0]


def _is_transformers(net: nn.Module) -> bool:
    return type(net).__module__.startswith("transformers.")


class CausalLM(pl.LightningModule):
    """Next-token cross-entropy over any causal LM's logits; AdamW. The network is ``self.net``.

    Batches are ``(tokens, targets, mask)`` with right padding (mask 0): transformers models
    get the mask as ``attention_mask``, as a tokenizer's batch gives it (which makes them build
    an explicit attention mask, where a KV cache grown twice shows as a shape error); every
    model ignores the padded targets.
    """

    def __init__(self, net: nn.Module, lr: float = 1e-2) -> None:
        super().__init__()
        self.net = net
        self.lr = lr

    def forward(self, tokens: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is not None and _is_transformers(self.net):
            return logits_of(self.net(tokens, attention_mask=mask))
        return logits_of(self.net(tokens))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, targets, mask = batch
        logits = self(tokens, mask)
        targets = targets.masked_fill(mask == 0, -100)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def build_t5() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0))


def build_bart() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0))


ENCODER_DECODERS: dict[str, Callable[[], nn.Module]] = {"t5": build_t5, "bart": build_bart}
# each encoder-decoder's block stacks, encoder first (parameter name prefixes under Seq2Seq.net)
BLOCK_STACKS: dict[str, tuple[str, str]] = {"t5": ("encoder.block", "decoder.block"), "bart": ("model.encoder.layers", "model.decoder.layers")}


class Seq2Seq(pl.LightningModule):
    """An encoder-decoder's own loss on (source, target) token batches (logged as ``val_loss`` in validation); AdamW."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.net(input_ids=batch[0], labels=batch[1]).loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.net(input_ids=batch[0], labels=batch[1]).loss)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def seq2seq_task(name: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> Seq2Seq:
    """``name`` (one of ENCODER_DECODERS) built with ``seed``, in ``dtype``, inside a Seq2Seq."""
    torch.manual_seed(seed)
    return Seq2Seq(ENCODER_DECODERS[name]().to(dtype))


def seq2seq_data(n: int = 12) -> TensorDataset:
    """``n`` (source of 12, target of 10) token pairs, no padding."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(1, 64, (n, 12), generator=g), torch.randint(1, 64, (n, 10), generator=g))


def real_task(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> CausalLM:
    """``name`` (one of REAL_MODELS) built with ``seed``, in ``dtype``, inside a CausalLM."""
    torch.manual_seed(seed)
    return CausalLM(BUILDERS[name]()).to(dtype)


def lm_loader(n: int = 32, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    mask[1::2, -3:] = 0  # every other sequence is 3 tokens shorter: right padding
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:], mask), batch_size=batch_size)


def shuffled_order(n: int = 32, seed: int = 0) -> list[int]:
    """The order Lightning's DistributedSampler gives one replica of a shuffled ``lm_loader`` (epoch 0), for references."""
    from torch.utils.data import DistributedSampler

    return list(DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=seed))


def fit(task: pl.LightningModule, strategy: Any = "auto", steps: int = 4, ckpt_path: str | Path | None = None,
        callbacks: list[pl.Callback] | None = None, loader: DataLoader | None = None, **trainer_kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **trainer_kwargs,
    )
    trainer.fit(task, loader if loader is not None else lm_loader(), ckpt_path=ckpt_path)
    return trainer


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest absolute difference between two models' state dicts (same names required)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()  # the user's parameter names, unchanged
    return max(((sa[k].detach().cpu().double() - sb[k].detach().cpu().double()).abs().max().item() for k in sa if sa[k].is_floating_point()), default=0.0)


def assert_same_weights(reference: nn.Module, other: nn.Module, rtol: float, atol: float, skip_gradient_free: bool = False) -> None:
    """Every state-dict entry of ``other`` close to ``reference``'s (names equal); with
    ``skip_gradient_free`` the GRADIENT_FREE elements are left out (fp32 runs)."""
    sa, sb = reference.state_dict(), other.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        a, b = sa[name].cpu(), sb[name].cpu()
        free = next((cut for suffix, cut in GRADIENT_FREE.items() if name.endswith(suffix)), None) if skip_gradient_free else None
        if free is not None:
            keep = torch.ones(a.shape[0], dtype=torch.bool)
            keep[free] = False
            a, b = a[keep], b[keep]
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=name)


def train_save_resume(initial: pl.LightningModule, make_strategy: Callable[[], Any], ckpt_dir: Path,
                      steps: int = 4, save_at: int = 2) -> tuple[pl.LightningModule, pl.LightningModule]:
    """``steps`` straight, and ``save_at`` steps saved then resumed to ``steps`` in a fresh Trainer."""

    class SaveAt(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            if trainer.global_step == save_at:
                trainer.save_checkpoint(ckpt_dir / "mid.ckpt")

    straight, resumed = copy.deepcopy(initial), copy.deepcopy(initial)
    fit(straight, make_strategy(), steps=steps, callbacks=[SaveAt()])
    fit(resumed, make_strategy(), steps=steps, ckpt_path=ckpt_dir / "mid.ckpt")
    return straight, resumed
