"""A small block network the single-process pipeline tests share: a stem, four counting blocks, a head."""

import torch
from torch import nn


class Counting(nn.Module):
    """A block that counts its forward calls, to see re-materialization happen."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(3, 8)
        self.layers = nn.ModuleList(Counting(8) for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
