"""A user script whose LightningModule builds its network in ``configure_model``, trained with ``DistributedGPipeStrategy``.

Run as ``python deferred_worker.py OUT_DIR NAMES``: NAMES is a comma-separated list of
``gpt`` (the zoo GPT), ``llama`` (transformers) and ``litgpt``; one ``Trainer.fit`` each in the
same two processes (Lightning's launcher starts rank 1 from this script), 4 steps of 8
sequences in 4 micro-batches, float64, seed 0. Each rank writes ``{name}-rank{r}.pt``: which
parameters it holds (not on ``meta``) after setup and after fit, and its peak resident memory;
rank 0 saves ``{name}.ckpt`` (the gathered checkpoint). ``gpt`` is also trained 2 steps from
another seed, saved, and resumed from that checkpoint to step 4 in a fresh Trainer
(``gpt-resumed.ckpt``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from tests.support.real_models import BUILDERS, CausalLM, VOCAB, SEQ, lm_loader

STEPS, CHUNKS, SEED = 4, 4, 0


def build(name: str) -> torch.nn.Module:
    if name == "gpt":
        from lightning_accel.models.gpt import GPT

        return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=3, n_head=4, n_embd=32)
    return BUILDERS[name]()


class DeferredLM(CausalLM):
    """``CausalLM`` over a network made in ``configure_model`` (once: Lightning calls it again for every run)."""

    def __init__(self, name: str) -> None:
        super().__init__(None)  # type: ignore[arg-type]
        self.name = name

    def configure_model(self) -> None:
        if self.net is None:
            self.net = build(self.name)


def reference(name: str) -> DeferredLM:
    """What the pipeline's ranks start from, built whole and for real in this process: the user's configure_model from
    seed 0 (``seed_everything`` before fit), in float64 (what precision="64-true" sets around configure_model)."""
    task = DeferredLM(name)
    default = torch.get_default_dtype()
    pl.seed_everything(SEED, verbose=False)
    torch.set_default_dtype(torch.float64)
    try:
        task.configure_model()
    finally:
        torch.set_default_dtype(default)
    return task


class Holdings(pl.Callback):
    """The parameter names this rank holds (not on meta) once the strategy has set up, and when training ends (before
    the strategy's own on_train_end gathers the whole model onto rank 0)."""

    def __init__(self) -> None:
        self.at_start: list[str] = []
        self.at_end: list[str] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.at_start = [n for n, p in pl_module.named_parameters() if not p.is_meta]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.at_end = [n for n, p in pl_module.named_parameters() if not p.is_meta]


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2].split(",")
    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    for name in names:
        pl.seed_everything(SEED, verbose=False)
        holdings = Holdings()
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=DistributedGPipeStrategy(chunks=CHUNKS, timeout=60),
            max_steps=STEPS, precision="64-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, use_distributed_sampler=False, callbacks=[holdings],
        )
        task = DeferredLM(name)
        trainer.fit(task, lm_loader())
        trainer.save_checkpoint(out / f"{name}.ckpt")
        info: dict[str, Any] = {
            "at_start": holdings.at_start,
            "after_fit": holdings.at_end,
            "meta": [n for n, _ in task.named_parameters() if n not in holdings.at_end],
        }
        torch.save(info, out / f"{name}-rank{rank}.pt")
        if name == "gpt":  # 2 steps, saved; a fresh (meta-built) model resumed from it to step 4
            for steps, ckpt in ((STEPS // 2, None), (STEPS, out / "gpt-half.ckpt")):
                pl.seed_everything(SEED + 1, verbose=False)  # other initial weights: the checkpoint must replace them
                trainer = pl.Trainer(
                    accelerator="cpu", devices=2, strategy=DistributedGPipeStrategy(chunks=CHUNKS, timeout=60),
                    max_steps=steps, precision="64-true", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                )
                trainer.fit(DeferredLM(name), lm_loader(), ckpt_path=ckpt)
                trainer.save_checkpoint(out / ("gpt-resumed.ckpt" if ckpt else "gpt-half.ckpt"))
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
