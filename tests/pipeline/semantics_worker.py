"""A user script for the pipeline's semantics under ``gpipe_distributed`` on 2 CPU processes (gloo), in float64.

Run as ``python semantics_worker.py OUT_DIR SECTIONS``: Lightning's launcher starts rank 1 from
it; SECTIONS is a comma-separated list of :data:`SECTIONS` names, every case of them one
``Trainer.fit`` in the same two processes (start-up paid once). After each fit rank 0 saves the
trained module's state (the whole model, gathered) as ``{case}.pt``, and every rank what its
fit raised as ``{case}-rank{r}.txt`` (``ok`` when nothing). The test computes the references
(plain Lightning, or ``gpipe`` in one process) from the same models and data (:func:`fit`).
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy

STEPS = 3


class BatchNormBlocks(pl.LightningModule):
    """The mixed ``nn.Sequential`` of the docs, every layer a block: two BatchNorms are blocks of their own.
    ``inside``: two blocks of ``Linear, BatchNorm`` (the BatchNorm inside a block) and a head. A dropout before the
    first BatchNorm: its masks come from rank 0's generator, which the shape inference must leave alone."""

    def __init__(self, inside: bool = False, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        if inside:
            self.net = nn.Sequential(
                nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.3), nn.BatchNorm1d(8)),
                nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()), nn.Linear(8, 3),
            )
        else:
            self.net = nn.Sequential(
                nn.Linear(5, 8), nn.Dropout(0.3), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                nn.Linear(8, 3),
            )
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def data(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g))


# case name -> (model, strategy options, loader batch size, samples)
def _bn_cases() -> dict[str, tuple]:
    """BatchNorm a block of its own in every checkpoint mode deferred at chunks 4, and at chunks 1 and 4 per
    micro-batch; inside a block, one case of each kind."""
    chosen = [
        ("own", "never", 4, True), ("own", "except_last", 4, True), ("own", "always", 4, True),
        ("own", "always", 1, False), ("own", "except_last", 4, False),
        ("inside", "never", 1, False), ("inside", "always", 4, False), ("inside", "except_last", 4, True),
    ]
    cases: dict[str, tuple] = {}
    for layout, checkpoint, chunks, deferred in chosen:
        name = f"bn-{layout}-{checkpoint}-{chunks}{'-deferred' if deferred else ''}"
        model = (lambda inside=layout == "inside": BatchNormBlocks(inside))
        cases[name] = (model, dict(chunks=chunks, checkpoint=checkpoint, deferred_batch_norm=deferred), 8, 24)
    return cases


SECTIONS = {"batchnorm": _bn_cases}


def fit(model: pl.LightningModule, loader: DataLoader, strategy, devices: int = 1, **kwargs) -> pl.Trainer:
    """``STEPS`` optimizer steps of ``model`` in float64, seeded alike in every run (dropout masks)."""
    pl.seed_everything(1, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, precision="64-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, **kwargs,
    )
    trainer.fit(model, loader)
    return trainer


def main() -> None:
    out, sections = sys.argv[1], sys.argv[2].split(",")
    torch.set_num_threads(1)
    for section in sections:
        for name, (model, options, batch, n) in SECTIONS[section]().items():
            task = model()
            strategy = DistributedGPipeStrategy(blocks=lambda net: list(net), timeout=60, **options)
            try:
                trainer = fit(task, DataLoader(data(n), batch_size=batch), strategy, devices=2)
                message = "ok"
            except Exception as err:  # noqa: BLE001  # what the user sees, saved for the test
                message = f"{type(err).__name__}: {err}"
                raise
            rank = int(os.environ.get("LOCAL_RANK", "0"))
            with open(os.path.join(out, f"{name}-rank{rank}.txt"), "w") as f:
                f.write(message)
            if trainer.global_rank == 0:
                torch.save({k: v.detach().clone() for k, v in task.state_dict().items()}, os.path.join(out, f"{name}.pt"))


if __name__ == "__main__":
    main()
