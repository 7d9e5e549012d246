"""A user script fine-tuning LoRA on a frozen NF4 Llama with ``L2LOffloadDDPStrategy`` on 2 CPU processes (gloo),
Lightning's defaults otherwise (its distributed sampler left on, the user's plain DataLoader).

Run as ``python finetune_ddp_worker.py OUT_DIR``: STEPS steps of PER_RANK sequences a rank, ``bf16-mixed``, the host
optimizer partitioned; every rank saves ``rank{r}.pt`` (its adapters, whether its base is unchanged, its host bytes per
offloaded parameter).
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_accel import L2LOffloadDDPStrategy, OffloadPrecision
from tests.support.finetune_models import adapters, assert_frozen_unchanged, frozen, lora_llama
from tests.support.real_models import CausalLM, lm_loader

STEPS, PER_RANK = 2, 4


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    task = CausalLM(lora_llama(nf4=True), lr=1e-3)
    base = frozen(task.net)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=L2LOffloadDDPStrategy(host_step="partitioned"), max_steps=STEPS,
        plugins=[OffloadPrecision("bf16-mixed")], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(task, lm_loader(batch_size=PER_RANK))
    assert_frozen_unchanged(base, task.net)
    stats = trainer.strategy.offload_stats
    torch.save({"adapters": adapters(task.net), "host_bytes_per_param": stats.host_bytes_per_param}, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
