"""A user script training with ``DistributedGPipeStrategy(balance="by_time")`` on 2 CPU processes (gloo).

Run as ``python gpipe_by_time_worker.py OUT_DIR``: Lightning's subprocess launcher re-runs
this script for rank 1, exactly as for DDP. The model's first block costs ~100 times the
others' time at the same bytes, so ``by_time`` and ``by_size`` split it differently. Every rank
saves ``by_time-rank{r}.pt``: the block times the strategy used, its balance, the loss each
step returned, the parameters resident on it after fit and ``val/loss`` from the validation
at the end of fit. The model summary is on (Lightning's default): it would run
``example_input_array`` through the split module, and the strategy makes it summarize without.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_accel.models import MLP
from lightning_accel.models.mlp import MLPBlock
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from tests.support.gpipe_models import HeldAtTrainEnd

CHUNKS, REPEATS = 2, 100


class Repeated(nn.Module):
    """One ``MLPBlock`` applied ``times`` times: the bytes of one block, the time of ``times``."""

    def __init__(self, hidden: int, times: int) -> None:
        super().__init__()
        self.block, self.times = MLPBlock(hidden), times

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(self.times):
            x = self.block(x)
        return x


class UnevenRegressor(pl.LightningModule):
    """A zoo MLP of 4 blocks whose first is :class:`Repeated` (no dropout: micro-batches draw other masks than the
    whole batch, so no pipeline matches plain training with it; the timing's RNG hygiene has a test of its own)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = MLP(5, 3, hidden=16, depth=4)
        self.net.blocks[0] = Repeated(16, REPEATS)
        self.example_input_array = torch.randn(8, 5, dtype=torch.float64)  # 64-true: ModelSummary runs it as is

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g))


def train_loader(as_lightning_distributes_it: bool = False) -> DataLoader:
    """32 samples in batches of 8; ``as_lightning_distributes_it``: the order the pipeline's ranks see (one replica)."""
    dataset = data(32, 1)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True) if as_lightning_distributes_it else None
    return DataLoader(dataset, batch_size=8, sampler=sampler)


def val_loader() -> DataLoader:
    return DataLoader(data(12, 2), batch_size=8)  # batches of 8 and 4


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.returned: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.returned.append(float(outputs["loss"]))


def main(out: str) -> None:
    torch.set_num_threads(1)
    model, losses, held = UnevenRegressor(), Losses(), HeldAtTrainEnd()
    # the blocks are of two classes (Repeated, then MLPBlocks): "auto" looks for one class, so name them
    strategy = DistributedGPipeStrategy(chunks=CHUNKS, balance="by_time", timeout=60, blocks=lambda net: list(net.blocks))
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=2, strategy=strategy, precision="64-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, callbacks=[losses, held],
    )
    trainer.fit(model, train_loader(), val_loader())
    assert strategy.pipeline is None  # torn down; the balance stays on the split module's layout
    torch.save(
        {"times": strategy._block_times, "balance": list(getattr(model, "_gpipe_distributed_layout")[2]),
         "returned": losses.returned, "val": float(trainer.callback_metrics["val/loss"]),
         "resident": held.held},
        os.path.join(out, f"by_time-rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
