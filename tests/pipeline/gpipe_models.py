"""The model and data shared by the 2-process Lightning pipeline test and its single-process reference."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_accel.models import GPT, LanguageModelTask


# the whole model's first gradient has norm 1.33, each stage's < 1: clipping by norm is only
# right if it uses the norm over every stage
CLIP = 1.0


def gpt_task() -> LanguageModelTask:
    """The zoo GPT, 4 blocks, untied (one tensor cannot live on two ranks), AdamW with weight decay."""
    torch.manual_seed(0)
    net = GPT("tiny", n_layer=4, n_embd=16, n_head=2, block_size=8, vocab_size=32, tie_weights=False)
    return LanguageModelTask(net, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))


def gpt_loader(as_lightning_distributes_it: bool = False) -> DataLoader:
    """32 sequences in batches of 8. Under a distributed strategy Lightning shuffles the training
    data with a ``DistributedSampler`` (seed 0); the pipeline strategy gives it one replica, so
    ``as_lightning_distributes_it=True`` is the order every pipeline rank sees."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 32, (32, 8), generator=g)
    data = TensorDataset(x, torch.roll(x, -1, dims=1))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True) if as_lightning_distributes_it else None
    return DataLoader(data, batch_size=8, sampler=sampler)
