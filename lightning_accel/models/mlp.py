"""A residual MLP of identical blocks.

Every block has the same shape and cost, which makes this the clean benchmark for
pipeline parallelism (any balanced partition of the blocks is equally loaded) and for
offload (every block moves the same number of bytes). Split into ``pre`` / ``blocks`` /
``post`` (see :mod:`lightning_accel.models.blocks`).
"""

from __future__ import annotations

from torch import Tensor, nn


class MLPBlock(nn.Module):
    """Pre-LN residual feed-forward: x + drop(fc2(gelu(fc1(norm(x))))). (..., H) -> (..., H)."""

    def __init__(self, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.drop(self.fc2(self.act(self.fc1(self.norm(x)))))


class MLP(nn.Module):
    """(..., in_features) -> (..., out_features) through ``depth`` identical residual blocks of width ``hidden``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        hidden: int = 256,
        depth: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features), ("hidden", hidden)):
            if value < 1:
                raise ValueError(f"MLP {name} must be >= 1, got {value}")
        if depth < 1:
            raise ValueError(f"MLP depth must be >= 1 (the block strategies need a block), got {depth}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.pre = nn.Linear(in_features, hidden)
        self.blocks = nn.ModuleList(MLPBlock(hidden, dropout) for _ in range(depth))
        self.post = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, out_features))

    def forward(self, x: Tensor) -> Tensor:
        x = self.pre(x)  # (..., hidden)
        for block in self.blocks:
            x = block(x)  # (..., hidden)
        return self.post(x)  # (..., out_features)
