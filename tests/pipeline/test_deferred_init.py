"""materialize: a model built on meta, initialized in part, equals the same part of the whole model initialized at once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_accel.models.gpt import GPT
from lightning_accel.pipeline.deferred_init import has_meta_tensors, materialize


def _zoo() -> nn.Module:
    return GPT(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(cfg)


def _litgpt() -> nn.Module:
    litgpt = pytest.importorskip("litgpt")
    return litgpt.GPT(litgpt.Config(block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=4, n_head=4, n_embd=32))


BUILDS = {"gpt": (_zoo, "blocks"), "llama": (_llama, "model.layers"), "litgpt": (_litgpt, "transformer.h")}


@pytest.mark.parametrize("name", BUILDS)
def test_a_part_materialized_alone_equals_that_part_of_the_whole(name):
    build, blocks = BUILDS[name]
    with torch.device("meta"):
        whole, part = build(), build()
    assert materialize(whole, 5) > 0 and not has_meta_tensors(whole)
    layers = part.get_submodule(blocks)
    away = {id(t) for k in (1, 3) for t in (*layers[k].parameters(), *layers[k].buffers())}  # another rank's blocks
    materialize(part, 5, keep=lambda t: id(t) not in away)
    for (n, a), (_, b) in zip(whole.state_dict(keep_vars=True).items(), part.state_dict(keep_vars=True).items()):
        if id(b) in away or b.is_meta:
            assert b.is_meta and any(n.startswith(f"{blocks}.{k}.") for k in (1, 3)), n
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), n
    for (n, a), (_, b) in zip(whole.named_buffers(), part.named_buffers()):  # non-persistent: rotary tables
        assert b.is_meta or torch.equal(a, b), n
    assert not any(torch.isnan(t).any() for t in whole.state_dict().values() if t.is_floating_point())


def test_the_models_own_initializer_and_ties_survive():
    with torch.device("meta"):
        gpt = _zoo()
    materialize(gpt, 0)
    assert gpt.post.lm_head.weight is gpt.pre.wte.weight  # tied stays tied
    # GPT-2's scaled residual projections (the model's _init_weights), torch's LayerNorm defaults (reset_parameters)
    residual = torch.cat([b.attn.c_proj.weight.flatten() for b in gpt.blocks])
    assert abs(residual.std().item() - 0.02 / (2 * 4) ** 0.5) < 0.002
    assert abs(gpt.blocks[0].attn.c_attn.weight.std().item() - 0.02) < 0.002
    assert torch.equal(gpt.blocks[0].ln1.weight, torch.ones(32))
    # another seed, other weights; the same seed, the same
    with torch.device("meta"):
        again, other = _zoo(), _zoo()
    materialize(again, 0)
    materialize(other, 1)
    assert torch.equal(again.pre.wte.weight, gpt.pre.wte.weight)
    assert not torch.equal(other.pre.wte.weight, gpt.pre.wte.weight)


def test_dtype_of_the_meta_model_is_kept():
    with torch.device("meta"):
        net = _litgpt().double()
    materialize(net, 0)
    assert {t.dtype for t in (*net.parameters(), *net.buffers())} == {torch.float64}


class NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))


def test_a_tensor_nothing_initializes_is_refused_naming_the_module():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(3, 3), NoInit())
    with pytest.raises(ValueError, match=r"cannot initialize '1' \(NoInit\) .*no reset_parameters\(\) for \['gain'\]; give"):
        materialize(net, 0)
