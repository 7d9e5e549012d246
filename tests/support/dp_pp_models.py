"""The task and data shared by the DP x PP (2 replicas x 2 stages) test and its single-process reference."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset
from torchmetrics.aggregation import SumMetric

from lightning_accel.models import LanguageModelTask
from tests.support.gpipe_models import gpt_task

DP, PP, PER_RANK = 2, 2, 4  # replicas, ranks per pipeline, sequences per rank's batch: a global batch of 8
CASES = {  # schedule: (chunks, balance, training sequences, accumulate_grad_batches)
    "gpipe": (2, [2, 2], 32, 1),
    "1f1b": (2, [3, 1], 48, 2),
    "interleaved_1f1b": (4, [1, 1, 1, 1], 32, 1),  # 4 stages, 2 per rank (stage s on pp rank s % 2)
}
# the 16-mixed run: gpipe's case in float32 under fp16 autocast with a loss scaler that doubles its scale after
# every 2 finite steps; at POISON_STEP one replica's first stage (POISON_RANK) overflows, no other rank does
POISON_STEP, POISON_RANK = 2, 1
SCALES = [256.0, 512.0, 256.0, 256.0]  # the scale after each step: grow, grow (x2), overflow (/2), grow


def fp16_plugin() -> MixedPrecision:
    """Lightning's 16-mixed with a loss scaler, on the CPU (Lightning's precision='16-mixed' would pick bf16 there)."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2))


class Poison(pl.Callback):
    """Makes the first parameter of ``net.pre`` get an infinite gradient at batch ``step`` on global rank ``rank``."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank, self.active, self.handle = step, rank, False, None

    def on_train_start(self, trainer, pl_module):
        param = next(pl_module.net.pre.parameters())
        self.handle = param.register_hook(lambda g: torch.full_like(g, float("inf")) if self.active else g)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.active = batch_idx == self.step and trainer.global_rank == self.rank

    def on_train_end(self, trainer, pl_module):
        self.handle.remove()


class SyncedLossTask(LanguageModelTask):
    """The zoo GPT task, also logging its loss reduced over the data-parallel replicas (mean and sum), and in
    validation a summing metric: the sequences validated (each once, over all replicas)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.val_seen = SumMetric()

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.val_seen.update(batch[0].size(0))
        self.log("val/seen", self.val_seen, on_epoch=True)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss_mean", loss, sync_dist=True, batch_size=batch[0].size(0))
        self.log("train/loss_sum", loss, sync_dist=True, reduce_fx="sum", batch_size=batch[0].size(0))
        return loss


def task() -> SyncedLossTask:
    """:func:`gpt_task`'s model and optimizer (seeded), in :class:`SyncedLossTask`."""
    base = gpt_task()
    return SyncedLossTask(base.net, optimizer=base.optimizer_factory)


def sequences(n: int, seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (n, 8), generator=g)
    return TensorDataset(x, torch.roll(x, -1, dims=1))


class GlobalOrder(Sampler[int]):
    """What one process must see to train like ``DP`` replicas: step ``i``'s batch (``DP * PER_RANK`` samples) is the
    ``i``-th batch of each replica's shard, replica 0's first, where a shard is what Lightning's
    ``DistributedSampler(num_replicas=DP, rank=r, shuffle=True)`` gives rank ``r`` in that epoch."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:  # Lightning calls it at every epoch, as on a DistributedSampler
        self.epoch = epoch

    def __iter__(self):
        shards = []
        for r in range(DP):
            shard = DistributedSampler(range(self.n), num_replicas=DP, rank=r, shuffle=True, seed=0)
            shard.set_epoch(self.epoch)
            shards.append(list(shard))
        for i in range(0, len(shards[0]), PER_RANK):
            for shard in shards:
                yield from shard[i : i + PER_RANK]

    def __len__(self) -> int:
        return self.n


def global_loader(n: int) -> DataLoader:
    """The reference's data: global batches of ``DP * PER_RANK`` in :class:`GlobalOrder`."""
    return DataLoader(sequences(n), batch_size=DP * PER_RANK, sampler=GlobalOrder(n))


def rank_loader(n: int) -> DataLoader:
    """The user's data for the 4-rank run: batches of ``PER_RANK``; Lightning shards it over the replicas."""
    return DataLoader(sequences(n), batch_size=PER_RANK)
