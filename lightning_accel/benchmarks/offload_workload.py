"""What the offload benches train on and how they time a step: random tokens, a step timer, the pinned-copy bandwidth.

:mod:`.offload` (the tables), :mod:`.offload_contenders`, :mod:`.offload_host_step` and
:mod:`.finetune` all read these, so none of them imports another for a helper (the tables
import the contenders and the host-step report, never the other way round).
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["StepTimer", "pinned_bandwidth_gbs", "token_data"]


class StepTimer(pl.Callback):
    """Wall time of each training step after ``warmup`` steps (synchronising CUDA)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._start = 0.0

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._sync()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._sync()
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)


def token_data(batch: int, seq: int, steps: int) -> DataLoader:
    """``steps`` batches of ``batch`` random token sequences (inputs, next-token targets), the same on every call."""
    tokens = torch.randint(0, 256, (batch * steps, seq + 1), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)


def pinned_bandwidth_gbs() -> float:
    """Host-to-device GB/s of a plain 256 MiB pinned copy on this machine (CUDA only): what an offload's copies can reach."""
    host = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 10 * host.numel() / (time.perf_counter() - start) / 1e9
