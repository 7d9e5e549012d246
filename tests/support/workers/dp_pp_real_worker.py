"""A user script training transformers Llama with ``DistributedGPipeStrategy`` on 4 CPU processes: 2 replicas x 2 stages.

Run as ``python dp_pp_real_worker.py OUT_DIR``: Lightning's launcher starts ranks 1-3 from it.
Lightning shards :func:`dataset` over the 2 replicas (its ``DistributedSampler``, seed 0);
each replica's pipeline splits its batches of :data:`PER_RANK` into 2 micro-batches. Rank 0
saves the gathered checkpoint ``llama-dp-pp.ckpt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from tests.support.real_models import SEQ, VOCAB, real_task

PER_RANK, STEPS, N = 4, 3, 24


def dataset() -> TensorDataset:
    """Unpadded sequences (every micro-batch and replica averages over as many tokens, as the global batch's mean)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (N, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:], torch.ones(N, SEQ, dtype=torch.long))


def main() -> None:
    torch.set_num_threads(1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=DistributedGPipeStrategy(chunks=2, pipeline_parallel_size=2, timeout=60),
        max_steps=STEPS, precision="64-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(real_task("llama", torch.float64), DataLoader(dataset(), batch_size=PER_RANK))
    trainer.save_checkpoint(Path(sys.argv[1]) / "llama-dp-pp.ckpt")


if __name__ == "__main__":
    main()
