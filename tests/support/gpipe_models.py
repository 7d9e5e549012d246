"""The model, data and a recording callback shared by the 2-process Lightning pipeline tests and their single-process references."""

from __future__ import annotations

import lightning.pytorch as pl
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


def gpt_loader(as_lightning_distributes_it: bool = False, n: int = 32, seed: int = 3) -> DataLoader:
    """``n`` sequences in batches of 8 (the last one smaller when 8 does not divide ``n``). Under a distributed strategy Lightning shuffles the training
    data with a ``DistributedSampler`` (seed 0); the pipeline strategy gives it one replica, so
    ``as_lightning_distributes_it=True`` is the order every pipeline rank sees."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (n, 8), generator=g)
    data = TensorDataset(x, torch.roll(x, -1, dims=1))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True) if as_lightning_distributes_it else None
    return DataLoader(data, batch_size=8, sampler=sampler)


def val_loader() -> DataLoader:
    """20 held-out sequences in batches of 8, 8 and 4: evaluation sees a smaller last batch."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 32, (20, 8), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=8)


def stage_names(task: LanguageModelTask, balance: list[int], ranks: int, rank_of: list[int] | None = None) -> list[set[str]]:
    """The parameter names each rank holds (stage ``s`` on rank ``rank_of[s]``, by default ``s % ranks``): its stages'
    blocks, and everything outside the blocks (pre and post: on every rank)."""
    net, names = task.net, [set() for _ in range(ranks)]
    outside = {f"net.{n}" for n, _ in net.named_parameters() if not n.startswith("blocks.")}
    for s, count in enumerate(balance):
        start = sum(balance[:s])
        for i in range(start, start + count):
            names[rank_of[s] if rank_of else s % ranks] |= {f"net.blocks.{i}.{n}" for n, _ in net.blocks[i].named_parameters()} | outside
    return names


class HeldAtTrainEnd(pl.Callback):
    """The parameters this rank holds (not on ``meta``) when training ends, before the strategy's ``on_train_end`` (it
    runs after the callbacks') gathers the whole model onto rank 0: what each rank kept while it trained."""

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.held = {n: p.detach().cpu().clone() for n, p in pl_module.named_parameters() if not p.is_meta}
