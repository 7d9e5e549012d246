"""A ResNet-style image classifier.

A CIFAR-style ResNet (He et al., 2016): a 3x3 stride-1 stem (no 7x7 conv or max-pool,
so 8x8 inputs still work), then stages of BasicBlocks; every stage after the first
halves the resolution in its first block. Split into ``pre`` / ``blocks`` / ``post``
(see :mod:`lightning_accel.models.blocks`). The ``resnet18`` preset is the widely used
CIFAR ResNet-18 (11,173,962 parameters at 10 classes), not torchvision's ImageNet one.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

# name -> (stage widths, blocks per stage)
RESNET_PRESETS: dict[str, tuple[tuple[int, ...], int]] = {
    "resnet-tiny": ((16, 32, 64), 1),
    "resnet-small": ((32, 64, 128), 2),
    "resnet18": ((64, 128, 256, 512), 2),
}


class ResidualBlock(nn.Module):
    """BasicBlock: relu(bn(conv(relu(bn(conv(x))))) + shortcut(x)). (B, C_in, H, W) -> (B, C_out, H/s, W/s).

    The shortcut is the identity unless the block changes width or resolution; then a
    strided 1x1 conv + BN projects ``x`` to the new shape so the sum is defined.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        # convs carry no bias: the following BN's shift would cancel it
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Image classifier: (B, in_channels, H, W) with H, W >= 8 -> logits (B, num_classes).

    ``preset`` names a shape in :data:`RESNET_PRESETS`; ``widths`` (one channel count per
    stage) and ``blocks_per_stage`` override it.
    """

    def __init__(
        self,
        preset: str = "resnet-tiny",
        *,
        in_channels: int = 3,
        num_classes: int = 10,
        widths: Sequence[int] | None = None,
        blocks_per_stage: int | None = None,
    ) -> None:
        super().__init__()
        if preset not in RESNET_PRESETS:
            raise ValueError(
                f"unknown ResNet preset {preset!r} (known: {', '.join(RESNET_PRESETS)}); "
                "pass widths/blocks_per_stage to override a known preset instead"
            )
        preset_widths, preset_blocks = RESNET_PRESETS[preset]
        self.widths = tuple(preset_widths if widths is None else widths)
        self.blocks_per_stage = preset_blocks if blocks_per_stage is None else blocks_per_stage
        if not self.widths or min(self.widths) < 1:
            raise ValueError(f"widths must be a non-empty sequence of positive channel counts, got {self.widths}")
        if self.blocks_per_stage < 1:
            raise ValueError(f"blocks_per_stage must be >= 1, got {self.blocks_per_stage}")
        for name, value in (("in_channels", in_channels), ("num_classes", num_classes)):
            if value < 1:
                raise ValueError(f"ResNet {name} must be >= 1, got {value}")

        self.pre = nn.Sequential(
            nn.Conv2d(in_channels, self.widths[0], 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(self.widths[0]),
            nn.ReLU(inplace=True),
        )
        blocks: list[nn.Module] = []
        in_width = self.widths[0]
        for stage, width in enumerate(self.widths):
            for i in range(self.blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1  # downsample entering stages 2..n
                blocks.append(ResidualBlock(in_width, width, stride))
                in_width = width
        self.blocks = nn.ModuleList(blocks)
        self.post = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),  # (B, C, H', W') -> (B, C, 1, 1): any input size works
            nn.Flatten(),  # (B, C)
            nn.Linear(in_width, num_classes),
        )
        self._init_weights()

    def _init_weights(self) -> None:
        # He init for convs feeding ReLUs (torchvision's choice); BN starts as identity
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pre(x)  # (B, widths[0], H, W)
        for block in self.blocks:
            x = block(x)  # (B, width, H / 2**stage, W / 2**stage)
        return self.post(x)  # (B, num_classes)
