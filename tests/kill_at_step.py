"""A callback that SIGKILLs its own process after a given step: a crash at a known point.

Used by the resume tests through ``+callbacks.kill._target_=kill_at_step.KillAtStep``
(the test puts this directory on the subprocess's PYTHONPATH). Lightning runs checkpoint
callbacks after all others, so killing at step ``n`` loses that step's checkpoint.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning.pytorch as pl


class KillAtStep(pl.Callback):
    def __init__(self, step: int, sig: str = "SIGKILL", times: int = 1, rank: int | None = None) -> None:
        self.step = step
        self.rank = rank  # only this rank signals itself (Kubernetes signals one process); None: every rank
        self.sig = getattr(signal, sig)
        self.times = times  # SIGINT twice: a user pressing Ctrl-C again

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            for _ in range(self.times):
                os.kill(os.getpid(), self.sig)
