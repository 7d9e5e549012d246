"""Which of Lightning's hooks the user's code overrides: where a strategy must show what Lightning shows."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden


def overrides(module: pl.LightningModule | None, *hooks: str) -> bool:
    """Whether ``module`` or one of its Trainer's callbacks overrides one of ``hooks`` (e.g. ``"on_after_backward"``,
    where Lightning shows every gradient)."""
    if module is None:
        return False
    trainer = module._trainer
    owners = [module, *(trainer.callbacks if trainer is not None else [])]
    return any(is_overridden(hook, owner) for hook in hooks for owner in owners)
