"""A user script training with ``DistributedGPipeStrategy`` on 2 CPU processes (gloo).

Run as ``python gpipe_lightning_worker.py OUT_DIR SCHEDULES EPOCHS``: Lightning's subprocess
launcher re-runs this script for rank 1, exactly as for DDP. SCHEDULES is a
comma-separated list, one ``Trainer.fit`` each in the same processes (start-up paid
once). Per schedule, rank 0 saves ``{schedule}.ckpt`` (through ``trainer.save_checkpoint``)
and every rank ``{schedule}-rank{r}.pt``: the loss each step returned, what ``train/loss``
logged, the parameters resident on that rank at the end of training (the rest are on the meta device), its module's
tensors after fit (the whole model, on every rank) and its logits of two validation sequences through it,
the parameters its optimizer holds with the sizes of their state, and ``val/loss``,
``val/ppl`` from the validation at the end of fit and from ``trainer.validate`` after it.
``1f1b`` trains on 36 sequences: its fifth batch has 4, not 8. ``gpipe`` re-materializes every
micro-batch, ``1f1b`` all but the last (:data:`CHECKPOINT`).
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch

from lightning_accel.pipeline.auto_schedule import AutoSchedule
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from tests.support.gpipe_models import CLIP, HeldAtTrainEnd, gpt_loader, gpt_task, val_loader

CASES = {  # schedule: (chunks, balance, training sequences)
    "gpipe": (4, [2, 2], 32),
    "1f1b": (2, [3, 1], 36),
    "interleaved_1f1b": (4, [1, 1, 1, 1], 32),
    # torch's zero-bubble and DualPipeV schedules: two stages per rank, looped (interleaved_zb) or V-wise (rank 0 holds
    # stages 0 and 3: the first and the last)
    "interleaved_zb": (4, [1, 1, 1, 1], 32),
    "zbv": (4, [1, 1, 1, 1], 32),
    "dualpipev": (4, [1, 1, 1, 1], 32),
    # schedule="auto" from gpipe at chunks=8: 3 + 3 steps of measurement (at 8 and 4 micro-batches), then its choice
    "auto": (8, [2, 2], 64),
}
AUTO = AutoSchedule("gpipe", steps=2)
RESUMED = ("gpipe", "interleaved_zb", "zbv", "dualpipev")  # each resumes from its own checkpoint for one more epoch
# re-materialization per schedule: each mode is checked against plain training by the same assertions
CHECKPOINT = {
    "gpipe": "always", "1f1b": "except_last", "interleaved_1f1b": "never", "interleaved_zb": "never", "zbv": "never",
    "dualpipev": "never", "auto": "never",
}


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.returned: list[float] = []
        self.logged: list[float] = []
        self.norms: list[float] = []  # the whole model's gradient norm before each step (strategy.grad_norm)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.returned.append(float(outputs["loss"]))
        self.logged.append(float(trainer.callback_metrics["train/loss"]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.norms.append(float(trainer.strategy.grad_norm(2)))  # every rank: a collective over the pipeline


def _val(trainer: pl.Trainer) -> dict[str, float]:
    return {k: float(trainer.callback_metrics[k]) for k in ("val/loss", "val/ppl")}


def fit(out: str, schedule: str, epochs: int, name: str, ckpt_path: str | None = None, chunks: int | None = None) -> tuple[str, int]:
    """Returns the schedule and chunks trained last: ``schedule="auto"``'s choice (every rank makes the same), which it
    also saves in ``auto-chosen.txt`` (rank 0)."""
    case_chunks, balance, n = CASES["auto" if name == "auto-chosen" else schedule]
    chunks = chunks or case_chunks
    losses, held = Losses(), HeldAtTrainEnd()
    task = gpt_task()
    strategy = DistributedGPipeStrategy(
        chunks=chunks, schedule=AUTO if schedule == "auto" else schedule, balance=balance,
        checkpoint=CHECKPOINT.get(schedule, "never"), timeout=60,
    )
    trainer = pl.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=2, strategy=strategy, precision="64-true", logger=False,
        gradient_clip_val=CLIP,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[losses, held],
    )
    # validation at the end of the epoch (and the sanity check before training) runs through the pipeline
    trainer.fit(task, gpt_loader(n=n), val_loader(), ckpt_path=ckpt_path)
    if schedule == "auto" and trainer.global_rank == 0:
        with open(os.path.join(out, "auto-chosen.txt"), "w") as f:
            f.write(f"{strategy.schedule} {strategy.chunks}")
    in_fit = _val(trainer)
    # after fit, as after DDP: every rank's module whole, and what it computes
    after_fit = {n: t.detach().clone() for n, t in task.state_dict().items() if not t.is_meta}
    probe = next(iter(val_loader()))[0][:2]
    logits = task.net(probe).detach()
    trainer.save_checkpoint(os.path.join(out, f"{name}.ckpt"))
    # what a save puts in each rank's memory: the whole optimizer state on rank 0 only (a collective: every rank)
    optimizer_entries = len(trainer.strategy.optimizer_state(trainer.optimizers[0])["state"])
    names = {id(p): n for n, p in task.named_parameters()}
    resident = held.held
    optimizer = trainer.optimizers[0]
    in_optimizer = {
        names[id(p)]: {k: v.numel() for k, v in optimizer.state[p].items() if torch.is_tensor(v)}
        for group in optimizer.param_groups for p in group["params"]
    }
    trainer.validate(task, val_loader(), verbose=False)  # a second setup, on the module fit left split
    # teardown takes the stage boundaries off: no block keeps an instance forward (nested once per fit before)
    patched = [n for n, m in task.named_modules() if "forward" in vars(m)]
    assert not patched, f"modules keep an instance forward after validate: {patched}"
    torch.save(
        {"returned": losses.returned, "logged": losses.logged, "norms": losses.norms, "resident": resident, "optimizer": in_optimizer,
         "val_in_fit": in_fit, "val_after": _val(trainer), "after_fit": after_fit, "probe": probe, "logits": logits,
         "optimizer_entries": optimizer_entries},
        os.path.join(out, f"{name}-rank{trainer.global_rank}.pt"),
    )
    return strategy.schedule, strategy.chunks


def main() -> None:
    out, schedules, epochs = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
    torch.set_num_threads(1)
    for schedule in schedules:
        chosen = fit(out, schedule, epochs, schedule)
        if schedule == "auto":  # a run started with auto's choice, for the weights to compare
            fit(out, chosen[0], epochs, "auto-chosen", chunks=chosen[1])
        if schedule in RESUMED:
            fit(out, schedule, 2 * epochs, f"{schedule}-resumed", ckpt_path=os.path.join(out, f"{schedule}.ckpt"))


if __name__ == "__main__":
    main()
