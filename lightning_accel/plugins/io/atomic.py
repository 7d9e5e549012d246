"""Checkpoints written whole or not at all.

Lightning's ``TorchCheckpointIO`` opens the destination and writes into it, so a crash,
a kill or a full disk in the middle leaves a truncated file where a good checkpoint (say
``last.ckpt``) used to be. We write to a temporary file in the same directory, flush it
to disk, and ``os.replace`` it over the destination: readers see the old file or the new
one, never half of one.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_accel.atomic import atomic_write


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that saves through a temporary file and an atomic rename."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"AtomicCheckpointIO does not take storage_options (got {storage_options!r}); "
                "use a CheckpointIO plugin that supports them"
            )
        if "://" in str(path):  # remote filesystems: no atomic rename to rely on
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_write(path, lambda f: torch.save(checkpoint, f))
