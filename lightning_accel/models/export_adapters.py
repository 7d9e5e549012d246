"""``lightning-accel export RUN_DIR``: a fine-tune run's adapters, written in peft's format.

The model is rebuilt from the run's ``.hydra/config.yaml`` on the meta device (the base's
architecture, its adapters, no weight allocated or read: a 70B base costs nothing here),
the checkpoint that ``run.json`` names is loaded into its adapters, and peft's
``save_pretrained`` writes ``adapter_config.json`` and ``adapter_model.safetensors``.
``PeftModel.from_pretrained(base, DIR)`` on the base the checkpoint names (for QLoRA: the
same base quantized to NF4) gives the fine-tuned model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from lightning_accel.config.errors import UserError
from lightning_accel.models.finetune_checkpoint import FINETUNE_KEY, base_keys
from lightning_accel.run_dir import newest_checkpoint


def run_checkpoint(run_dir: Path) -> tuple[Path, Any]:
    """The checkpoint a run directory's ``run.json`` names (its newest one if the run was killed) and its config."""
    if not (run_dir / "run.json").is_file():
        raise UserError(f"'{run_dir}' has no run.json: not a run directory; pass one that `lightning-accel run` made, "
                        "e.g. outputs/<recipe>/<date_time>")
    status = json.loads((run_dir / "run.json").read_text())
    named = status.get("checkpoint")
    checkpoint = Path(named) if named and Path(named).is_file() else newest_checkpoint(run_dir)
    if checkpoint is None:  # say what is true: a checkpoint run.json names may have been deleted since
        why = (f"run.json names '{named}', which no longer exists" if named else "its run completed without saving one"
               if status.get("status") == "completed" else "run.json names none")
        raise UserError(f"'{run_dir}' has no checkpoint: {why}, and {run_dir / 'checkpoints'} holds no .ckpt; export a run whose "
                        "checkpoint is there (callbacks=default saves every trainer.val_check_interval steps)")
    config = run_dir / ".hydra" / "config.yaml"
    if not config.is_file():
        raise UserError(f"'{run_dir}' has no .hydra/config.yaml to rebuild its model from; pass the run directory itself")
    return checkpoint, OmegaConf.load(config)


def export_adapters(run_dir: Path, out: Path | None = None) -> tuple[Path, int, str]:
    """Write ``run_dir``'s trained adapters to ``out`` (default ``RUN_DIR/adapter``); returns it, their parameter
    count, and the base they need, in words."""
    from lightning_accel.runner import build_model

    checkpoint_path, cfg = run_checkpoint(run_dir)
    if OmegaConf.select(cfg, "model.adapter", default=None) is None:
        raise UserError(f"'{run_dir}' trained without an adapter (model.adapter is null): its checkpoint holds the whole model, "
                        "no adapters to export; load its state_dict instead, or fine-tune with model/adapter=lora")
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
    if FINETUNE_KEY not in checkpoint:
        raise UserError(f"'{checkpoint_path}' has no record of a frozen base (not written by a fine-tune of this version); "
                        "resume the run once so it saves a new checkpoint, then export")
    with torch.device("meta"):
        module = build_model(cfg)
    trained = checkpoint["state_dict"]
    result = module.load_state_dict(trained, strict=False, assign=True)
    missing = sorted(set(result.missing_keys) - base_keys(checkpoint))
    if missing or result.unexpected_keys:
        key = missing[0] if missing else result.unexpected_keys[0]
        raise UserError(f"'{checkpoint_path}' does not fit the model its run's config builds ({key} "
                        f"{'missing' if missing else 'unknown'}); export from the run directory that wrote it")
    out = out if out is not None else run_dir / "adapter"
    module.net.save_pretrained(str(out))
    return out, sum(p.numel() for p in module.parameters() if p.requires_grad), _base_needed(checkpoint[FINETUNE_KEY], cfg)


def _base_needed(record: dict[str, Any], cfg: Any) -> str:
    path = record.get("pretrained_path")
    base = f"the base in {path}" if path else f"the random base model.net.config builds with seed {cfg.get('seed')}"
    if record.get("adapter", {}).get("option") == "qlora":
        base += " quantized as model/adapter=qlora does (lightning_accel.models.quantize.quantize_nf4)"
    return f"{base}, sha256 {str(record.get('sha256'))[:16]}"
