"""RouterCarry in one process: the carried sums finish to transformers' own router loss, and models it cannot carry.

The split across ranks (each stage adding its layers' sums to the previous stage's) is tested end to end on 2 ranks in
``tests/strategies/test_gpipe_distributed_semantics.py::test_the_router_loss_covers_every_layer_on_every_rank_per_micro_batch``."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.pipeline.router_carry import RouterCarry

transformers = pytest.importorskip("transformers")


def mixtral(router_logits: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        output_router_logits=router_logits))


@pytest.mark.parametrize("masked", [False, True])
def test_the_sums_of_every_layer_finish_to_transformers_loss_and_keep_the_router_gradient(masked: bool) -> None:
    net = mixtral()
    tokens = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, -4:] = 0
    kwargs = {"attention_mask": mask} if masked else {}
    expected = net(tokens, **kwargs).aux_loss
    carry = RouterCarry.of(net)
    assert carry is not None and carry.width == 9
    with carry.micro_batch(None, last=False, device=torch.device("cpu")) as first:  # as a first stage holding every layer
        hidden = net(tokens, **kwargs).logits
        sent = first.attach(hidden)
    assert sent[0] is hidden and sent[1].shape == (9,) and sent[1].requires_grad
    assert float(sent[1][-1].detach()) == (3 * mask.sum().item() if masked else 3 * 30)  # tokens, once per layer
    finished = carry._loss(sent[1], torch.device("cpu"))  # what a last stage holding no router layer returns
    torch.testing.assert_close(finished, expected, rtol=0, atol=0)
    finished.backward()
    assert all(layer.mlp.gate.weight.grad is not None for layer in net.model.layers)  # through the carried sums
    carry.remove()


def test_a_model_without_the_router_loss_carries_nothing() -> None:
    assert RouterCarry.of(mixtral(router_logits=False)) is None


def test_a_router_loss_it_cannot_carry_is_refused_in_one_line() -> None:
    net = mixtral()
    del net.num_experts
    with pytest.raises(ValueError, match=r"^MixtralForCausalLM adds a router load-balancing loss .* set config.output_router_logits=False, or use gpipe in one process$"):
        RouterCarry.of(net)
