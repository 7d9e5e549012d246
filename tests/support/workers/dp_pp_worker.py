"""A user script training with ``DistributedGPipeStrategy`` on 4 CPU processes (gloo): 2 replicas x 2 stages.

Run as ``python dp_pp_worker.py OUT_DIR``: Lightning's subprocess launcher re-runs this
script for ranks 1-3, exactly as for DDP. One ``Trainer.fit`` per schedule of
:data:`dp_pp_models.CASES`, then ``gpipe-resumed``: 2 epochs resuming from ``gpipe.ckpt``, then
``fp16``: gpipe's case under 16-mixed with a loss scaler, where rank 1's first stage overflows
at one step (:class:`dp_pp_models.Poison`).
Per fit, rank 0 saves ``{name}.ckpt`` (``trainer.save_checkpoint``) and every rank
``{name}-rank{r}.pt``: the loss scale after each step, its mesh coordinates (from torch's mesh), sampler kwargs and
``reduce_boolean_decision`` votes (all true; all but rank 3; any: only rank 3), the
inputs of every batch it saw, the loss each step returned, what ``train/loss``,
``train/loss_mean`` and ``train/loss_sum`` logged, the parameters resident on it after fit,
and ``val/loss``, ``val/ppl``, ``val/seen`` from the validation at the end of fit.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch

from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from tests.support.dp_pp_models import CASES, DP, POISON_RANK, POISON_STEP, PP, Poison, fp16_plugin, rank_loader, task
from tests.support.gpipe_models import CLIP, HeldAtTrainEnd, val_loader


class Record(pl.Callback):
    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []
        self.returned: list[float] = []
        self.scales: list[float] = []
        self.logged: dict[str, list[float]] = {"train/loss": [], "train/loss_mean": [], "train/loss_sum": []}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.inputs.append(batch[0].cpu().clone())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.returned.append(float(outputs["loss"]))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(scaler.get_scale() if scaler is not None else 1.0)
        for name, values in self.logged.items():
            values.append(float(trainer.callback_metrics[name]))


def fit(out: str, schedule: str, epochs: int, name: str, ckpt_path: str | None = None, fp16: bool = False) -> None:
    chunks, balance, n, accumulate = CASES[schedule]
    record, model, held = Record(), task(), HeldAtTrainEnd()
    strategy = DistributedGPipeStrategy(chunks=chunks, schedule=schedule, balance=balance, timeout=60)
    precision = {"plugins": [fp16_plugin()]} if fp16 else {"precision": "64-true"}
    trainer = pl.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=DP * PP, strategy=strategy, **precision, logger=False,
        gradient_clip_val=CLIP, accumulate_grad_batches=accumulate, num_sanity_val_steps=0, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[record, held, *[Poison(POISON_STEP, POISON_RANK)] * fp16],
    )
    trainer.fit(model, rank_loader(n), val_loader(), ckpt_path=ckpt_path)
    trainer.save_checkpoint(os.path.join(out, f"{name}.ckpt"))
    mesh = strategy._mesh
    torch.save(
        {
            "mesh": (mesh.get_local_rank("pp"), mesh.get_local_rank("dp")),
            "sampler": strategy.distributed_sampler_kwargs,
            "votes": [strategy.reduce_boolean_decision(True), strategy.reduce_boolean_decision(trainer.global_rank != 3),
                      strategy.reduce_boolean_decision(trainer.global_rank == 3, all=False)],
            "inputs": record.inputs, "returned": record.returned, "logged": record.logged, "scales": record.scales,
            "resident": held.held,
            "val": {k: float(trainer.callback_metrics[k]) for k in ("val/loss", "val/ppl", "val/seen")},
        },
        os.path.join(out, f"{name}-rank{trainer.global_rank}.pt"),
    )


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    for schedule in CASES:
        fit(out, schedule, 1, schedule)
    fit(out, "gpipe", 2, "gpipe-resumed", ckpt_path=os.path.join(out, "gpipe.ckpt"))
    fit(out, "gpipe", 1, "fp16", fp16=True)


if __name__ == "__main__":
    main()
