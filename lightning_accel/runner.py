"""Running one composed recipe: instantiate everything, fit, validate, report.

This is the Hydra task function behind ``lightning-accel run``. It builds the objects the
way a Lightning user would by hand (data module, LightningModule, callbacks, loggers,
strategy, plugins, Trainer), trains, measures the final validation metrics on the trained
weights, and leaves a ``run.json`` in the run directory that says whether the run
finished and where its checkpoint, logs and metrics are.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.plugins.io import CheckpointIO
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_accel.atomic import atomic_write_text
from lightning_accel.callbacks.graceful_interrupt import (DEFAULT_GRACE_S, GracefulInterrupt, RunInterrupted, signal_name, slurm_job_id,
                                                          stop_on_signals)
from lightning_accel.callbacks.random_state import RandomState
from lightning_accel.config.errors import UserError, failure_line, missing_file_line
from lightning_accel.console import KNOWN_WARNINGS, DropNoise
from lightning_accel.models import load_peak
from lightning_accel.plugins.io.atomic import AtomicCheckpointIO
from lightning_accel.run_dir import find_last_checkpoint, newest_checkpoint, remove_run_dir, this_process


class RunFailed(BaseException):
    """A run stopped by an exception that got past preflight, already recorded: ``run.json`` says ``failed``
    with ``line``, the traceback is in the run's log, the directory is removed or kept. The CLI prints
    ``line`` and exits 1. A ``BaseException``, as ``SystemExit`` is, so that Hydra's job runner lets it
    through instead of printing its own "Error executing job" line and the traceback again; the
    exception that stopped the run is its ``__cause__``."""

    def __init__(self, line: str, rank: int = 0) -> None:
        super().__init__(line)
        self.line = line
        self.rank = rank


def build_model(cfg: DictConfig) -> pl.LightningModule:
    """The LightningModule of ``cfg.model``; a bare nn.Module is refused with the fix."""
    model = instantiate(cfg.model)
    if isinstance(model, pl.LightningModule):
        return model
    if isinstance(model, nn.Module):
        cls = f"{type(model).__module__}.{type(model).__qualname__}"
        raise UserError(
            f"model._target_ built a plain nn.Module ({cls}), which has no training_step; wrap it in a task: "
            f"model=gpt model.net._target_={cls} (language modelling) or model=cnn model.net._target_={cls} (classification)"
        )
    raise UserError(f"model._target_ built {type(model).__name__}, not a LightningModule; point it at a LightningModule or nn.Module class")


def build_strategy(cfg: DictConfig) -> Any:
    """``cfg.strategy``'s class (a ``_target_`` node), or Lightning's choice for ``strategy=auto`` (no node)."""
    node = cfg.get("strategy")
    return instantiate(node) if node else "auto"


def build_plugins(cfg: DictConfig) -> list[Any]:
    plugins = [instantiate(p) for p in cfg.get("plugins") or []]
    # Checkpoints are written to a temporary file and renamed, so a crash or a full disk
    # mid-write never replaces a good checkpoint with half of one.
    if not any(isinstance(p, CheckpointIO) for p in plugins):
        plugins.append(AtomicCheckpointIO())
    return plugins


def _named(cfg_node: DictConfig | None) -> list[Any]:
    if not cfg_node:
        return []
    return [instantiate(node) for node in cfg_node.values() if node is not None]


def resolve_ckpt_path(cfg: DictConfig, recipe_root: Path) -> str | None:
    """``cfg.ckpt_path`` as a file: ``last`` becomes the newest checkpoint of a run of this
    recipe that built the same network (see :func:`lightning_accel.run_dir.find_last_checkpoint`)."""
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path != "last":
        if ckpt_path is not None and not Path(ckpt_path).is_file():
            raise UserError(missing_file_line("ckpt_path", ckpt_path, "pass an existing .ckpt file or ckpt_path=last"))
        return ckpt_path
    return str(find_last_checkpoint(recipe_root, cfg))


def _write_status(output_dir: Path, status: dict[str, Any]) -> None:
    if rank_zero_only.rank != 0:  # DDP ranks share the run directory; rank 0 speaks for the run
        return
    atomic_write_text(output_dir / "run.json", json.dumps(status, indent=2, default=str))


def _trainer_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """Settings that depend on where the run prints: a progress bar redraws in place on a
    terminal, but piped to a file each redraw is one more line."""
    if cfg.trainer.get("enable_progress_bar") is None and not sys.stderr.isatty():
        return {"enable_progress_bar": False}
    return {}


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit the recipe and return its summary (final metrics and where things went). A signal (SIGTERM, SIGINT, SLURM's
    requeue signal) ends it at the next step boundary with that step saved, ``run.json`` ``interrupted``, and exit status
    ``128 + signum`` (see :mod:`lightning_accel.callbacks.graceful_interrupt`)."""
    with stop_on_signals():
        return _train(cfg)


def _train(cfg: DictConfig) -> dict[str, Any]:
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    status: dict[str, Any] = {"status": "running", "recipe": HydraConfig.get().job.config_name, **this_process()}
    if (job := slurm_job_id()) is not None:
        status["slurm_job"] = job  # a requeued job resumes from this run (config.preflight)
    _write_status(output_dir, status)
    started = time.perf_counter()

    def interrupted_now() -> None:  # a second Ctrl-C: no checkpoint, but a true run.json
        status.update(status="interrupted", signal="SIGINT", error="second Ctrl-C: exited without saving",
                      seconds=round(time.perf_counter() - started, 1))
        _write_status(output_dir, status)

    def timed_out(signum: int) -> None:  # the step in flight outlived the grace period
        status.update(status="interrupted", signal=signal_name(signum), seconds=round(time.perf_counter() - started, 1),
                      error=f"{signal_name(signum)}: the step in flight did not end within {grace_s:g} s; exited without saving it "
                            f"(interrupt_grace_s={grace_s:g}; the newest checkpoint, if any, is older)")
        _write_status(output_dir, status)

    grace_s = float(cfg.get("interrupt_grace_s") or DEFAULT_GRACE_S)
    interrupt = GracefulInterrupt(output_dir / "checkpoints", on_second=interrupted_now, grace_s=grace_s, on_timeout=timed_out)
    trainer: pl.Trainer | None = None
    try:
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
        datamodule = instantiate(cfg.data)
        model = build_model(cfg)
        if (loaded := load_peak.find(model)) is not None:
            rank_zero_info(f"lightning-accel: {loaded.describe()}")
        # RNG states ride in every checkpoint, so a resumed run draws what the original would have.
        callbacks = [*_named(cfg.get("callbacks")), RandomState(), interrupt]
        loggers = _named(cfg.get("logger"))
        trainer = instantiate(
            cfg.trainer,
            callbacks=callbacks,
            logger=loggers or False,
            strategy=build_strategy(cfg),
            plugins=build_plugins(cfg),
            **_trainer_kwargs(cfg),
        )
        resumed_from = resolve_ckpt_path(cfg, output_dir.parent)
        if resumed_from is not None:
            status["resumed_from"] = resumed_from
            rank_zero_info(f"lightning-accel: resuming from {resumed_from}")
        trainer.fit(model, datamodule=datamodule, ckpt_path=resumed_from)
        final = trainer.validate(model, datamodule=datamodule, verbose=False)
    except RunInterrupted as stop:
        interrupt.cancel_timer()
        return _interrupted(stop, status, cfg, output_dir, trainer, round(time.perf_counter() - started, 1))
    except Exception as err:  # past preflight: one line, the traceback in the log (see _failed)
        line = failure_line(err)
        status.update(status="failed", error=line, seconds=round(time.perf_counter() - started, 1))
        _write_status(output_dir, status)
        failed = _failed(err, line, cfg, output_dir, trainer)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise  # the traceback, as Hydra shows it with that variable
        raise failed from err
    except BaseException as err:  # SystemExit (Lightning's own SIGTERMException is one, of status 0: made 143)
        code = getattr(err, "code", None)
        signalled = type(err).__name__ == "SIGTERMException"
        status.update(status="interrupted" if signalled else "failed", error=f"{type(err).__name__}: {err}",
                      seconds=round(time.perf_counter() - started, 1))
        _write_status(output_dir, status)
        if signalled or (isinstance(err, SystemExit) and code in (None, 0)):
            sys.exit(128 + 15 if signalled else 1)  # never status 0 for a run that did not finish
        raise
    assert trainer is not None
    metrics = {k: float(v) for k, v in (final[0] if final else {}).items()}
    status.update(
        status="completed",
        seconds=round(time.perf_counter() - started, 1),
        global_step=trainer.global_step,
        metrics=metrics,
        output_dir=str(output_dir),
        checkpoint=_checkpoint_of(trainer, output_dir),
        metrics_csv=_metrics_file(trainer),
        config=str(output_dir / ".hydra" / "config.yaml"),
        log=str(output_dir / f"{HydraConfig.get().job.name}.log"),
    )
    _write_status(output_dir, status)
    if trainer.is_global_zero:
        print(summary(status), flush=True)
    return status


def _interrupted(stop: RunInterrupted, status: dict[str, Any], cfg: DictConfig, output_dir: Path, trainer: pl.Trainer | None,
                 seconds: float) -> NoReturn:
    """A signal ended the run: ``run.json`` ``interrupted`` with the step and its checkpoint, the ranks this process
    started ended, the summary printed, exit ``128 + signum``. Stopped before the training loop (nothing saved, nothing to
    resume), the run directory is removed as a failed run's is (``keep_failed=true`` keeps it)."""
    checkpoint = stop.checkpoint or _checkpoint_of(trainer, output_dir)
    step = stop.step or (trainer.global_step if trainer is not None else 0)  # a signal in the closing validation: the fit's
    status.update(status="interrupted", signal=signal_name(stop.signum), seconds=seconds, global_step=step,
                  checkpoint=checkpoint, output_dir=str(output_dir), metrics={},
                  metrics_csv=_metrics_file(trainer) if trainer is not None else None,
                  config=str(output_dir / ".hydra" / "config.yaml"), log=str(output_dir / f"{HydraConfig.get().job.name}.log"))
    if stop.requeued:
        status["requeued"] = True
    if stop.seconds:
        status["interrupt_seconds"] = stop.seconds  # what a scheduler's grace period must cover (docs/reliability.md)
    _write_status(output_dir, status)
    if rank_zero_only.rank == 0:
        end_ranks(trainer, grace_s=10.0)  # every rank stopped after the same step; none is left running
        if checkpoint is None and not bool(cfg.get("keep_failed", False)):
            remove_run_dir(output_dir, keep_parent=HydraConfig.get().mode == RunMode.MULTIRUN)
            print(f"lightning-accel: {signal_name(stop.signum)} before the first step: nothing to save, so the run directory is "
                  "removed", file=sys.stderr, flush=True)
        else:
            print(summary(status), flush=True)
    sys.exit(stop.exit_status)


def _failed(err: Exception, line: str, cfg: DictConfig, output_dir: Path, trainer: pl.Trainer | None) -> RunFailed:
    """Record a failed run and say it in one line: the traceback goes to the run's log file; a run
    that wrote no checkpoint yet has nothing to resume from, so its directory is removed (rank 0,
    unless ``keep_failed=true``) and leaves nothing stale behind."""
    rank = rank_zero_only.rank
    log = output_dir / f"{HydraConfig.get().job.name}.log"
    try:
        with log.open("a", encoding="utf-8") as f:
            f.write(f"lightning-accel: run failed{f' on rank {rank}' if rank else ''}: {line}\n")
            f.write("".join(traceback.format_exception(err)))
    except OSError:  # another rank removed the directory already, or the disk that failed holds it
        pass
    if bool(cfg.get("keep_failed", False)) or _checkpoint_of(trainer, output_dir) is not None:
        return RunFailed(f"{line} (traceback: {log})", rank)
    if rank == 0:
        end_ranks(trainer)  # a rank still starting would make the directory again, and leave its log in it
        remove_run_dir(output_dir, keep_parent=HydraConfig.get().mode == RunMode.MULTIRUN)
    return RunFailed(f"{line} (nothing was checkpointed, so the run directory is removed; keep_failed=true keeps it, "
                     "with the traceback in its log)", rank)


def end_ranks(trainer: pl.Trainer | None, grace_s: float = 2.0) -> None:
    """Wait for the ranks this process started (Lightning's subprocess launcher) to end, ``grace_s`` for each to fail
    on its own, then terminated, then killed: the run directory is removed only after, so no rank leaves its log
    (or Hydra's ``.hydra``) in a directory that rank 0 removed."""
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    for proc in list(getattr(launcher, "procs", None) or []):
        for stop, wait_s in ((None, grace_s), (proc.terminate, 3.0), (proc.kill, 10.0)):
            if proc.poll() is not None:
                break
            if stop is not None:
                stop()
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue


def _checkpoint_of(trainer: pl.Trainer | None, output_dir: Path) -> str | None:
    """The run's newest checkpoint: ModelCheckpoint's, else one in the run dir (a resumed
    run that reached its end without a new one has the copy it resumed from: none)."""
    checkpoint = trainer.checkpoint_callback if trainer is not None else None
    path = (checkpoint.last_model_path or checkpoint.best_model_path) if checkpoint else None
    if path and Path(path).is_file():
        return path
    newest = newest_checkpoint(output_dir)
    return str(newest) if newest is not None else None


def _metrics_file(trainer: pl.Trainer) -> str | None:
    for logger in trainer.loggers:
        path = Path(logger.log_dir or "") / "metrics.csv" if getattr(logger, "log_dir", None) else None
        if path is not None and path.is_file():
            return str(path)
    return None


def summary(status: dict[str, Any]) -> str:
    """The closing lines of a run: where everything went and the final metrics."""
    metrics = "  ".join(f"{k}={v:.4f}" for k, v in sorted(status["metrics"].items())) or "(not validated)"
    if status["checkpoint"]:
        checkpoint = status["checkpoint"]
    elif status.get("resumed_from"):
        checkpoint = f"(none new; resumed from {status['resumed_from']})"
    else:
        checkpoint = "(none: no ModelCheckpoint callback, e.g. callbacks=none)"
    how = "Ctrl-C" if status.get("signal", "SIGINT") == "SIGINT" else status["signal"]
    ended = f"interrupted ({how}{', requeued' if status.get('requeued') else ''}) after" if status["status"] == "interrupted" else "finished"
    return "\n".join(
        [
            f"lightning-accel: {status['recipe']} {ended} {status['global_step']} steps in {status['seconds']} s",
            f"  checkpoint: {checkpoint}",
            f"  metrics:    {status['metrics_csv'] or '(no CSV logger)'}",
            f"  logs:       {status['log']}",
            f"  config:     {status['config']}",
            f"  final:      {metrics}",
        ]
    )


class _Tee(io.TextIOBase):
    """stdout that also appends to the run's log file (plans and summaries are printed)."""

    def __init__(self, stream: Any, path: Path) -> None:
        self.stream = stream
        self.file = path.open("a", encoding="utf-8")

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.file.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


def route_output() -> None:
    """Lightning's messages and Python warnings go through Hydra's handlers (the console and
    the run's log file) instead of Lightning's own stderr handler, which the log file never
    saw; product tips and known third-party deprecations are dropped (:mod:`lightning_accel.console`)."""
    root = logging.getLogger()
    for handler in root.handlers:
        handler.addFilter(DropNoise())
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = bool(root.handlers)
    for pattern in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    logging.captureWarnings(bool(root.handlers))


def task(cfg: DictConfig) -> float | None:
    """Hydra task: train, and return ``cfg.optimized_metric`` for sweepers."""
    OmegaConf.resolve(cfg)
    route_output()
    stdout = sys.stdout
    tee = _Tee(stdout, Path(HydraConfig.get().runtime.output_dir) / f"{HydraConfig.get().job.name}.log")
    sys.stdout = tee
    try:
        status = train(cfg)
    except RunFailed as failed:
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # a failed trial, which a sweeper may go on after
            raise CompactHydraException(f"lightning-accel: error: {failed.line}") from None
        raise
    finally:
        sys.stdout = stdout
        tee.flush()
        tee.file.close()
        # route_output's capture undone: the CLI's warnings.catch_warnings puts warnings.showwarning back on its
        # own, and logging would then take a later captureWarnings(True) in this process (a test, a notebook) as done
        logging.captureWarnings(False)
    value = status["metrics"].get(cfg.get("optimized_metric") or "")
    return float(value) if value is not None else None
