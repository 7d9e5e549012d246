"""GPT: closed-form parameter counts on the meta device, causality, init, errors, overfitting."""

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_accel.models.gpt import GPT, GPT_PRESETS


@pytest.fixture(autouse=True)
def seed() -> None:
    torch.manual_seed(0)


def gpt_param_count(V: int, C: int, L: int, d: int, *, bias: bool = True, tied: bool = True) -> int:
    """GPT-2 parameters by hand.

    Per block, with biases: ln1 2d + c_attn (3d^2 + 3d) + attn c_proj (d^2 + d) + ln2 2d
    + c_fc (4d^2 + 4d) + mlp c_proj (4d^2 + d) = 12d^2 + 13d. Without biases the
    LayerNorms keep only their weight: 12d^2 + 2d. Around the blocks: token table V*d,
    position table C*d, ln_f (2d or d), and an untied head adds V*d (it has no bias).
    """
    per_block = 12 * d * d + (13 * d if bias else 2 * d)
    ln_f = 2 * d if bias else d
    head = 0 if tied else V * d
    return V * d + C * d + L * per_block + ln_f + head


def meta_gpt(*args, **kwargs) -> GPT:
    with torch.device("meta"):
        return GPT(*args, **kwargs)


def test_gpt2_small_matches_published_count() -> None:
    net = meta_gpt("gpt2", vocab_size=50257)
    assert next(net.parameters()).is_meta  # nothing was allocated
    # 124,439,808: GPT-2 small as published (HF `gpt2`), tied embeddings, context 1024
    assert net.num_parameters() == 124_439_808
    assert gpt_param_count(V=50257, C=1024, L=12, d=768) == 124_439_808


def test_gpt2_xl_closed_form() -> None:
    net = meta_gpt("gpt2-xl", vocab_size=50257)
    expected = gpt_param_count(V=50257, C=1024, L=48, d=1600)
    assert net.num_parameters() == expected
    assert expected == pytest.approx(1.558e9, rel=1e-3)


@pytest.mark.parametrize("preset", list(GPT_PRESETS))
def test_every_preset_matches_closed_form(preset: str) -> None:
    size = GPT_PRESETS[preset]
    net = meta_gpt(preset, vocab_size=256)
    assert len(net.blocks) == size.n_layer
    assert net.num_parameters() == gpt_param_count(V=256, C=size.block_size, L=size.n_layer, d=size.n_embd)


def test_exclude_embeddings_counts_blocks_and_final_norm() -> None:
    net = meta_gpt("gpt2", vocab_size=50257)
    assert net.num_parameters(exclude_embeddings=True) == 12 * (12 * 768**2 + 13 * 768) + 2 * 768


@pytest.mark.parametrize(("bias", "tied"), [(False, True), (True, False), (False, False)])
def test_bias_and_tying_variants_match_closed_form(bias: bool, tied: bool) -> None:
    net = meta_gpt("tiny", vocab_size=300, bias=bias, tie_weights=tied)
    assert net.num_parameters() == gpt_param_count(V=300, C=128, L=4, d=128, bias=bias, tied=tied)
    assert (net.post.lm_head.weight is net.pre.wte.weight) == tied


def test_overrides_replace_preset_fields() -> None:
    net = meta_gpt("gpt2", vocab_size=100, n_layer=2, block_size=64)
    assert (len(net.blocks), net.block_size, net.n_embd, net.n_head) == (2, 64, 768, 12)
    assert net.pre.wpe.weight.shape == (64, 768)


def test_logits_shape() -> None:
    net = GPT("tiny", vocab_size=97, n_layer=2)
    assert net(torch.randint(0, 97, (3, 17))).shape == (3, 17, 97)


def test_causal_future_tokens_do_not_change_past_logits() -> None:
    net = GPT("tiny", vocab_size=64, n_layer=2, n_embd=64).eval()
    idx = torch.randint(0, 64, (2, 12))
    t = 5
    changed = idx.clone()
    changed[:, t + 1] = (idx[:, t + 1] + 1) % 64
    a, b = net(idx), net(changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6)
    # the change must reach later positions, else the comparison above proves nothing
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :], atol=1e-4)


def test_attention_matches_plain_masked_softmax() -> None:
    net = GPT("tiny", vocab_size=16, n_layer=1, n_embd=32, n_head=4).eval()
    attn, x = net.blocks[0].attn, torch.randn(2, 7, 32)
    q, k, v = attn.c_attn(x).split(32, dim=2)
    q, k, v = (z.view(2, 7, 4, 8).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
    scores = q @ k.transpose(-2, -1) / math.sqrt(8)  # (B, nh, T, T)
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, 32)
    torch.testing.assert_close(attn(x), attn.c_proj(y), rtol=1e-5, atol=1e-6)


def test_gpt2_init_scales_residual_projections() -> None:
    net = GPT("tiny", vocab_size=256, n_layer=8, n_embd=256, n_head=4)
    block = net.blocks[3]
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attn.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)
    assert torch.count_nonzero(block.mlp.c_fc.bias) == 0


def test_initial_loss_is_near_uniform() -> None:
    # small init -> near-uniform predictions -> cross-entropy close to ln(V). Targets are
    # drawn independently: with tied weights the untrained net already favours its input token.
    net = GPT("tiny", vocab_size=256)
    idx, targets = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
    loss = F.cross_entropy(net(idx).flatten(0, 1), targets.flatten())
    assert loss.item() == pytest.approx(math.log(256), abs=0.1)


def test_few_adam_steps_overfit_one_batch() -> None:
    net = GPT("tiny", vocab_size=64, n_layer=2, n_embd=64, block_size=32)
    x = torch.randint(0, 64, (4, 33))
    inputs, targets = x[:, :-1], x[:, 1:]
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = F.cross_entropy(net(inputs).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]


def test_dropout_is_active_only_in_training() -> None:
    net = GPT("tiny", vocab_size=32, n_layer=1, n_embd=32, dropout=0.5)
    idx = torch.randint(0, 32, (2, 8))
    assert not torch.equal(net(idx), net(idx))
    net.eval()
    assert torch.equal(net(idx), net(idx))


def test_too_long_sequence_is_rejected() -> None:
    net = GPT("tiny", vocab_size=32, n_layer=1, block_size=8)
    with pytest.raises(ValueError, match=r"sequence length 9 exceeds the model's block_size 8"):
        net(torch.zeros(1, 9, dtype=torch.long))


def test_indivisible_heads_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"n_embd=100 is not divisible by n_head=3"):
        GPT("tiny", n_embd=100, n_head=3)


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown GPT preset 'gpt3' \(known: tiny, small, gpt2, .*gpt2-xl\)"):
        GPT("gpt3")


@pytest.mark.parametrize(("kwargs", "message"), [({"n_layer": 0}, "n_layer must be >= 1, got 0"), ({"dropout": 1.0}, r"dropout must be in \[0, 1\), got 1.0")])
def test_bad_sizes_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPT("tiny", **kwargs)
