"""A checkpoint against the run about to resume from it, before any work: :func:`check_checkpoint`.

Lightning restores a checkpoint's optimizer and scheduler states over the ones the config builds, so a disagreement
either fails at the next step in torch's words (an AdamW checkpoint resumed with SGD: ``KeyError: 'momentum'``; a
finished one-cycle schedule extended by ``trainer.max_steps``: ``Tried to step 3 times``) or, worse, is silently
ignored (a new weight decay, a new learning rate, a scheduler added or dropped). Each is refused here naming both
sides: what the checkpoint holds and what the config builds, with the keys to change. The weights are checked by
name and shape (a fine-tune's checkpoint leaves out the frozen base's tensors, and says which: ``base_keys``). The
states are compared by structure and by the numbers torch keeps in them, on the optimizers and schedulers preflight
built on the meta device (:mod:`lightning_accel.config.optim_checks`); nothing is loaded into anything.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from lightning_accel.config.errors import UserError, one_line
from lightning_accel.config.optim_checks import Configured

__all__ = ["check_checkpoint"]

# what a scheduler's state keeps about its progress (not its settings), and what schedulers write into param groups
_PROGRESS = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial", "verbose"}
_SCHEDULED = {"lr", "momentum", "betas", "initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"}


def _load(path: str) -> dict[str, Any]:
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as err:
        line = one_line(str(err)) or type(err).__name__
        if "mmap can only be used with files saved with" in line or "zip archive" in line:
            line = "not a file torch.save wrote"
        raise UserError(f"ckpt_path='{path}' is not a readable checkpoint ({line[:120]}); pass a .ckpt written by a run, "
                        "or start without ckpt_path") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise UserError(f"ckpt_path='{path}' has no 'state_dict' (not a Lightning checkpoint); pass a .ckpt written by a run")
    return checkpoint


def check_checkpoint(path: str, module: Any, optimization: Configured | None = None, cfg: DictConfig | None = None) -> None:
    """``path`` loads as a Lightning checkpoint whose weights fit ``module`` (names and shapes) and, given what the
    config's ``configure_optimizers`` built (``optimization``), whose optimizer and scheduler states are theirs."""
    checkpoint = _load(path)
    _check_weights(path, checkpoint, module)
    if optimization is not None and cfg is not None and optimization.optimizers:
        _check_states(path, checkpoint, optimization, cfg)


def _check_weights(path: str, checkpoint: dict[str, Any], module: Any) -> None:
    from lightning_accel.models.finetune_checkpoint import adapter_option, base_keys

    weights = checkpoint["state_dict"]
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    frozen = base_keys(checkpoint)
    missing = [k for k in expected if k not in weights and k not in frozen]
    unexpected = [k for k in weights if k not in expected]
    wrong = [k for k in expected if k in weights and tuple(weights[k].shape) != expected[k]]
    if wrong:
        k = wrong[0]
        raise UserError(
            f"ckpt_path='{path}' does not fit this model: {k} is {tuple(weights[k].shape)} there, {expected[k]} here "
            f"({len(wrong)} tensors differ); resume with the model overrides of the run that wrote it"
        )
    if missing or unexpected:
        what = f"{len(missing)} of the model's tensors missing (e.g. {missing[0]})" if missing else f"{len(unexpected)} unknown tensors (e.g. {unexpected[0]})"
        fix = f"it is a fine-tune's ({adapter_option(checkpoint)}): resume with that model/adapter and its keys" if frozen else "it was written for another model"
        raise UserError(f"ckpt_path='{path}' does not fit this model: {what}; {fix}")


def _run_value(path: str, key: str) -> str | None:
    """``key`` in the config of the run that wrote ``path`` (``<run>/checkpoints/x.ckpt`` -> ``<run>/.hydra``)."""
    config = Path(path).resolve().parent.parent / ".hydra" / "config.yaml"
    try:
        value = OmegaConf.select(OmegaConf.load(config), key, default=None)
    except Exception:  # no run directory around it, or a config that no longer loads
        return None
    return None if value is None else str(value)


def _optimizer_classes(cls: type = torch.optim.Optimizer) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_optimizer_classes(sub)]
    return found


def _closest_optimizer(keys: set[str]) -> str | None:
    """The torch optimizers whose hyperparameters are exactly a saved param group's keys (``Adam or AdamW``: their
    groups hold the same keys)."""
    names = []
    for cls in _optimizer_classes():
        params = {p for p in inspect.signature(cls).parameters if p != "params"}
        if cls.__module__.startswith("torch.optim") and params and params <= keys and not (keys - params - _SCHEDULED - {"params", "decoupled_weight_decay"}):
            names.append(f"torch.optim.{cls.__name__}")
    return " or ".join(sorted(set(names))) or None


def _fix(path: str) -> str:
    return f"resume with the settings of the run that wrote it, or start without ckpt_path (ckpt_path='{path}' is kept)"


def _check_states(path: str, checkpoint: dict[str, Any], optimization: Configured, cfg: DictConfig) -> None:
    if "optimizer_states" not in checkpoint:
        raise UserError(f"ckpt_path='{path}' holds the weights only (ModelCheckpoint(save_weights_only=True)), no optimizer or "
                        "scheduler state to resume; pass a full checkpoint (checkpoints/last.ckpt)")
    saved = list(checkpoint.get("optimizer_states") or [])
    built = optimization.optimizers
    if len(saved) != len(built):
        raise UserError(f"ckpt_path='{path}' holds {len(saved)} optimizer state(s), this config builds {len(built)}; {_fix(path)}")
    saved_schedulers = list(checkpoint.get("lr_schedulers") or [])
    for state, optimizer in zip(saved, built):
        _check_optimizer(path, state, optimizer, scheduled=bool(saved_schedulers or optimization.schedulers))
    schedulers = optimization.schedulers
    if len(saved_schedulers) != len(schedulers):
        theirs = _run_value(path, "model.scheduler._target_") or f"{len(saved_schedulers)} scheduler(s)"
        ours = ", ".join(type(s).__name__ for s in schedulers) or "none"
        raise UserError(f"ckpt_path='{path}' was written with {theirs if saved_schedulers else 'no scheduler'}, model.scheduler builds "
                        f"{ours}: Lightning would {'drop' if saved_schedulers else 'start'} a schedule mid-run; {_fix(path)}")
    for state, scheduler in zip(saved_schedulers, schedulers):
        _check_scheduler(path, state, scheduler, cfg)


def _check_optimizer(path: str, state: dict[str, Any], optimizer: torch.optim.Optimizer, scheduled: bool) -> None:
    """Another optimizer (the keys it needs), another grouping, or another setting (a scheduler drives ``lr`` and the
    momenta, so those are the scheduler's to compare: ``base_lrs``)."""
    groups, name = state.get("param_groups") or [], type(optimizer).__name__
    if len(groups) != len(optimizer.param_groups):
        raise UserError(f"ckpt_path='{path}' has {len(groups)} param group(s) in its optimizer, this config's {name} has "
                        f"{len(optimizer.param_groups)}; {_fix(path)}")
    for saved, group in zip(groups, optimizer.param_groups):
        keys = {str(k) for k in saved}
        lacking = [k for k in optimizer.defaults if k not in keys]
        if lacking:
            theirs = _run_value(path, "model.optimizer._target_") or _closest_optimizer(keys) or "another optimizer"
            raise UserError(f"ckpt_path='{path}' holds the state of {theirs}, and this config's model.optimizer is {name}, which "
                            f"needs {', '.join(lacking)} it lacks; resume with model.optimizer._target_={theirs}, or start "
                            "without ckpt_path")
        for key, value in group.items():
            if (scheduled and key in _SCHEDULED) or key == "params" or key not in saved or not _numbers(value) or _same(saved[key], value):
                continue
            raise UserError(f"ckpt_path='{path}' has {name} {key}={_shown(saved[key])}, this config model.optimizer.{key}="
                            f"{_shown(value)}: the checkpoint's would silently win; resume with model.optimizer.{key}="
                            f"{_shown(saved[key])}, or start without ckpt_path")


def _numbers(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_numbers(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if _numbers(a) and _numbers(b):
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-12)
    return a == b


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _settings(state: dict[str, Any]) -> dict[str, Any]:
    return {str(k): v for k, v in state.items() if str(k) not in _PROGRESS and not str(k).startswith("_")}


def _source(cfg: DictConfig, key: str) -> str:
    """Where ``model.scheduler.<key>`` comes from: ``model.scheduler.total_steps (trainer.max_steps)``."""
    raw = OmegaConf.to_container(cfg.model.scheduler, resolve=False) if OmegaConf.select(cfg, "model.scheduler") is not None else {}
    text = raw.get(key) if isinstance(raw, dict) else None
    if isinstance(text, str) and text.startswith("${") and text.endswith("}"):
        return text[2:-1]
    return f"model.scheduler.{key}"


def _check_scheduler(path: str, state: dict[str, Any], scheduler: Any, cfg: DictConfig) -> None:
    name = type(scheduler).__name__
    saved, built = _settings(state), _settings(scheduler.state_dict())
    if set(saved) != set(built):
        theirs = _run_value(path, "model.scheduler._target_") or "another scheduler"
        raise UserError(f"ckpt_path='{path}' holds the state of {theirs}, this config's model.scheduler is {name} (its state keeps "
                        f"{', '.join(sorted(built))}, the checkpoint's {', '.join(sorted(saved))}); {_fix(path)}")
    for key in sorted(built):
        if _same(saved[key], built[key]):
            continue
        if key == "base_lrs":
            had = _run_value(path, "model.optimizer.lr")
            source = "model.optimizer.lr: the rate the schedule starts from"
            resume = f"model.optimizer.lr={had}" if had is not None else "the learning rate that run had"
        else:
            source = _source(cfg, key)
            resume = f"{source}={_shown(saved[key])}"
        raise UserError(f"ckpt_path='{path}' has a {name} with {key}={_shown(saved[key])}, this config builds {key}="
                        f"{_shown(built[key])} ({source}): a schedule restored from a checkpoint keeps its own {key}, so the run "
                        f"would not follow the new one; resume with {resume}, or start without ckpt_path")
