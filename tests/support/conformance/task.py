"""The tiny model every conformance feature trains, its data, and what records a run: hooks and logger calls.

Float64 throughout, so two strategies that compute the same thing in another order (micro-batches, blocks streamed from
the host, gradients reduced over ranks) agree to ~1e-15 and any real difference stands out. The network has the shape
our strategies look for: an input layer, a repeated stack of four blocks (what L2L streams and GPipe cuts into stages)
and a head; no dropout and no BatchNorm, whose micro-batch semantics other tests own.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

IN, WIDTH, OUT, DEPTH = 4, 8, 2, 4
BATCH = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    """(B, IN) -> (B, OUT): input layer, ``DEPTH`` blocks, head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Task(pl.LightningModule):
    """A regression task as a Lightning user writes it: MSE, ``self.log`` of the loss, SGD with momentum (so checkpoints
    carry optimizer state). Features subclass it and override what they exercise."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net().double()
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.trainable(), lr=self.lr, momentum=0.9)

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, IN, generator=g, dtype=torch.float64), torch.randn(n, OUT, generator=g, dtype=torch.float64))


def loader(n: int = 16, seed: int = 1, batch_size: int = BATCH) -> DataLoader:
    """``n`` samples in order (Lightning's DistributedSampler shards them between DDP ranks)."""
    return DataLoader(dataset(n, seed), batch_size=batch_size)


def val_loader(seed: int = 2) -> DataLoader:
    return loader(8, seed)


HOOKS = sorted(n for n in vars(Callback) if n.startswith("on_")) + ["setup", "teardown"]


class HookRecorder(Callback):
    """Every callback hook Lightning calls, by name (``setup``/``teardown`` with their stage), in order: what a user's
    callbacks see."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def counts(self) -> dict[str, int]:
        return dict(Counter(self.calls))


def _recording(name: str) -> Any:
    def hook(self: HookRecorder, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        stage = kwargs.get("stage", args[-1] if args else None)
        self.calls.append(f"{name}:{stage}" if name in ("setup", "teardown") else name)

    hook.__name__ = name
    return hook


for _name in HOOKS:
    setattr(HookRecorder, _name, _recording(_name))


class RecordingLogger(Logger):
    """A logger that keeps what Lightning hands it, as Lightning's own loggers do on global rank 0 only."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("hyperparams", {k: str(v) for k, v in dict(vars(params) if hasattr(params, "__dict__") else params).items()}))

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append(("metrics", step, dict(metrics)))
