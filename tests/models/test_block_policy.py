"""Block selection by class, 'auto' and callable, on zoo and hand-built models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_accel.models import GPT, MLP, GPTBlock
from lightning_accel.models.block_policy import find_blocks, resident_modules


class Custom(nn.Module):
    """Not a BlockNetwork: blocks in a dict-like layout, an unrelated Sequential of mixed types."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(4, 8), nn.ReLU())  # mixed classes: never 'auto'
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x) + x
        return self.head(x)


def test_auto_finds_the_gpt_blocks() -> None:
    net = GPT("tiny")
    blocks = find_blocks(net, "auto")
    assert [b.name for b in blocks] == [f"blocks.{i}" for i in range(len(net.blocks))]
    assert all(b.module is m for b, m in zip(blocks, net.blocks))


def test_by_class_and_by_name_agree() -> None:
    net = GPT("tiny")
    assert [b.name for b in find_blocks(net, [GPTBlock])] == [b.name for b in find_blocks(net, ["GPTBlock"])]
    assert [b.name for b in find_blocks(net, "lightning_accel.models.GPTBlock")] == [f"blocks.{i}" for i in range(4)]


def test_outermost_only() -> None:
    net = Custom()
    # nn.Sequential matches both the stem and each layer; nothing inside a match is taken again
    names = [b.name for b in find_blocks(net, [nn.Sequential])]
    assert names == ["stem", "layers.0", "layers.1", "layers.2"]


def test_auto_on_a_custom_model_and_resident_parameters() -> None:
    net = Custom()
    blocks = find_blocks(net)
    assert [b.name for b in blocks] == ["layers.0", "layers.1", "layers.2"]
    assert resident_modules(net, blocks) == ["stem.0.weight", "stem.0.bias", "head.weight", "head.bias"]


def test_callable_policy() -> None:
    net = MLP(4, 2, hidden=8, depth=3)
    blocks = find_blocks(net, lambda m: list(m.blocks)[::2])
    assert [b.name for b in blocks] == ["blocks.0", "blocks.2"]


def _mixed_layers(n: int = 4) -> list[nn.Module]:
    return [*(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(n)), nn.Linear(8, 2)]


def test_auto_takes_a_mixed_sequential_model_child_by_child() -> None:
    # the torchgpipe input: the model IS a Sequential of different layer classes
    net = nn.Sequential(*_mixed_layers())
    blocks = find_blocks(net)
    assert [b.name for b in blocks] == ["0", "1", "2", "3", "4"]
    assert all(b.module is m for b, m in zip(blocks, net))


class Wrapped(nn.Module):
    """A mixed Sequential as the model's largest container; inside each layer a same-class list (a detail)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.net = nn.Sequential(nn.Linear(4, 8), Heads(), Heads(), nn.GELU(), nn.Linear(8, 2))


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(8, 2) for _ in range(4)])  # longer than net, but inside one layer


def test_auto_takes_the_largest_mixed_sequential_over_a_list_inside_one_of_its_layers() -> None:
    assert [b.name for b in find_blocks(Wrapped())] == [f"net.{i}" for i in range(5)]
    assert [b.name for b in find_blocks(Wrapped().net)] == [str(i) for i in range(5)]  # the model itself


def test_auto_prefers_a_same_class_sequential_that_is_one_child_of_a_mixed_one() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # embed, the block stack, head: the stack splits finer than the three children
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))), nn.Linear(8, 2))

    assert [b.name for b in find_blocks(Outer())] == ["net.1.0", "net.1.1", "net.1.2"]
    assert [b.name for b in find_blocks(Outer().net)] == ["1.0", "1.1", "1.2"]  # the same when it is the model


@pytest.mark.parametrize("maker", ["llama", "gpt2", "litgpt"])
def test_auto_on_real_models(maker: str) -> None:
    if maker == "litgpt":
        litgpt = pytest.importorskip("litgpt")
        cfg = litgpt.Config(block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=3, n_head=2, n_embd=16)
        net, expected = litgpt.GPT(cfg), [f"transformer.h.{i}" for i in range(3)]
    else:
        transformers = pytest.importorskip("transformers")
        if maker == "llama":
            cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                           num_attention_heads=2, num_key_value_heads=1)
            net, expected = transformers.LlamaForCausalLM(cfg), [f"model.layers.{i}" for i in range(3)]
        else:
            cfg = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=3, n_head=2, n_positions=16)
            net, expected = transformers.GPT2LMHeadModel(cfg), [f"transformer.h.{i}" for i in range(3)]
    assert [b.name for b in find_blocks(net)] == expected


def test_no_blocks_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"no blocks found in Linear under 'auto'.*blocks=\['GPTBlock'\]"):
        find_blocks(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"candidates: none \(the model has no nn.ModuleList or nn.Sequential\)"):
        find_blocks(nn.Linear(2, 2))

    class OneLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(2, 2)])
            self.mixed = nn.ModuleList([nn.Linear(2, 2), nn.Tanh()])

    with pytest.raises(ValueError, match=r"candidates: layers \(ModuleList, 1 child\), mixed \(ModuleList, 2 children, mixed classes\); pass blocks="):
        find_blocks(OneLayer())
    shared = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    with pytest.raises(ValueError, match=r"blocks '0' and '1' are the same Sequential object.*build each layer separately"):
        find_blocks(nn.Sequential(*[shared] * 4, nn.Linear(8, 2)))
    with pytest.raises(ValueError, match=r"block class 'GPTBlok' is not used in GPT .*GPTBlock"):
        find_blocks(GPT("tiny"), ["GPTBlok"])
    with pytest.raises(ValueError, match=r"returned modules that are not in the model"):
        find_blocks(GPT("tiny"), lambda m: [nn.Linear(1, 1)])


class EncoderDecoder(nn.Module):
    """Two stacks of blocks of one class (as T5's encoder.block and decoder.block), small lists beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.ModuleList([nn.Embedding(16, 8) for _ in range(2)])  # per-codebook embeddings: not a stack
        self.encoder = nn.ModuleList([nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8)) for _ in range(2)])
        self.decoder = nn.ModuleList([nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8), nn.Linear(8, 8)) for _ in range(3)])
        self.heads = nn.ModuleList([nn.Linear(8, 2) for _ in range(2)])  # small: not a stack


def test_every_stack_of_an_encoder_decoder_only_when_asked() -> None:
    net = EncoderDecoder()
    assert [b.name for b in find_blocks(net)] == ["decoder.0", "decoder.1", "decoder.2"]  # a pipeline's one stack
    assert [b.name for b in find_blocks(net, stacks="all")] == ["encoder.0", "encoder.1", "decoder.0", "decoder.1", "decoder.2"]
    assert [b.name for b in find_blocks(GPT("tiny"), stacks="all")] == [f"blocks.{i}" for i in range(4)]  # one stack: the same
    with pytest.raises(ValueError, match=r"^stacks='both': use 'one'"):
        find_blocks(net, stacks="both")


@pytest.mark.parametrize("maker", ["t5", "bart"])
def test_every_stack_of_transformers_encoder_decoders(maker: str) -> None:
    transformers = pytest.importorskip("transformers")
    if maker == "t5":
        net = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4))
        want = ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1", "decoder.block.2"]
    else:
        net = transformers.BartForConditionalGeneration(transformers.BartConfig(
            vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64))
        want = ["model.encoder.layers.0", "model.encoder.layers.1", "model.decoder.layers.0", "model.decoder.layers.1"]
    assert [b.name for b in find_blocks(net, stacks="all")] == want
    assert len(find_blocks(net)) == int(want[-1][-1]) + 1  # a pipeline: the decoder alone, as before


def test_blocks_are_named_as_registered_and_auto_falls_back_to_children() -> None:
    from collections import OrderedDict

    named = nn.Sequential(OrderedDict(embed=nn.Embedding(4, 4), layer=nn.Sequential(OrderedDict(
        mlp_1=nn.Linear(4, 4), mlp_2=nn.Linear(4, 4), mlp_3=nn.Linear(4, 4)))))
    assert [b.name for b in find_blocks(named)] == ["layer.mlp_1", "layer.mlp_2", "layer.mlp_3"]
    assert [n for n, _ in named.named_modules()][3:] == ["layer.mlp_1", "layer.mlp_2", "layer.mlp_3"]  # the same names

    flat = nn.Module()
    flat.a, flat.act, flat.b = nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"no blocks found in Module under 'auto' \(.*nn.Sequential\); candidates: none"):
        find_blocks(flat)  # a pipeline's policy: no stack to cut
    assert [b.name for b in find_blocks(flat, children=True)] == ["a", "b"]  # L2L's: each child with parameters
    outer = nn.Module()
    outer.net = flat
    assert [b.name for b in find_blocks(outer, children=True)] == ["net.a", "net.b"]  # a wrapper is looked into
    with pytest.raises(ValueError, match=r"no blocks found in Linear under 'auto' \(.*else each child with parameters\)"):
        find_blocks(nn.Linear(2, 2), children=True)
