"""A user script whose batches are not all a multiple of ``chunks``, on 2 CPU processes (gloo).

Run as ``python ragged_worker.py OUT_DIR``: Lightning's launcher starts rank 1 from it. First
34 samples in batches of 8 with chunks=4: the last batch (2) is left out, as ``drop_last=True``
would; rank 0 saves the trained weights (``weights.pt``). Then a loader with batch_size=6: every
batch would be skipped, so the fit is refused; each rank saves the error it got
(``refused-rank{r}.txt``).
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import MLP
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = MLP(5, 3, hidden=8, depth=2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g))


def trainer() -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=DistributedGPipeStrategy(chunks=4, timeout=60), max_epochs=1,
        precision="64-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    t = trainer()
    t.fit(Regressor(), DataLoader(data(34), batch_size=8))
    t.save_checkpoint(os.path.join(out, "ragged.ckpt"))
    try:
        trainer().fit(Regressor(), DataLoader(data(36), batch_size=6))
        message = "trained"
    except ValueError as err:
        message = str(err)
    with open(os.path.join(out, f"refused-rank{t.global_rank}.txt"), "w") as f:
        f.write(message)


if __name__ == "__main__":
    main()
