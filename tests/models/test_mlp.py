"""MLP: shapes, closed-form parameter count, identical residual blocks, errors."""

import pytest
import torch
from torch import nn

from lightning_accel.models.mlp import MLP, MLPBlock


@pytest.fixture(autouse=True)
def seed() -> None:
    torch.manual_seed(0)


def test_param_count_closed_form() -> None:
    i, o, h, depth = 7, 3, 32, 5
    net = MLP(i, o, hidden=h, depth=depth)
    pre = i * h + h
    block = 2 * h + 2 * (h * h + h)  # LayerNorm + two Linear(h, h)
    post = 2 * h + h * o + o  # LayerNorm + Linear(h, o)
    assert sum(p.numel() for p in net.parameters()) == pre + depth * block + post


@pytest.mark.parametrize("shape", [(4, 7), (2, 5, 7)])
def test_maps_last_dimension(shape: tuple[int, ...]) -> None:
    assert MLP(7, 3, hidden=16, depth=2)(torch.randn(shape)).shape == (*shape[:-1], 3)


def test_blocks_are_identical_in_shape() -> None:
    net = MLP(7, 3, hidden=16, depth=4)
    assert len(net.blocks) == 4 and all(type(b) is MLPBlock for b in net.blocks)
    shapes = [[p.shape for p in b.parameters()] for b in net.blocks]
    assert all(s == shapes[0] for s in shapes)


def test_block_is_residual_around_its_branch() -> None:
    block = MLPBlock(8)
    x = torch.randn(3, 8)
    branch = block.fc2(nn.functional.gelu(block.fc1(nn.functional.layer_norm(x, (8,)))))
    torch.testing.assert_close(block(x), x + branch)
    nn.init.zeros_(block.fc2.weight)
    nn.init.zeros_(block.fc2.bias)
    assert torch.equal(block(x), x)


def test_learns_a_linear_map() -> None:
    net, target = MLP(4, 2, hidden=32, depth=2), nn.Linear(4, 2)
    x = torch.randn(64, 4)
    y = target(x).detach()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    first = nn.functional.mse_loss(net(x), y).item()
    for _ in range(30):
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"depth": 0}, "MLP depth must be >= 1 .*, got 0"),
        ({"hidden": 0}, "MLP hidden must be >= 1, got 0"),
        ({"dropout": -0.1}, r"dropout must be in \[0, 1\), got -0.1"),
    ],
)
def test_bad_sizes_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MLP(4, 2, **kwargs)
