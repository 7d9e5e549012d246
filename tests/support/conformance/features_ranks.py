"""Conformance features: what counts replicas. What Lightning, its callbacks, torchmetrics and a user's code read as "how
many replicas see data" (``trainer.world_size``, ``num_devices``, the sampler's shard, ``estimated_stepping_batches``,
a learning rate scaled by the world size, ``ThroughputMonitor``'s global rates, metrics synced over the ranks) must be
the data-parallel count: a pipeline's processes are the stages of one replica."""

from __future__ import annotations

from typing import Any

import torch
import torchmetrics
from lightning.pytorch.callbacks import ThroughputMonitor
from torch import Tensor

from tests.support.conformance.run import Run
from tests.support.conformance.task import Task, loader, val_loader


class Counted(Task):
    """Reads the replica counts where a user's code does (configure_optimizers: the linear lr scaling rule, a
    scheduler's total steps), and logs torchmetrics whose values depend on a sync over the ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.total = torchmetrics.SumMetric().set_dtype(torch.float64)  # doubled if a pipeline's ranks were replicas
        self.rows = torchmetrics.CatMetric().set_dtype(torch.float64)
        self.mean_on_step = torchmetrics.MeanMetric(dist_sync_on_step=True).set_dtype(torch.float64)
        self.counts: dict[str, Any] = {}

    def configure_optimizers(self) -> Any:
        trainer = self.trainer
        self.counts = {"world_size": trainer.world_size, "num_devices": trainer.num_devices, "num_nodes": trainer.num_nodes,
                       "stepping_batches": trainer.estimated_stepping_batches,
                       "train_batches": len(trainer.train_dataloader)}
        sampler = getattr(trainer.train_dataloader, "sampler", None)
        self.counts["sampler"] = [getattr(sampler, "num_replicas", None), getattr(sampler, "num_samples", None)]
        optimizer = torch.optim.SGD(self.trainable(), lr=self.lr * trainer.world_size, momentum=0.9)  # the linear rule
        total = int(trainer.estimated_stepping_batches)
        return [optimizer], [torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=total)]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.total.update(loss.detach())
        self.rows.update(loss.detach())
        self.log("mean_on_step", self.mean_on_step(loss.detach()), on_step=True, on_epoch=False)
        self.log("train_loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("sum_over_replicas", self.total.compute())
        self.log("rows_over_replicas", float(self.rows.compute().numel()))
        self.total.reset()
        self.rows.reset()


def replica_counts(run: Run) -> None:
    """The counts, the weights they scale, the synced metrics; ThroughputMonitor's world size and the rates it logs
    (their names: the values are timings, taken out of what the logger saw before it is compared)."""
    task = Counted()
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0))
    trainer = run.trainer([monitor])
    trainer.fit(task, loader(), val_loader())
    calls = getattr(trainer.logger, "calls", [])
    # ThroughputMonitor's (train/time, train/device/batches_per_sec, ...): straight to the logger
    timed = [c for c in calls if c[0] == "metrics" and any(str(k).endswith("/time") for k in c[2])]
    calls[:] = [c for c in calls if c not in timed]
    run.see_r0("throughput_metrics", sorted({name for c in timed for name in c[2]}))
    run.see("throughput_world_size", {str(stage): t.world_size for stage, t in monitor._throughputs.items()})
    run.see("counts", task.counts)
    run.observe(trainer, task)


FEATURES = {f.__name__: f for f in (replica_counts,)}
