"""Step activations from shallow traces equal the full trace, and fall back to it when they cannot."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_accel.estimate import depth
from lightning_accel.estimate.activations import StepActivations, measure_step
from lightning_accel.estimate.depth import measure_step_by_depth
from lightning_accel.models.block_policy import find_blocks

transformers = pytest.importorskip("transformers", reason="needs the hf extra")


def _llama(layers: int, **config: Any) -> nn.Module:
    cfg = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=32, use_cache=False)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg, **config}))


def _traced(net: nn.Module, blocks_of: Any = None, checkpoint: bool = False) -> tuple[StepActivations, StepActivations, list[int]]:
    """The step by depth and in full, and the block counts the by-depth path traced."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 12))
    blocks = find_blocks(net, blocks_of or "auto", stacks="all")
    params = [p for p in net.parameters() if p.requires_grad]

    def step() -> torch.Tensor:
        return net(input_ids=ids, labels=ids).loss

    traced: list[int] = []

    def counting(step_fn: Any, modules: Any, *args: Any) -> StepActivations:
        traced.append(len(modules))
        return measure_step(step_fn, modules, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(depth, "measure_step", counting)
        by_depth = measure_step_by_depth(step, net, [(b.name, b.module) for b in blocks], params, None, checkpoint)
    full = measure_step(step, [b.module for b in blocks], params, None, checkpoint)
    return by_depth, full, traced


@pytest.mark.parametrize("checkpoint", [False, True], ids=["saved", "checkpointed"])
def test_nine_blocks_from_traces_of_four_five_and_six(checkpoint: bool) -> None:
    by_depth, full, traced = _traced(_llama(9), checkpoint=checkpoint)
    assert traced == [4, 5, 6]
    assert by_depth == full


def _bart() -> nn.Module:
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=8, decoder_layers=8, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
    ))


def _t5() -> nn.Module:
    # T5's second block is the first to receive the position bias: one of the ends the traces keep
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=8, num_decoder_layers=8, num_heads=2,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
    ))


@pytest.mark.parametrize("build", [_bart, _t5], ids=["bart", "t5"])
def test_an_encoder_decoder_extends_both_stacks(build: Any) -> None:
    by_depth, full, traced = _traced(build())
    assert traced == [8, 10, 12]  # two stacks cut together
    assert by_depth == full


def test_blocks_that_differ_in_shape_are_all_traced() -> None:
    # Qwen2-MoE's mlp_only_layers make layer 5 dense among experts: not one repeated block
    config = dict(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=8,
                  num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1, num_experts=2, num_experts_per_tok=1,
                  mlp_only_layers=[5], max_position_embeddings=32, use_cache=False)
    net = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**config))
    by_depth, full, traced = _traced(net)
    assert traced == [8]
    assert by_depth == full


def test_a_shallow_model_and_blocks_outside_a_list_are_traced_whole() -> None:
    _, _, traced = _traced(_llama(6))
    assert traced == [6]
    net = _llama(8)
    _, _, traced = _traced(net, blocks_of=lambda m: [m.model.layers[1], m.model.layers[3]])  # not whole stacks
    assert traced == [2]
