"""A user script training models this project did not write with ``DistributedGPipeStrategy`` on 2 CPU processes.

Run as ``python real_models_worker.py OUT_DIR CASES``: CASES is a comma-separated list of
``model:schedule`` (models of ``tests/support/real_models.py``, its encoder-decoders ``t5`` and ``bart``
on their own loss and token pairs, plus ``qwen2``, ``mistral`` and ``llama4``, a Llama of 4 layers; ``row-NAME``: a regression row of
``tests/support/regression_models.py``, its own task, dtype and data, 3 steps; ``row-NAME@PRECISION``: in Lightning's
``PRECISION``, e.g. ``bf16-mixed``),
one ``Trainer.fit`` each in the same two processes (Lightning's launcher starts rank 1 from
this script). Each fit: 4 steps of 8 sequences in 4 micro-batches, float64, from the
model's seeded initialization; rank 0 saves ``{model}-{schedule}.ckpt`` (the gathered
checkpoint). ``llama:gpipe`` is also trained 2 steps, saved, and resumed from that
checkpoint in a fresh Trainer to step 4 (``llama-gpipe-resumed.ckpt``). An encoder-decoder's ranks each write
``{model}-{schedule}-rank{R}.json``: the parameters of each stack's blocks that rank holds, and the ``val_loss``
of one validation batch after the last step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from tests.support import real_models
from tests.support import regression_models
from tests.support.real_models import VOCAB, lm_loader

STEPS, CHUNKS = 4, 4
SEQ2SEQ_SAMPLES = 32  # encoder-decoders (T5, BART): (source, target) pairs, 4 batches of 8
VAL_SAMPLES = 6  # and one validation batch of 6 pairs, streamed through the stages in micro-batches


def build_qwen2() -> torch.nn.Module:
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    return transformers.Qwen2ForCausalLM(cfg)


def build_mistral() -> torch.nn.Module:
    import transformers

    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    return transformers.MistralForCausalLM(cfg)


def build_llama4() -> torch.nn.Module:
    """Llama with 4 layers: the two-stage-per-rank schedules (zero-bubble, DualPipeV) need 4 blocks on 2 ranks."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg)


real_models.BUILDERS.update(qwen2=build_qwen2, mistral=build_mistral, llama4=build_llama4)


def task(name: str) -> pl.LightningModule:
    return real_models.real_task(name, torch.float64)


class HeldBlocks(pl.Callback):
    """What this rank holds of each stack's blocks while training: their parameters not on ``meta`` (another rank's
    blocks are), after the first step (after fit rank 0 holds the whole model again, to be usable and saved)."""

    def __init__(self, stacks: tuple[str, ...]) -> None:
        self.stacks = stacks
        self.held: dict[str, int] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *_: object) -> None:
        if not self.held:
            named = list(module.net.named_parameters())
            self.held = {s: sum(p.numel() for n, p in named if n.startswith(f"{s}.") and not p.is_meta) for s in self.stacks}


def trainer(
    schedule: str, steps: int, sampler: bool = True, precision: str = "64-true", callbacks: list[pl.Callback] | None = None
) -> pl.Trainer:
    """Lightning's defaults (its distributed sampler replaces the user's shuffling one), or, for the resume case, the
    loader's own order: with Lightning's shuffling DistributedSampler a mid-epoch resume is not exact under Lightning's
    own DDP either (2.9e-2 after 4 steps on 2 ranks, a StatefulDataLoader)."""
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=DistributedGPipeStrategy(chunks=CHUNKS, schedule=schedule, timeout=60),
        max_steps=steps, precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=sampler, callbacks=callbacks,
    )


def shuffled() -> DataLoader:
    """The user's shuffling DataLoader, as users write it."""
    return DataLoader(lm_loader().dataset, batch_size=8, shuffle=True)


def main() -> None:
    out, cases = Path(sys.argv[1]), [c.split(":") for c in sys.argv[2].split(",")]
    torch.set_num_threads(1)
    for name, schedule in cases:
        if name.startswith("row-"):  # the user's shuffling loader; the reference reads the sampler's order
            row, _, precision = name[len("row-"):].partition("@")
            t = trainer(schedule, regression_models.STEPS, precision=precision or "32-true")  # the row's own dtype
            t.fit(regression_models.task(row), DataLoader(regression_models.dataset(row), batch_size=regression_models.BATCH, shuffle=True))
            t.save_checkpoint(out / f"{name}-{schedule}.ckpt")
            continue
        if name in real_models.ENCODER_DECODERS:  # blocks='auto': the encoder's blocks, then the decoder's, pipelined
            held = HeldBlocks(real_models.BLOCK_STACKS[name])
            t = trainer(schedule, STEPS, callbacks=[held])
            t.fit(
                real_models.seq2seq_task(name), DataLoader(real_models.seq2seq_data(SEQ2SEQ_SAMPLES), batch_size=8, shuffle=True),
                val_dataloaders=DataLoader(real_models.seq2seq_data(VAL_SAMPLES), batch_size=VAL_SAMPLES),
            )
            val_loss = float(t.callback_metrics["val_loss"])  # after the last step (the sanity check ran one before)
            (out / f"{name}-{schedule}-rank{t.global_rank}.json").write_text(json.dumps({**held.held, "val_loss": val_loss}))
        else:
            t = trainer(schedule, STEPS)
            t.fit(task(name), shuffled())
        t.save_checkpoint(out / f"{name}-{schedule}.ckpt")
        if (name, schedule) == ("llama", "gpipe"):
            t = trainer(schedule, STEPS // 2, sampler=False)
            t.fit(task(name), lm_loader())
            t.save_checkpoint(out / "llama-gpipe-half.ckpt")
            t = trainer(schedule, STEPS, sampler=False)
            t.fit(task(name), lm_loader(), ckpt_path=out / "llama-gpipe-half.ckpt")
            t.save_checkpoint(out / "llama-gpipe-resumed.ckpt")
    print(f"rank {os.environ.get('LOCAL_RANK', '0')} done", flush=True)


if __name__ == "__main__":
    main()
