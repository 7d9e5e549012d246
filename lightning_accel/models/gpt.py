"""A GPT-style decoder-only language model (nanoGPT-shaped).

The layout follows GPT-2: learned token and position embeddings, ``n_layer`` pre-LN
transformer blocks with causal self-attention and a 4x GELU MLP, a final LayerNorm and
a linear head whose weight is tied to the token embedding. It is split into
``pre`` / ``blocks`` / ``post`` (see :mod:`lightning_accel.models.blocks`) so the
block-wise strategies can offload or pipeline it.

Parameter names mirror nanoGPT (``c_attn``, ``c_proj``, ``c_fc``) so checkpoints can be
mapped across with a key rename. Every layer is created from the ambient default device,
so ``with torch.device("meta"): GPT("gpt2-xl", vocab_size=50257)`` counts its 1.56e9
parameters without allocating them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class GPTSize:
    """The shape of one named preset; ``vocab_size`` is left to the tokenizer."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int


# tiny/small are for CPU tests and examples (~0.8M / ~11M parameters at vocab 256);
# the gpt2-* entries are the four published GPT-2 sizes.
GPT_PRESETS: dict[str, GPTSize] = {
    "tiny": GPTSize(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "small": GPTSize(n_layer=6, n_head=6, n_embd=384, block_size=256),
    "gpt2": GPTSize(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-medium": GPTSize(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
    "gpt2-large": GPTSize(n_layer=36, n_head=20, n_embd=1280, block_size=1024),
    "gpt2-xl": GPTSize(n_layer=48, n_head=25, n_embd=1600, block_size=1024),
}


class GPTEmbedding(nn.Module):
    """``pre``: token + learned position embedding, then dropout. (B, T) -> (B, T, C)."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: Tensor) -> Tensor:
        if idx.ndim != 2:
            raise ValueError(f"GPT expects token ids of shape (B, T), got shape {tuple(idx.shape)}")
        t = idx.size(1)
        if t > self.block_size:
            raise ValueError(
                f"sequence length {t} exceeds the model's block_size {self.block_size}; "
                f"crop inputs to {self.block_size} tokens or build the GPT with block_size>={t}"
            )
        pos = torch.arange(t, device=idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C) + (T, C) broadcast


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees only positions <= t."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, nh, T, hs): heads become a batch dimension for SDPA
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        # SDPA picks a fused kernel; is_causal builds the mask so no (T, T) buffer is stored
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # (B, T, C)
        return self.resid_drop(self.c_proj(y))


class GPTMLP(nn.Module):
    """Position-wise feed-forward: C -> 4C -> GELU -> C."""

    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        # GPT-2 used the tanh approximation; matching it keeps converted weights exact
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class GPTBlock(nn.Module):
    """One pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)). (B, T, C) -> (B, T, C)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = GPTMLP(n_embd, dropout, bias)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTHead(nn.Module):
    """``post``: final LayerNorm and the vocabulary projection. (B, T, C) -> (B, T, V)."""

    def __init__(self, n_embd: int, vocab_size: int, bias: bool) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)  # no bias: it may be tied to wte

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    """Decoder-only transformer LM: token ids (B, T) -> next-token logits (B, T, vocab_size).

    ``preset`` names a size in :data:`GPT_PRESETS`; any of ``block_size``, ``n_layer``,
    ``n_head``, ``n_embd`` given explicitly overrides it, so a recipe can say "gpt2 but
    6 layers". ``tie_weights`` shares the token embedding with the output head, as GPT-2
    does, which saves ``vocab_size * n_embd`` parameters.
    """

    def __init__(
        self,
        preset: str = "tiny",
        *,
        vocab_size: int = 256,
        block_size: int | None = None,
        n_layer: int | None = None,
        n_head: int | None = None,
        n_embd: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = True,
    ) -> None:
        super().__init__()
        if preset not in GPT_PRESETS:
            raise ValueError(
                f"unknown GPT preset {preset!r} (known: {', '.join(GPT_PRESETS)}); "
                "pass n_layer/n_head/n_embd/block_size to override a known preset instead"
            )
        size = GPT_PRESETS[preset]
        self.vocab_size = vocab_size
        self.block_size = size.block_size if block_size is None else block_size
        self.n_layer = size.n_layer if n_layer is None else n_layer
        self.n_head = size.n_head if n_head is None else n_head
        self.n_embd = size.n_embd if n_embd is None else n_embd
        self.tie_weights = tie_weights
        self._validate(dropout)

        self.pre = GPTEmbedding(vocab_size, self.block_size, self.n_embd, dropout)
        self.blocks = nn.ModuleList(GPTBlock(self.n_embd, self.n_head, dropout, bias) for _ in range(self.n_layer))
        self.post = GPTHead(self.n_embd, vocab_size, bias)
        if tie_weights:
            self.post.lm_head.weight = self.pre.wte.weight
        self._init_weights()

    def _validate(self, dropout: float) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"GPT {name} must be >= 1, got {value}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"choose n_head among the divisors of {self.n_embd} or change n_embd"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")

    def _init_weights(self, module: nn.Module | None = None) -> None:
        """GPT-2's initialization of the whole model, or (``module`` given) of that one module's own weights, as
        transformers' and litgpt's ``_init_weights(module)`` do: a model built on the meta device is then initialized
        part by part (:mod:`lightning_accel.pipeline.deferred_init`). Modules it does not cover (LayerNorm) keep
        their ``reset_parameters``."""
        # GPT-2: N(0, 0.02) everywhere, zero biases; the projections that write into the
        # residual stream get std / sqrt(2 * n_layer) so its variance stays O(1) with depth
        # (two such writes per block).
        if module is not None:
            if isinstance(module, (nn.Linear, nn.Embedding)):
                residual = any(module is b.attn.c_proj or module is b.mlp.c_proj for b in self.blocks)
                nn.init.normal_(module.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.n_layer) if residual else 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            return
        if all(p.is_meta for p in self.parameters()):
            # built on the meta device: no values to draw (nor does drawing on meta take from the RNG); the init calls
            # cost 0.5 s of CPU there for gpt-175b_full-nvme_1gpu's 581 matrices, in every `ls`, `validate` and `estimate`
            return
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=residual_std)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.pre(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self.post(x)  # (B, T, V)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Count parameters, each shared tensor once; works on the meta device.

        ``exclude_embeddings`` drops the token and position tables (the "non-embedding"
        count of the scaling-law papers). With tied weights that also drops the head,
        which *is* the token table; an untied head stays counted.
        """
        total = sum(p.numel() for p in self.parameters())  # parameters() yields a tied tensor once
        if exclude_embeddings:
            total -= self.pre.wte.weight.numel() + self.pre.wpe.weight.numel()
        return total
