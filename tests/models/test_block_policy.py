"""Block selection by class, 'auto' and callable, on zoo and hand-built models."""

from __future__ import annotations

import pytest
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


def test_no_blocks_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"no blocks found in Linear under 'auto'.*blocks=\['GPTBlock'\]"):
        find_blocks(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"block class 'GPTBlok' is not used in GPT .*GPTBlock"):
        find_blocks(GPT("tiny"), ["GPTBlok"])
    with pytest.raises(ValueError, match=r"returned modules that are not in the model"):
        find_blocks(GPT("tiny"), lambda m: [nn.Linear(1, 1)])
