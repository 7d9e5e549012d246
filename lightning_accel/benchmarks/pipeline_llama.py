"""A transformers ``LlamaForCausalLM`` for ``bench pipeline``, and its stages cut by hand for raw ``torch.distributed.pipelining``.

Why by hand: torch's ``pipeline()`` tracer traces a tiny Llama but its traced stages fail
at the first step (``Expected positional argument for parameter unsqueeze_default``, torch
2.13, transformers 5.23), so a user of raw pipelining writes the stages themselves, as
here. :class:`LlamaStage` is decoder layers ``start .. stop - 1`` with the embedding before
them on the first stage and the final norm and the head after them on the last. Only the
hidden states ``(B, T, hidden)`` cross ranks: every stage recomputes the position ids, the
rotary cos/sin and the causal mask from the sequence length, with the model's own rotary
module and transformers' own ``create_causal_mask`` (a few microseconds against a
layer's milliseconds; sending them would add two tensors per micro-batch to every send).
The loss is transformers' causal-LM loss written out (labels shifted left, the last
position ignored), as the schedule's ``loss_fn`` on the last stage's logits.

The model is built from a ``LlamaConfig`` with random weights (nothing is downloaded),
``use_cache=False`` (a training forward has no use for a KV cache) and untied embedding
and head (Llama's default), so each raw stage owns its weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_accel.models.extras import import_extra

transformers = import_extra("transformers", "hf", "bench pipeline --model llama")
from transformers.masking_utils import create_causal_mask  # noqa: E402

__all__ = ["LlamaStage", "build_llama", "causal_lm_loss", "llama_loss"]

IGNORE_INDEX = -100  # transformers' label for "no loss here"


def build_llama(layers: int, hidden: int, vocab: int, seq: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A random-init ``LlamaForCausalLM``: ``layers`` decoder layers of width ``hidden`` with heads of 64 (at least 1),
    Llama's MLP ratio (intermediate = 2.6875 x hidden, rounded to 8), ``vocab`` tokens, ``seq`` positions; seeded."""
    heads = max(1, hidden // 64)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=8 * round(hidden * 2.6875 / 8),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=seq, use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype)


def llama_loss(net: nn.Module, input_ids: Tensor, labels: Tensor) -> Tensor:
    """What a user's ``training_step`` computes: the model's own forward and loss."""
    return net(input_ids=input_ids, labels=labels).loss


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """transformers' ``ForCausalLMLoss`` written out for the raw schedule's last stage: position ``t`` predicts token
    ``t + 1`` (labels padded with the ignored index and shifted left), mean over the predicted tokens.
    logits: (B, T, V); labels: (B, T). Unlike transformers it keeps the logits' dtype (transformers upcasts to float32)."""
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # (B, T)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), shifted.reshape(-1), ignore_index=IGNORE_INDEX)


class LlamaStage(nn.Module):
    """Decoder layers ``start .. stop - 1`` of a ``LlamaForCausalLM`` as one raw pipeline stage.

    The first stage (``start == 0``) takes the token ids ``(B, T)`` and embeds them; a later
    stage takes the hidden states ``(B, T, hidden)`` the previous one sent. The last stage
    (``stop`` = the model's layer count) ends with the final norm and the head and returns
    the logits ``(B, T, vocab)``; the others return hidden states. The modules are the
    model's own (not copies), so a stage trains the model's weights.
    """

    def __init__(self, net: nn.Module, start: int, stop: int) -> None:
        super().__init__()
        body = net.model
        count = len(body.layers)
        if not 0 <= start < stop <= count:
            raise ValueError(f"stage layers {start}..{stop - 1} are not within the model's {count} decoder layers")
        self.config = net.config
        self.embed_tokens = body.embed_tokens if start == 0 else None
        self.layers = nn.ModuleList(body.layers[start:stop])
        self.rotary_emb = body.rotary_emb  # buffers only (inv_freq): no weights shared between stages
        self.norm, self.lm_head = (body.norm, net.lm_head) if stop == count else (None, None)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x  # (B, T, hidden)
        position_ids = torch.arange(hidden.size(1), device=hidden.device).unsqueeze(0)  # (1, T)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)  # cos, sin: (1, T, head_dim)
        mask: Any = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None, position_ids=position_ids
        )  # None under sdpa (it applies causality itself); a (1, 1, T, T) mask under eager attention
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        if self.lm_head is None:
            return hidden
        return self.lm_head(self.norm(hidden))  # (B, T, vocab)
