"""Running one composed recipe: instantiate everything, fit, validate, report.

This is the Hydra task function behind ``lightning-accel run``. It builds the objects the
way a Lightning user would by hand (data module, LightningModule, callbacks, loggers,
strategy, plugins, Trainer), trains, measures the final validation metrics on the trained
weights, and leaves a ``run.json`` in the run directory that says whether the run
finished and where its checkpoint, logs and metrics are.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.plugins.io import CheckpointIO
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_accel.atomic import atomic_write_text
from lightning_accel.config.errors import UserError
from lightning_accel.plugins.io.atomic import AtomicCheckpointIO


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
    node = cfg.get("strategy")
    if node is None:
        return "auto"
    return instantiate(node) if "_target_" in node else str(node.name)


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


def _resolve_ckpt_path(ckpt_path: str | None, output_dir: Path) -> str | None:
    if ckpt_path != "last":
        if ckpt_path is not None and not Path(ckpt_path).is_file():
            raise UserError(f"ckpt_path='{ckpt_path}' does not exist; pass an existing .ckpt file or ckpt_path=last")
        return ckpt_path
    candidates = sorted(output_dir.parent.glob("*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise UserError(f"ckpt_path=last but no earlier run of this recipe under {output_dir.parent} has a last.ckpt; start without ckpt_path")
    return str(candidates[-1])


def _write_status(output_dir: Path, status: dict[str, Any]) -> None:
    if rank_zero_only.rank != 0:  # DDP ranks share the run directory; rank 0 speaks for the run
        return
    atomic_write_text(output_dir / "run.json", json.dumps(status, indent=2, default=str))


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit the recipe and return its summary (final metrics and where things went)."""
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    status: dict[str, Any] = {"status": "running", "recipe": HydraConfig.get().job.config_name}
    _write_status(output_dir, status)
    started = time.perf_counter()
    try:
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
        datamodule = instantiate(cfg.data)
        model = build_model(cfg)
        callbacks = _named(cfg.get("callbacks"))
        loggers = _named(cfg.get("logger"))
        trainer: pl.Trainer = instantiate(
            cfg.trainer,
            callbacks=callbacks,
            logger=loggers or False,
            strategy=build_strategy(cfg),
            plugins=build_plugins(cfg),
        )
        trainer.fit(model, datamodule=datamodule, ckpt_path=_resolve_ckpt_path(cfg.get("ckpt_path"), output_dir))
        final = trainer.validate(model, datamodule=datamodule, verbose=False)
    except BaseException as err:
        status.update(status="failed", error=f"{type(err).__name__}: {err}", seconds=time.perf_counter() - started)
        _write_status(output_dir, status)
        raise
    metrics = {k: float(v) for k, v in (final[0] if final else {}).items()}
    checkpoint = trainer.checkpoint_callback
    status.update(
        status="completed",
        seconds=round(time.perf_counter() - started, 1),
        global_step=trainer.global_step,
        metrics=metrics,
        output_dir=str(output_dir),
        checkpoint=(checkpoint.last_model_path or checkpoint.best_model_path) if checkpoint else None,
        metrics_csv=_metrics_file(trainer),
        config=str(output_dir / ".hydra" / "config.yaml"),
        log=str(output_dir / f"{HydraConfig.get().job.name}.log"),
    )
    _write_status(output_dir, status)
    if trainer.is_global_zero:
        print(summary(status))
    return status


def _metrics_file(trainer: pl.Trainer) -> str | None:
    for logger in trainer.loggers:
        path = Path(logger.log_dir or "") / "metrics.csv" if getattr(logger, "log_dir", None) else None
        if path is not None and path.is_file():
            return str(path)
    return None


def summary(status: dict[str, Any]) -> str:
    """The closing lines of a run: where everything went and the final metrics."""
    metrics = "  ".join(f"{k}={v:.4f}" for k, v in sorted(status["metrics"].items()))
    return "\n".join(
        [
            f"lightning-accel: {status['recipe']} finished {status['global_step']} steps in {status['seconds']} s",
            f"  checkpoint: {status['checkpoint'] or '(none: callbacks=none)'}",
            f"  metrics:    {status['metrics_csv'] or '(no CSV logger)'}",
            f"  logs:       {status['log']}",
            f"  config:     {status['config']}",
            f"  final:      {metrics}",
        ]
    )


def task(cfg: DictConfig) -> float | None:
    """Hydra task: train, and return ``cfg.optimized_metric`` for sweepers."""
    OmegaConf.resolve(cfg)
    status = train(cfg)
    value = status["metrics"].get(cfg.get("optimized_metric") or "")
    return float(value) if value is not None else None
