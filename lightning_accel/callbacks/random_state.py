"""RandomState: the global RNG states travel in every checkpoint, so a resume is exact.

Lightning saves the weights, the optimizer, the loop counters and (for a stateful loader)
the data position, but not the random number generators: a resumed run draws different
dropout masks than the run it replaces. This callback adds torch's (CPU and CUDA), NumPy's
and Python's global states to each checkpoint, one entry per rank (pipeline stages and
data-parallel replicas consume their generators differently), and puts them back just
before the first training batch after a resume, the point where the checkpoint was taken.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


def _portable(states: dict[str, Any]) -> dict[str, Any]:
    """NumPy's state as a tensor: checkpoints are loaded with ``weights_only=True``, which
    refuses NumPy arrays."""
    if "numpy" in states:
        name, keys, pos, has_gauss, cached = states["numpy"]
        states = states | {"numpy": (str(name), torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))}
    return states


def _native(states: dict[str, Any]) -> dict[str, Any]:
    if "numpy" in states:
        name, keys, pos, has_gauss, cached = states["numpy"]
        states = states | {"numpy": (name, keys.numpy().astype("uint32"), pos, has_gauss, cached)}
    return states


def _gathered(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``state``, in rank order (this rank's alone outside a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


class RandomState(Callback):
    """Saves every rank's global RNG states in checkpoints; restores them at the first
    training batch after ``fit(ckpt_path=...)``.

    A checkpoint from a run with a different number of ranks restores the ranks it has
    and leaves the others seeded as they are.
    """

    def __init__(self) -> None:
        self._pending: list[dict[str, Any]] | None = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"ranks": _gathered(_portable(_collect_rng_states(include_cuda=torch.cuda.is_available())))}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = list(state_dict.get("ranks") or [])

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._pending is None:
            return
        states, self._pending = self._pending, None
        if trainer.global_rank < len(states):
            _set_rng_states(_native(states[trainer.global_rank]))
