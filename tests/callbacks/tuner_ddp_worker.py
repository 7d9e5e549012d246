"""Two-rank DDP fit with PrefetchTuner, run as a script: Lightning re-launches it for rank 1.

Each rank writes ``rank<r>.json`` into the directory given as the first argument: the
sample indices it trained on, its per-rank budget, what its tuner chose and why, and the
memory budget a single rank would get on this machine, measured before and after its fit.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_accel.callbacks import PrefetchTuner
from lightning_accel.prefetch.search import default_budget


class SlowIndices(Dataset):
    """Item ``i`` is ``(i, x)`` after ``latency_s`` of (simulated) I/O."""

    def __init__(self, n: int, latency_s: float) -> None:
        self.n, self.latency_s = n, latency_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.latency_s)
        return torch.tensor(i), torch.full((4,), float(i))


class Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.indices: list[int] = []

    def training_step(self, batch, batch_idx):
        idx, x = batch
        self.indices += idx.tolist()
        time.sleep(0.005)
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(out: Path, samples: int) -> None:
    whole_machine = [default_budget(None, None, 1).memory_bytes]
    tuner = PrefetchTuner(warmup_steps=1, trial_steps=2, max_search_steps=24)
    model = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[tuner],
    )
    trainer.fit(model, DataLoader(SlowIndices(samples, latency_s=0.05), batch_size=1, shuffle=True))
    whole_machine.append(default_budget(None, None, 1).memory_bytes)
    budget = tuner.search.budget if tuner.search is not None else None
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "indices": model.indices,
        "budget_workers": budget.max_workers if budget else None,
        "budget_bytes": budget.memory_bytes if budget else None,
        "whole_machine_bytes": whole_machine,
        "chosen_workers": tuner.chosen.num_workers if tuner.chosen else None,
        "tried_workers": [t.settings.num_workers for t in tuner.search.trials] if tuner.search else [],
        "reason": tuner.reason,
    }))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
