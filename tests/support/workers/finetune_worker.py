"""A user script fine-tuning LoRA adapters on a frozen bf16 or NF4 Llama with ``DistributedGPipeStrategy`` on 2 CPU
processes, Lightning's defaults otherwise (its distributed sampler left on, the user's plain DataLoader).

Run as ``python finetune_worker.py OUT_DIR``: for ``bf16`` and ``nf4`` one ``Trainer.fit`` of STEPS steps, 1F1B x
CHUNKS micro-batches, ``bf16-mixed``; rank 0 saves ``{kind}.ckpt`` (the gathered checkpoint), each rank ``{kind}-rank{r}.pt`` (its module
after fit, each tensor as its plain parts). Then our own QLoRA
task (``model/adapter=qlora``), whose checkpoints leave the base out: STEPS steps (``qlora_full.ckpt``; its
``ModelCheckpoint`` writes ``qlora_step2.ckpt`` half-way), and a fit resumed from ``qlora_step2.ckpt`` to STEPS
(``qlora_resumed.ckpt``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_accel.stored import plain_parts
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from tests.support.finetune_models import lora_llama, qlora_task
from tests.support.real_models import CausalLM, lm_loader

STEPS, CHUNKS = 4, 2


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    for kind in ("bf16", "nf4"):
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=DistributedGPipeStrategy(chunks=CHUNKS, schedule="1f1b", timeout=60),
            max_steps=STEPS, precision="bf16-mixed", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )
        task = CausalLM(lora_llama(nf4=kind == "nf4"), lr=1e-3)
        trainer.fit(task, lm_loader())
        trainer.save_checkpoint(out / f"{kind}.ckpt")
        # after fit, as after DDP: every rank's module whole, an NF4 weight as stored (its plain parts)
        held = {n: [p.clone() for p in plain_parts(t.detach())] for n, t in task.state_dict().items()}
        torch.save({"held": held, "types": {n: type(t).__name__ for n, t in task.state_dict().items()}},
                   out / f"{kind}-rank{trainer.global_rank}.pt")
    tokens, targets, _ = lm_loader().dataset.tensors
    for name, resume in (("qlora_full", None), ("qlora_resumed", out / f"qlora_step{STEPS // 2}.ckpt")):
        every = ModelCheckpoint(dirpath=out, filename="qlora_step{step}", auto_insert_metric_name=False,
                                every_n_train_steps=STEPS // 2, save_top_k=-1)
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=DistributedGPipeStrategy(chunks=CHUNKS, schedule="1f1b", timeout=60),
            max_steps=STEPS, precision="bf16-mixed", logger=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[every] if resume is None else [], enable_checkpointing=resume is None,
        )
        # LanguageModelTask's (x, y) batches, from a loader that resumes where it stopped (as the recipes' loaders do)
        trainer.fit(qlora_task(), StatefulDataLoader(TensorDataset(tokens, targets), batch_size=8), ckpt_path=resume)
        trainer.save_checkpoint(out / f"{name}.ckpt")
    print(f"rank {os.environ.get('LOCAL_RANK', '0')} done", flush=True)


if __name__ == "__main__":
    main()
