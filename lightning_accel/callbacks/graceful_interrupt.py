"""GracefulInterrupt: Ctrl-C ends training after the current step and saves it.

Lightning answers Ctrl-C by abandoning the step in flight and exiting with status 1,
saving nothing: the newest checkpoint may be many steps old. Stopping in the middle of a
step is not safe either (an offloaded optimizer updates parameters block by block during
backward). So the first SIGINT only asks the trainer to stop once the step in flight is
done; that step is then written to ``last.ckpt`` (atomically, through the trainer's
checkpoint IO). A second SIGINT means "now": it calls ``on_second`` and exits at once.

The handler is installed for the fit's loops (from the sanity check, or the training
loop's start) and put back at ``teardown``, or at ``on_exception`` when the fit raises
(Lightning calls no teardown then), so a notebook's next Ctrl-C after a failed fit
interrupts the kernel as usual. Not earlier: Lightning snapshots every signal handler after
``on_fit_start`` and re-installs that snapshot when the fit ends, failed or not; a handler
installed at ``setup`` would come back after ``on_exception`` had put the old one back.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd command



def _processes(trainer: pl.Trainer) -> int:
    """Every process of the run: ``trainer.world_size`` counts replicas, and a pipeline replica is several processes."""
    return max(trainer.world_size, dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1)

class GracefulInterrupt(Callback):
    """First Ctrl-C: finish the step, save ``last.ckpt``, end ``fit`` normally with
    ``interrupted`` set. Second Ctrl-C: ``on_second()``, then exit with status 130.

    Args:
        dirpath: where ``last.ckpt`` goes when no ``ModelCheckpoint`` names a directory.
        on_second: called before the immediate exit (e.g. to record the run's state).
    """

    def __init__(self, dirpath: str | Path, on_second: Callable[[], None] | None = None) -> None:
        self.dirpath = Path(dirpath)
        self.on_second = on_second
        self.requested = False  # this process saw a Ctrl-C
        self.interrupted = False  # training stopped because of one
        self.saved: str | None = None
        self._previous: Any = None  # the SIGINT handler ours replaced
        self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            if self.on_second is not None:
                self.on_second()
            os._exit(EXIT_INTERRUPTED)
        self.requested = True
        print("\nlightning-accel: Ctrl-C: stopping after the step in flight and saving it; Ctrl-C again exits at once",
              file=sys.stderr, flush=True)

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()

    def _install(self) -> None:
        if not self._installed and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        """Put the replaced handler back (idempotent; one not set from Python comes back as the default)."""
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.SIG_DFL)
            self._previous, self._installed = None, False

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        stop = self.requested
        if _processes(trainer) > 1:  # every process stops after the same step, or the collectives hang (a pipeline's stages too)
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
            self.interrupted = True
            trainer.should_stop = True

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.interrupted:
            return
        checkpoint = next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath), None)
        dirpath = Path(checkpoint.dirpath) if checkpoint is not None else self.dirpath
        path = dirpath / f"last{ModelCheckpoint.FILE_EXTENSION}"
        trainer.save_checkpoint(path)  # every rank takes part; rank 0 writes
        self.saved = str(path)
        if checkpoint is not None:
            checkpoint.last_model_path = str(path)
