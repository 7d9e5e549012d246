"""Parameters that start or stop training, or change, after the offload was planned: a backbone under a head, tiny.

Shared by the tests of gradual unfreezing and pruning under ``l2l_offload`` and its multi-process worker
(``l2l_offload_ddp``). Each case is one fit (or two, for the unfreezing between fits) of :class:`Transfer` in float64
(or fp32 under bf16-mixed); the reference is the same case under plain Lightning, on one device over the batches the
ranks read together (:class:`RankBatches`) for the multi-process one, since
torch's DDP does not average a parameter that starts to require grad after it wrapped the model (its reducer's
parameters are fixed then: the ranks' weights drift apart).

Cases (each names what changes, and when):

- ``finetune``: ``BaseFinetuning`` freezes ``inp`` and ``backbone[1:]``, unfreezes ``inp`` and ``backbone[2:]`` at
  epoch 1 with a new param group (block 1 stays frozen to the end);
- ``backbone``: Lightning's ``BackboneFinetuning`` (the whole backbone at epoch 1, its learning rate scheduled);
- ``addgroup``: ``backbone[3]`` frozen by hand before fit, unfrozen mid-epoch through ``optimizer.add_param_group``;
- ``refreeze``: as ``finetune``, then ``backbone[2]`` frozen again at epoch 2 (it stays in the optimizer, unstepped);
- ``pruning``: Lightning's ``ModelPruning`` (l1_unstructured, 30% at the end of epoch 0; its lottery-ticket reset
  replaces the pruned weights' ``.data``, and the masks are buffers added to the blocks);
- ``between``: ``backbone[2:]`` frozen by hand for a first fit, unfrozen by hand for a second fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning, ModelPruning
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

CASES = ("finetune", "backbone", "addgroup", "refreeze", "pruning", "between")
EPOCHS = 3
PER_RANK_BATCH = 4
SAMPLES = 8  # per rank: 2 batches an epoch


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class Transfer(pl.LightningModule):
    """``inp`` -> ``backbone`` (4 blocks, what L2L streams) -> ``head``; AdamW with weight decay over the parameters
    that require grad when ``configure_optimizers`` runs (after ``BaseFinetuning`` froze what it freezes).
    ``foreach=False``: torch's per-tensor loop wherever it runs (L2L then steps its host parameters on it too instead of
    the fused CPU kernel, which rounds differently), so one process equals plain Lightning bit for bit."""

    def __init__(self, dtype: torch.dtype = torch.float64, width: int = 8, depth: int = 4, foreach: bool | None = None) -> None:
        super().__init__()
        self.foreach = foreach
        torch.manual_seed(0)
        self.inp = nn.Linear(3, width)
        self.backbone = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.backbone:
            h = block(h)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x.to(self.inp.weight.dtype)).float(), y.float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=2e-2, weight_decay=0.1, foreach=self.foreach)


def data(world: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES * world, 3, generator=g, dtype=torch.float64)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


class RankBatches:
    """A batch sampler replaying on one process what ``world`` ranks read (Lightning's DistributedSampler, shuffled,
    seed 0, ``PER_RANK_BATCH`` each): their batches concatenated (``turns=False``: what DDP averages over, in float64),
    or each rank's in turn (``turns=True``: accumulating ``world`` batches computes each rank's batch as it does, bf16
    rounding included)."""

    def __init__(self, world: int = 2, turns: bool = False) -> None:
        self.world, self.turns = world, turns
        self.sampler = self  # Lightning sets the epoch on ``batch_sampler.sampler``
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        shards = []
        for rank in range(self.world):
            sampler = DistributedSampler(range(SAMPLES * self.world), num_replicas=self.world, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(self.epoch)
            shards.append(list(sampler))
        for start in range(0, SAMPLES, PER_RANK_BATCH):
            batches = [shard[start : start + PER_RANK_BATCH] for shard in shards]
            yield from (batches if self.turns else [[i for batch in batches for i in batch]])

    def __len__(self) -> int:
        return SAMPLES // PER_RANK_BATCH * (self.world if self.turns else 1)


class Finetune(BaseFinetuning):
    """Freezes ``inp`` and ``backbone[1:]``; at ``epoch`` unfreezes ``inp`` and ``backbone[2:]`` into a new param group
    (lr 1e-2); with ``refreeze``, freezes ``backbone[2]`` again at that epoch."""

    def __init__(self, epoch: int = 1, refreeze: int | None = None) -> None:
        super().__init__()
        self.epoch, self.refreeze = epoch, refreeze

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze([pl_module.inp, pl_module.backbone[1:]])

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == self.epoch:
            self.unfreeze_and_add_param_group([pl_module.inp, pl_module.backbone[2:]], optimizer, lr=1e-2)
        if epoch == self.refreeze:
            self.freeze(pl_module.backbone[2])


class AddGroup(pl.Callback):
    """At global step ``step`` (the second batch of epoch 0): ``backbone[3]`` requires grad again and joins the optimizer in a group."""

    def __init__(self, step: int = 1) -> None:
        self.step = step

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pl_module.backbone[3].requires_grad_(False)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            params = list(pl_module.backbone[3].parameters())
            for param in params:
                param.requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": params, "lr": 5e-3})


def pruning() -> ModelPruning:
    return ModelPruning("l1_unstructured", parameter_names=["weight"], amount=lambda epoch: 0.3 if epoch == 0 else 0.0)


def callbacks(case: str) -> list[pl.Callback]:
    """The callbacks of one fit of ``case`` (``between``: none, the freezing is by hand)."""
    return {
        "finetune": lambda: [Finetune()],
        "backbone": lambda: [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=5e-3)],
        "addgroup": lambda: [AddGroup()],
        "refreeze": lambda: [Finetune(refreeze=2)],
        "pruning": lambda: [pruning()],
        "between": lambda: [],
    }[case]()


def set_trainable(params: Iterable[nn.Parameter], trainable: bool) -> None:
    for param in params:
        param.requires_grad_(trainable)


def fit_case(case: str, task: Transfer, loader: DataLoader, strategy: Any = "auto", callbacks_too: Iterable[pl.Callback] = (),
             **trainer_kwargs: Any) -> list[pl.Trainer]:
    """Run ``case`` on ``task``: one fit of ``EPOCHS`` epochs, or for ``between`` a first fit of one epoch with
    ``backbone[2:]`` frozen and a second of one more with it unfrozen (``strategy``: a callable making a fresh one;
    ``callbacks_too``: added to the case's). Returns the Trainers."""
    make = strategy if callable(strategy) else (lambda: strategy)

    def trainer(epochs: int, cbs: list[pl.Callback]) -> pl.Trainer:
        return pl.Trainer(
            strategy=make(), max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, callbacks=[*cbs, *callbacks_too],
            **{"accelerator": "cpu", **trainer_kwargs},
        )

    if case != "between":
        run = trainer(EPOCHS, callbacks(case))
        run.fit(task, loader)
        return [run]
    set_trainable(task.backbone[2:].parameters(), False)
    first = trainer(1, [])
    first.fit(task, loader)
    set_trainable(task.backbone[2:].parameters(), True)
    second = trainer(1, [])
    second.fit(task, loader)
    return [first, second]


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
