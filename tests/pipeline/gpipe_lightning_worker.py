"""A user script training with ``DistributedGPipeStrategy`` on 2 CPU processes (gloo).

Run as ``python gpipe_lightning_worker.py OUT_DIR SCHEDULES STEPS``: Lightning's subprocess
launcher re-runs this script for rank 1, exactly as for DDP. SCHEDULES is a
comma-separated list, one ``Trainer.fit`` each in the same processes (start-up paid
once). Per schedule, rank 0 saves ``{schedule}.ckpt`` (through ``trainer.save_checkpoint``)
and ``{schedule}-rank0.pt``: the loss each step returned, what ``train/loss`` logged, and
its in-memory weights after fit.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch

from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpipe_models import CLIP, gpt_loader, gpt_task  # noqa: E402

CASES = {  # schedule: (chunks, balance)
    "gpipe": (4, [2, 2]),
    "1f1b": (2, [3, 1]),
    "interleaved_1f1b": (4, [1, 1, 1, 1]),
}


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.returned: list[float] = []
        self.logged: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.returned.append(float(outputs["loss"]))
        self.logged.append(float(trainer.callback_metrics["train/loss"]))


def fit(out: str, schedule: str, steps: int, name: str, ckpt_path: str | None = None) -> None:
    chunks, balance = CASES[schedule]
    losses = Losses()
    task = gpt_task()
    strategy = DistributedGPipeStrategy(chunks=chunks, schedule=schedule, balance=balance, timeout=60)
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=2, strategy=strategy, precision="64-true", logger=False,
        gradient_clip_val=CLIP,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
    )
    trainer.fit(task, gpt_loader(), ckpt_path=ckpt_path)
    trainer.save_checkpoint(os.path.join(out, f"{name}.ckpt"))
    if trainer.is_global_zero:
        weights = {n: p.detach().clone() for n, p in task.named_parameters()}
        torch.save({"returned": losses.returned, "logged": losses.logged, "weights": weights},
                   os.path.join(out, f"{name}-rank0.pt"))


def main() -> None:
    out, schedules, steps = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
    torch.set_num_threads(1)
    for schedule in schedules:
        fit(out, schedule, steps, schedule)
        if schedule == "gpipe":
            fit(out, schedule, 2 * steps, "gpipe-resumed", ckpt_path=os.path.join(out, "gpipe.ckpt"))


if __name__ == "__main__":
    main()
