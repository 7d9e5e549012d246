"""The Trainer's loop values and the seed, checked before any work: :func:`check_loop`.

Lightning's ``Trainer(...)`` checks some of its arguments when it is built and preflight builds one (the loop settings
on the CPU), so those checks are Lightning's own; what it raises is reworded here into our one line, naming the key
(``trainer.max_time='2h'``), what is allowed and an example. What Lightning takes unchecked and then trains in silence
or divides by later is checked here, one rule per key (:data:`LOOP_KEYS`): ``limit_train_batches=0`` "finishes" without
a step, ``val_check_interval=0`` and ``log_every_n_steps=0`` divide by zero at the first step, a negative
``gradient_clip_val`` clips nothing, a ``min_steps`` above ``max_steps`` trains ``max_steps``; and the seed, which numpy
refuses outside ``[0, 2**32 - 1]`` only once the run has started.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_accel.config.errors import UserError, one_line

__all__ = ["LOOP_KEYS", "check_loop", "check_seed", "check_trainer"]

_SEED_MAX = 2**32 - 1  # numpy's RandomState bound, which seed_everything seeds too


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _batches(zero: bool) -> Callable[[Any], bool]:
    """A count of batches, or a fraction of the epoch (``zero``: 0 allowed, i.e. skip the loop)."""
    return lambda v: v is None or (_int(v) and v >= (0 if zero else 1)) or (
        isinstance(v, float) and (0.0 <= v <= 1.0 if zero else 0.0 < v <= 1.0))


def _duration(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, str):
        return re.fullmatch(r"\d+:\d+:\d+:\d+", value.strip()) is not None
    if isinstance(value, Mapping):
        keys = {"weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds"}
        return bool(value) and all(k in keys and _number(v) and v >= 0 for k, v in value.items())
    return False


def _devices(value: Any) -> bool:
    if _int(value):
        return value >= 1 or value == -1
    if isinstance(value, str):
        return value.strip() in ("auto", "-1") or re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*,?", value) is not None and value.strip() != "0"
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_int(v) and v >= 0 for v in value)
    return False


@dataclass(frozen=True)
class LoopKey:
    """What one Trainer key allows, in words, with an example, and ``ok``: whether a value is one of them."""

    allowed: str
    example: str
    ok: Callable[[Any], bool]


LOOP_KEYS: dict[str, LoopKey] = {
    "max_steps": LoopKey("a number of optimizer steps >= 1, or -1 (max_epochs bounds the run)", "800",
                         lambda v: _int(v) and (v >= 1 or v == -1)),
    "min_steps": LoopKey("a number of steps >= 0 (at most trainer.max_steps), or null", "null", lambda v: v is None or _int(v) and v >= 0),
    "max_epochs": LoopKey("a number of epochs >= 1, -1 (max_steps bounds the run) or null", "-1",
                          lambda v: v is None or _int(v) and (v >= 1 or v == -1)),
    "min_epochs": LoopKey("a number of epochs >= 0 (at most trainer.max_epochs), or null", "null", lambda v: v is None or _int(v) and v >= 0),
    "max_time": LoopKey("a duration DD:HH:MM:SS, a mapping such as {hours: 2}, or null", "00:02:00:00", _duration),
    "limit_train_batches": LoopKey("a number of batches >= 1, a fraction of the epoch in (0, 1], or null (all)", "1.0", _batches(zero=False)),
    "limit_val_batches": LoopKey("a number of batches >= 0 (0 skips validation), a fraction in [0, 1], or null", "20", _batches(zero=True)),
    "limit_test_batches": LoopKey("a number of batches >= 0, a fraction in [0, 1], or null", "1.0", _batches(zero=True)),
    "limit_predict_batches": LoopKey("a number of batches >= 0, a fraction in [0, 1], or null", "1.0", _batches(zero=True)),
    "overfit_batches": LoopKey("a number of batches >= 0 or a fraction in [0, 1] (0: off)", "0", _batches(zero=True)),
    "val_check_interval": LoopKey("a number of training steps >= 1, a fraction of the epoch in (0, 1], or null", "100",
                                  _batches(zero=False)),
    "check_val_every_n_epoch": LoopKey("a number of epochs >= 1, or null (validate by val_check_interval steps)", "null",
                                       lambda v: v is None or _int(v) and v >= 1),
    "num_sanity_val_steps": LoopKey("a number of batches >= 0, or -1 (the whole validation set)", "0",
                                    lambda v: v is None or _int(v) and v >= -1),
    "log_every_n_steps": LoopKey("a number of steps >= 1", "10", lambda v: v is None or _int(v) and v >= 1),
    "accumulate_grad_batches": LoopKey("a number of batches >= 1 (1: no accumulation)", "1", lambda v: _int(v) and v >= 1),
    "gradient_clip_val": LoopKey("a gradient norm (or value) >= 0 to clip to (0 or null: no clipping)", "1.0",
                                 lambda v: v is None or _number(v) and v >= 0),
    "gradient_clip_algorithm": LoopKey("norm or value", "norm", lambda v: v is None or v in ("norm", "value")),
    "reload_dataloaders_every_n_epochs": LoopKey("a number of epochs >= 0 (0: never)", "0", lambda v: _int(v) and v >= 0),
    "fast_dev_run": LoopKey("true, false or a number of batches >= 0", "false", lambda v: isinstance(v, bool) or _int(v) and v >= 0),
    "devices": LoopKey("a number of devices >= 1, -1 (all), auto, or a list of device indices", "1", _devices),
    "num_nodes": LoopKey("a number of machines >= 1", "1", lambda v: _int(v) and v >= 1),
    "deterministic": LoopKey("true, false, warn or null", "null", lambda v: v is None or isinstance(v, bool) or v == "warn"),
    "benchmark": LoopKey("true, false or null", "null", lambda v: v is None or isinstance(v, bool)),
}
# a key Lightning's own check refuses in words that do not name it is found by its value in them
_QUOTED = re.compile(r"'([^']*)'")


def _shown(value: Any) -> str:
    return f"'{value}'" if isinstance(value, str) else str(value)


def _refuse(key: str, value: Any, problem: str) -> UserError:
    rule = LOOP_KEYS[key]
    return UserError(f"trainer.{key}={_shown(value)} {problem}; pass {rule.allowed}, e.g. trainer.{key}={rule.example}")


def _time_hint(value: Any) -> str:
    """``2h`` / ``90m`` / ``1d`` as DD:HH:MM:SS: the duration the user meant, in Lightning's format."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(d|h|m|min|s)\s*", str(value).lower())
    if match is None:
        return ""
    seconds = round(float(match.group(1)) * {"d": 86400, "h": 3600, "m": 60, "min": 60, "s": 1}[match.group(2)])
    days, rest = divmod(seconds, 86400)
    return f" (write trainer.max_time={days:02d}:{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d})"


def check_loop(trainer: Mapping[str, Any]) -> None:
    """Each loop value by :data:`LOOP_KEYS`, then the pairs (a minimum above its maximum)."""
    for key, rule in LOOP_KEYS.items():
        if key in trainer and not rule.ok(trainer[key]):
            value = trainer[key]
            problem = "is not allowed" + (_time_hint(value) if key == "max_time" else "")
            if key in ("limit_train_batches", "max_steps", "max_epochs") and value in (0, 0.0):
                problem = "trains no step: the run would 'finish' without training"
            raise _refuse(key, value, problem)
    for low, high, unit in (("min_steps", "max_steps", "steps"), ("min_epochs", "max_epochs", "epochs")):
        lo, hi = trainer.get(low), trainer.get(high)
        if _int(lo) and _int(hi) and hi >= 1 and lo > hi:
            raise UserError(f"trainer.{low}={lo} exceeds trainer.{high}={hi}: the run stops at {hi} {unit} all the same; "
                            f"raise trainer.{high} to at least {lo}, or lower trainer.{low}")


def check_trainer(trainer: Mapping[str, Any]) -> None:
    """:func:`check_loop`, then Lightning's own checks of the loop settings (a ``Trainer`` built on the CPU: the
    hardware is another check's question), what it raises reworded naming the key it is about."""
    import lightning.pytorch as pl

    check_loop(trainer)
    loop = {k: v for k, v in trainer.items() if k != "_target_"}
    loop.update(accelerator="cpu", devices=1, precision="32-true", logger=False, enable_checkpointing=False, default_root_dir=os.devnull)
    try:
        pl.Trainer(**loop)
    except Exception as err:
        line = one_line(str(err)) or type(err).__name__
        named = [k for k in loop if k in LOOP_KEYS and re.search(rf"\b{k}\b", line)]
        named = named or [k for k in LOOP_KEYS if k in trainer and str(trainer[k]) in _QUOTED.findall(line)]
        if named:
            rule = LOOP_KEYS[named[0]]
            raise UserError(f"trainer.{named[0]}={_shown(loop[named[0]])}: {line.rstrip('.')}; pass {rule.allowed}, "
                            f"e.g. trainer.{named[0]}={rule.example}") from None
        raise UserError(f"trainer: {line}; fix the trainer value it names (Lightning's Trainer refused it)") from None


def check_seed(seed: Any) -> None:
    """A whole number numpy can seed with (``seed_everything`` seeds Python, numpy and torch with it)."""
    if seed is None:
        return
    if not _int(seed):
        raise UserError(f"seed={_shown(seed)} is not a whole number; pass an integer in [0, {_SEED_MAX}], e.g. seed=1234")
    if not 0 <= seed <= _SEED_MAX:
        raise UserError(f"seed={seed} is outside [0, {_SEED_MAX}] (numpy's range, which the run seeds too); pass e.g. seed=1234")


def check_run_options(cfg: Any) -> None:
    """The run's own top-level settings: ``keep_failed`` a boolean, ``interrupt_grace_s`` a positive number of seconds."""
    keep = cfg.get("keep_failed")
    if keep is not None and not isinstance(keep, bool):
        raise UserError(f"keep_failed={_shown(keep)} is not true or false; pass keep_failed=true or keep_failed=false")
    grace = cfg.get("interrupt_grace_s")
    if grace is None:
        return
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not math.isfinite(grace) or grace <= 0:
        raise UserError(f"interrupt_grace_s={_shown(grace)} is not a positive number of seconds; pass the longest a signalled run "
                        "may take to finish its step and save it, e.g. interrupt_grace_s=120")
