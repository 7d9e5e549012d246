"""The block protocol: every zoo net's forward is exactly pre -> blocks -> post."""

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from lightning_accel.models import GPT, MLP, BlockNetwork, GPTBlock, MLPBlock, ResidualBlock, ResNet
from lightning_accel.models.blocks import block_classes, require_block_network, run_blocks

# name -> (build the net, make an input for it, its block class)
ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[[], Tensor], type[nn.Module]]] = {
    "gpt": (lambda: GPT("tiny", vocab_size=50, n_layer=3, n_embd=32), lambda: torch.randint(0, 50, (2, 9)), GPTBlock),
    "resnet": (lambda: ResNet("resnet-tiny", num_classes=5), lambda: torch.randn(2, 3, 12, 10), ResidualBlock),
    "mlp": (lambda: MLP(6, 4, hidden=16, depth=3), lambda: torch.randn(5, 6), MLPBlock),
}


@pytest.fixture(autouse=True)
def seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("name", list(ZOO))
def test_forward_is_exactly_pre_blocks_post(name: str) -> None:
    build, make_input, _ = ZOO[name]
    net, x = build().eval(), make_input()
    h = net.pre(x)
    for block in net.blocks:
        h = block(h)
    assert torch.equal(net.post(h), net(x))
    assert torch.equal(run_blocks(net, x), net(x))


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_nets_satisfy_protocol(name: str) -> None:
    build, _, block_cls = ZOO[name]
    net = build()
    assert isinstance(net, BlockNetwork)
    assert require_block_network(net, "test") is net
    assert block_classes(net) == (block_cls,)
    # every parameter lives in exactly one of pre / blocks / post (tied ones may be in two)
    parts = {id(p) for part in (net.pre, net.blocks, net.post) for p in part.parameters()}
    assert parts == {id(p) for p in net.parameters()}


def test_block_classes_keeps_first_appearance_order() -> None:
    net = MLP(2, 2, hidden=4, depth=1)
    net.blocks.append(nn.Identity())
    net.blocks.append(MLPBlock(4))
    assert block_classes(net) == (MLPBlock, nn.Identity)


def test_plain_module_is_not_a_block_network() -> None:
    net = nn.Sequential(nn.Linear(2, 2))
    assert not isinstance(net, BlockNetwork)
    with pytest.raises(TypeError, match=r"the l2l strategy needs a block network, but Sequential has no nn.Module `pre`"):
        require_block_network(net, "the l2l strategy")


def test_blocks_must_be_a_non_empty_module_list() -> None:
    net = MLP(2, 2, hidden=4, depth=1)
    net.blocks = nn.Sequential(*net.blocks)
    with pytest.raises(TypeError, match=r"MLP.blocks is a Sequential, not an nn.ModuleList"):
        require_block_network(net, "gpipe")
    net.blocks = nn.ModuleList()
    with pytest.raises(TypeError, match=r"MLP.blocks is empty"):
        require_block_network(net, "gpipe")
