"""Whether every rank of a pipeline loaded the same batch: its stages are one model, and each rank feeds its part.

The first stage's rank feeds the batch's inputs into the model, the last stage's rank computes the loss from its own
copy of the targets: were the two batches different (a random transform drawn from each process's generator, which the
stages' own dropout draws advance apart; a sampler or shard chosen by the process's rank), the loss would pair one
batch's outputs with another's targets, silently. So each training step compares a fingerprint of the batch over the
pipeline's ranks (three float64 numbers, one all-gather) and refuses a difference in one line, on every rank. No
Lightning here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_accel.pipeline.microbatch import tensors_in

__all__ = ["check_same_batch"]


def _fingerprint(batch: Any, device: torch.device) -> torch.Tensor:
    tensors = tensors_in(batch)
    total = sum((float(t.detach().double().nan_to_num().sum()) for t in tensors if t.numel()), 0.0)
    squares = sum((float(t.detach().double().nan_to_num().square().sum()) for t in tensors if t.numel()), 0.0)
    return torch.tensor([len(tensors), total, squares], dtype=torch.float64, device=device)


def check_same_batch(batch: Any, group: dist.ProcessGroup | None, size: int, device: torch.device, owner: str) -> None:
    """Refuse, on every rank of ``group`` (``size`` ranks), a batch that is not the same on all of them."""
    if size == 1:
        return
    mine = _fingerprint(batch, device)
    seen = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(seen, mine, group=group)
    if any(not torch.equal(s, seen[0]) for s in seen):
        raise ValueError(
            f"{owner}: the ranks of one pipeline loaded different training batches (each feeds its stages from its own "
            "copy); draw a batch's randomness alike on every rank: Lightning's sampler (use_distributed_sampler=True), "
            "seed_everything(workers=True), no random transform in the main process, no shard chosen by global_rank"
        )
