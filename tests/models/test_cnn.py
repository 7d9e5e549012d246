"""ResNet: output shapes, parameter counts by hand, stage layout, errors."""

import pytest
import torch
from torch import nn

from lightning_accel.models.cnn import RESNET_PRESETS, ResidualBlock, ResNet


@pytest.fixture(autouse=True)
def seed() -> None:
    torch.manual_seed(0)


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def resnet_param_count(in_channels: int, widths: tuple[int, ...], per_stage: int, num_classes: int) -> int:
    """Closed form: 3x3 convs without bias, BN = 2 per channel, projection on width/stride change."""
    total = 9 * in_channels * widths[0] + 2 * widths[0]  # stem conv + BN
    prev = widths[0]
    for stage, w in enumerate(widths):
        for i in range(per_stage):
            total += 9 * prev * w + 2 * w + 9 * w * w + 2 * w  # conv1 + bn1 + conv2 + bn2
            if (stage > 0 and i == 0) or prev != w:
                total += prev * w + 2 * w  # 1x1 projection + BN
            prev = w
    return total + prev * num_classes + num_classes  # Linear


def test_small_explicit_config_count_by_hand() -> None:
    net = ResNet(in_channels=3, num_classes=5, widths=(4, 8), blocks_per_stage=1)
    stem = 3 * 4 * 9 + 2 * 4  # 108 + 8
    stage1 = (4 * 4 * 9 + 2 * 4) * 2  # two 3x3 convs 4->4, two BNs, identity shortcut: 304
    stage2 = 4 * 8 * 9 + 2 * 8 + 8 * 8 * 9 + 2 * 8 + 4 * 8 + 2 * 8  # 288+16+576+16 + 1x1 proj 32+16: 944
    head = 8 * 5 + 5  # 45
    assert stem + stage1 + stage2 + head == 1409
    assert n_params(net) == 1409


def test_resnet18_matches_published_cifar_count() -> None:
    # 11,173,962: the CIFAR ResNet-18 (3x3 stem, 10 classes) of the common reference implementations
    assert n_params(ResNet("resnet18")) == 11_173_962
    assert resnet_param_count(3, (64, 128, 256, 512), 2, 10) == 11_173_962


@pytest.mark.parametrize("preset", list(RESNET_PRESETS))
def test_presets_match_closed_form(preset: str) -> None:
    widths, per_stage = RESNET_PRESETS[preset]
    with torch.device("meta"):
        net = ResNet(preset, in_channels=1, num_classes=7)
    assert len(net.blocks) == len(widths) * per_stage
    assert n_params(net) == resnet_param_count(1, widths, per_stage, 7)


@pytest.mark.parametrize(("shape", "in_channels"), [((2, 3, 32, 32), 3), ((3, 1, 8, 12), 1), ((1, 3, 9, 31), 3)])
def test_logits_shape_for_any_input_size(shape: tuple[int, ...], in_channels: int) -> None:
    net = ResNet("resnet-tiny", in_channels=in_channels, num_classes=4).eval()
    assert net(torch.randn(shape)).shape == (shape[0], 4)


def test_stages_halve_resolution_and_project_shortcuts() -> None:
    net = ResNet("resnet-small").eval()
    x, sizes = net.pre(torch.randn(1, 3, 16, 16)), []
    for block in net.blocks:
        x = block(x)
        sizes.append(tuple(x.shape[1:]))
    assert sizes == [(32, 16, 16), (32, 16, 16), (64, 8, 8), (64, 8, 8), (128, 4, 4), (128, 4, 4)]
    projected = [not isinstance(b.shortcut, nn.Identity) for b in net.blocks]
    assert projected == [False, False, True, False, True, False]


def test_identity_block_with_zeroed_branch_is_relu_of_input() -> None:
    block = ResidualBlock(4, 4).eval()
    nn.init.zeros_(block.bn2.weight)  # residual branch -> 0, so out = relu(x + 0)
    x = torch.randn(2, 4, 5, 5)
    torch.testing.assert_close(block(x), torch.relu(x))


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown ResNet preset 'resnet50' \(known: resnet-tiny, resnet-small, resnet18\)"):
        ResNet("resnet50")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"widths": ()}, r"widths must be a non-empty sequence of positive channel counts, got \(\)"),
        ({"widths": (8, 0)}, r"got \(8, 0\)"),
        ({"blocks_per_stage": 0}, "blocks_per_stage must be >= 1, got 0"),
        ({"num_classes": 0}, "num_classes must be >= 1, got 0"),
    ],
)
def test_bad_shapes_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ResNet(**kwargs)
