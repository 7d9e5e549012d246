"""Lightning checkpoints of a recipe's model written without a run: its weights, and the optimizer and scheduler states
its ``configure_optimizers`` builds, as a run's checkpoint holds them (one step taken)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def write_checkpoint(path: Path, recipe: str = "gpt-tiny_cpu", overrides: Sequence[str] = (), weights_only: bool = False) -> Path:
    """``recipe`` with ``overrides``, built on the CPU, stepped once (zero gradients) and saved to ``path``."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    from lightning_accel.runner import build_model
    from tests.support.edited_configs import job

    torch.manual_seed(0)
    model = build_model(job(recipe, list(overrides))[0])
    checkpoint: dict = {"state_dict": model.state_dict(), "global_step": 1, "epoch": 0}
    if not weights_only:
        optimizers, schedulers, _ = _configure_optimizers(model.configure_optimizers())
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for optimizer in optimizers:
            optimizer.step()
        found = [c["scheduler"] if isinstance(c, dict) else getattr(c, "scheduler", c) for c in schedulers]
        for scheduler in found:
            scheduler.step()
        checkpoint.update(optimizer_states=[o.state_dict() for o in optimizers], lr_schedulers=[s.state_dict() for s in found])
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, path)
    return path
