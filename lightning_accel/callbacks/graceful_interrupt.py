"""GracefulInterrupt: a signal ends training at the next step boundary, with that step saved.

What SLURM, Kubernetes and spot instances send before they kill a job (``SIGTERM``), a Ctrl-C (``SIGINT``) and
SLURM's requeue signal (``SIGUSR1``, when Lightning's ``SLURMEnvironment(auto_requeue=True)`` is the cluster
environment) all mean the same here: finish the step in flight, write it to ``last.ckpt`` (atomically, through the
trainer's checkpoint IO), and stop with :class:`RunInterrupted`, whose exit status is what a shell reports for a
command that signal ended (``128 + signum``: 143 for SIGTERM, 130 for SIGINT). Stopping in the middle of a step is not
safe (an offloaded optimizer updates parameters block by block during backward), and Lightning's own SIGTERM handling
ends the fit with ``SystemExit(None)``, status 0, and no checkpoint.

Every process of a multi-process run takes part: each step ends with one all-reduce of the signal any process saw, so
every rank stops after the same step and saves together (the pipeline's stages too); the signal can reach any one of
them (Kubernetes signals rank 0 only, SLURM every task). A step that does not end within ``grace_s`` of the signal
(a hung collective, a step longer than the scheduler waits) ends the process at once, ``on_timeout`` told first, so the
scheduler's SIGKILL never finds it still running. A second Ctrl-C means "now": ``on_second``, then exit 130; a second
SIGTERM changes nothing (a launcher that forwards the scheduler's signal sends two).

The handlers are installed for the fit's loops (from the sanity check, or the training loop's start) and put back at
``teardown``, or at ``on_exception`` when the fit raises (Lightning calls no teardown then), so a notebook's next Ctrl-C
after a failed fit interrupts the kernel as usual. Not earlier: Lightning snapshots every signal handler after
``on_fit_start`` and re-installs that snapshot when the fit ends, failed or not; a handler installed at ``setup`` would
come back after ``on_exception`` had put the old one back. Before the loops, :func:`stop_on_signals` makes a signal end
the set-up at once (there is nothing to save yet).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, what a shell reports for a Ctrl-C'd command
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEFAULT_GRACE_S = 120.0  # the longest a signalled run waits for its step to end before it exits unsaved


def exit_status(signum: int) -> int:
    """What a shell reports for a command that ``signum`` ended: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class RunInterrupted(BaseException):
    """The fit stopped on a signal at a step boundary. ``checkpoint``: the step saved (None: stopped before the
    training loop, nothing to save); ``requeued``: SLURM was asked to requeue the job. A ``BaseException``, as
    ``KeyboardInterrupt`` is, so that no ``except Exception`` on the way takes it for a failure."""

    def __init__(self, signum: int, step: int, checkpoint: str | None = None, requeued: bool = False,
                 seconds: dict[str, float] | None = None) -> None:
        super().__init__(f"{signal_name(signum)} at step {step}")
        self.signum, self.step, self.checkpoint, self.requeued = int(signum), step, checkpoint, requeued
        self.seconds = seconds or {}  # save: the checkpoint's write; signal_to_saved: from the signal to the checkpoint written

    @property
    def exit_status(self) -> int:
        return exit_status(self.signum)


def _processes(trainer: pl.Trainer) -> int:
    """Every process of the run: ``trainer.world_size`` counts replicas, and a pipeline replica is several processes."""
    return max(trainer.world_size, dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1)


def slurm_job_id() -> str | None:
    """The job id ``scontrol requeue`` takes (an array task as ``<array job>_<task>``), as Lightning's SLURM handler
    finds it; None outside SLURM."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if array_job else os.environ.get("SLURM_JOB_ID")
    return job if job and re.fullmatch(r"[0-9_-]+", job) else None


def requeue_slurm_job(job_id: str) -> bool:
    """``scontrol requeue <job_id>``, as ``SLURMEnvironment(auto_requeue=True)`` does; whether it succeeded."""
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], check=False, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        print(f"lightning-accel: could not requeue SLURM job {job_id}: {err}", file=sys.stderr, flush=True)
        return False
    if result.returncode != 0:
        print(f"lightning-accel: scontrol requeue {job_id} failed ({result.returncode}): {result.stderr.strip()}", file=sys.stderr, flush=True)
    return result.returncode == 0


class GracefulInterrupt(Callback):
    """SIGTERM, SIGINT or SLURM's requeue signal: finish the step, save ``last.ckpt``, raise :class:`RunInterrupted`.

    Args:
        dirpath: where ``last.ckpt`` goes when no ``ModelCheckpoint`` names a directory.
        on_second: called before the immediate exit of a second Ctrl-C (e.g. to record the run's state).
        grace_s: the longest the step in flight and the save may take after the signal; past it the process exits
            unsaved with the signal's status, ``on_timeout`` called first.
        on_timeout: called (from a timer thread) before that exit.
    """

    def __init__(self, dirpath: str | Path, on_second: Callable[[], None] | None = None, grace_s: float = DEFAULT_GRACE_S,
                 on_timeout: Callable[[int], None] | None = None) -> None:
        if not grace_s > 0:
            raise ValueError(f"grace_s={grace_s!r}: the grace period must be a positive number of seconds; e.g. grace_s=120")
        self.dirpath = Path(dirpath)
        self.on_second, self.on_timeout, self.grace_s = on_second, on_timeout, float(grace_s)
        self.signum = 0  # the first signal this process saw
        self.requested = False  # this process saw one
        self.interrupted = False  # training stopped because of one
        self.saved: str | None = None
        self._previous: dict[int, Any] = {}  # the handlers ours replaced
        self._installed = False
        self._requeue_signal: int | None = None
        self._timer: threading.Timer | None = None
        self._signalled_at: float | None = None
        self._launcher_procs: Callable[[], list[Any]] = list

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            if signum == signal.SIGINT and self.signum == signal.SIGINT:  # a person pressing Ctrl-C again
                if self.on_second is not None:
                    self.on_second()
                self._end_launched(signal.SIGKILL)
                os._exit(EXIT_INTERRUPTED)
            return  # a forwarded or repeated SIGTERM: the timer bounds the wait
        self.requested, self.signum, self._signalled_at = True, int(signum), time.monotonic()
        again = "; Ctrl-C again exits at once" if signum == signal.SIGINT else ""
        print(f"\nlightning-accel: {signal_name(signum)}: stopping after the step in flight and saving it "
              f"(at most {self.grace_s:g} s){again}", file=sys.stderr, flush=True)
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        """The grace period ran out before the step ended: say so, end the ranks this process started, exit."""
        print(f"lightning-accel: {signal_name(self.signum)}: the step in flight did not end within {self.grace_s:g} s; "
              "exiting without saving it", file=sys.stderr, flush=True)
        if self.on_timeout is not None:
            with contextlib.suppress(Exception):
                self.on_timeout(self.signum)
        self._end_launched(signal.SIGKILL)
        os._exit(exit_status(self.signum))

    def _end_launched(self, sig: int) -> None:
        for proc in self._launcher_procs():
            with contextlib.suppress(Exception):
                proc.send_signal(sig)

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    def _install(self, trainer: pl.Trainer) -> None:
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        launcher = getattr(trainer.strategy, "launcher", None)
        self._launcher_procs = lambda: list(getattr(launcher, "procs", None) or [])
        environment = getattr(trainer._accelerator_connector, "cluster_environment", None)
        signals: list[int] = list(STOP_SIGNALS)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal is not None:
            self._requeue_signal = int(environment.requeue_signal)  # replaces Lightning's hpc_ckpt handler
            signals.append(self._requeue_signal)
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._installed = True

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        """Put the replaced handlers back (idempotent; one not set from Python comes back as the default)."""
        if self._installed:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            self._previous, self._installed = {}, False

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _agreed(self, trainer: pl.Trainer) -> int:
        """The signal any process saw (0: none): one all-reduce, so every process stops after the same step, or the
        collectives hang (a pipeline's stages too)."""
        if _processes(trainer) <= 1 or not (dist.is_available() and dist.is_initialized()):
            return self.signum
        seen = torch.tensor([self.signum], dtype=torch.int32, device=trainer.strategy.root_device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        return int(seen.item())

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        signum = self._agreed(trainer)
        if not signum:
            return
        self.interrupted, self.signum = True, signum
        checkpoint = next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath), None)
        dirpath = Path(checkpoint.dirpath) if checkpoint is not None else self.dirpath
        path = dirpath / f"last{ModelCheckpoint.FILE_EXTENSION}"
        start = time.monotonic()
        trainer.save_checkpoint(path, weights_only=False)  # every rank takes part; rank 0 writes (atomically: the trainer's checkpoint IO)
        self.saved = str(path)
        if checkpoint is not None:
            checkpoint.last_model_path = str(path)
        requeued = False
        if signum == self._requeue_signal and (job := slurm_job_id()) is not None:
            requeued = trainer.is_global_zero and requeue_slurm_job(job)
        self.cancel_timer()
        saved = time.monotonic()
        seconds = {"save": round(saved - start, 3)}
        if self._signalled_at is not None:  # this process saw the signal (another rank's: the all-reduce told it)
            seconds["signal_to_saved"] = round(saved - self._signalled_at, 3)
        raise RunInterrupted(signum, trainer.global_step, str(path), requeued, seconds)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Until the training loop installs :class:`GracefulInterrupt`'s handlers: SIGTERM or SIGINT raises
    :class:`RunInterrupted` at once (set-up has nothing to save); the previous handlers come back on exit."""

    def stop(signum: int, frame: Any) -> None:
        raise RunInterrupted(signum, 0)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
