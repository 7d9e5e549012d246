"""The optimizer and the learning-rate schedule, checked before any work: :func:`check_optimization`.

torch's optimizers and schedulers check their own arguments, some when they are built (``Invalid learning rate``),
some only when they step (a cosine schedule of ``T_max=0`` divides by zero at its first step, a string learning rate
fails the first comparison that reads it). So preflight uses torch's own validation and goes as far as the run would:

1. every argument of ``model.optimizer`` / ``model.scheduler`` against the type the class annotates (a number, a
   whole number, a list of two numbers, ``cos`` or ``linear``), finite where it is a number;
2. ``configure_optimizers`` of the LightningModule built on the meta device, as Lightning calls it at set-up;
3. each optimizer stepped once on a stand-in (one small CPU parameter per param group, the group's own settings) and
   each scheduler stepped once.

Whatever torch raises on the way is one line naming our key (``model.optimizer.lr=nan``), the class, torch's words and
the fix. A ``configure_optimizers`` that needs a Trainer (``self.trainer.estimated_stepping_batches``) cannot be asked
here; the strategy asks at set-up.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import traceback
import types
import typing
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from omegaconf import DictConfig, OmegaConf

from lightning_accel.config.errors import UserError, one_line

__all__ = ["Configured", "check_optimization", "configured"]

_NODES = ("optimizer", "scheduler")
# torch's words for an argument, where its message does not use the argument's name
_ALIASES = {"learning rate": "lr", "beta": "betas", "epsilon": "eps", "step size": "step_size"}


@dataclass
class Configured:
    """What ``configure_optimizers`` returned on the meta network: the optimizers and their schedulers (the
    ``LRScheduler`` objects themselves)."""

    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)


def _nodes(cfg: DictConfig) -> Iterator[tuple[str, DictConfig]]:
    model = cfg.get("model")
    for name in _NODES:
        node = model.get(name) if model is not None else None
        if isinstance(node, DictConfig) and "_target_" in node:
            yield f"model.{name}", node


# ------------------------------------------------------------------------------------------ argument types


def _accepts(hint: Any, value: Any) -> bool | None:
    """Whether ``value`` (a config value: int, float, str, bool, list, None) fits ``hint``; None when the hint is
    one we do not read (a Tensor, a callable): nothing is refused on it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return None
    if hint is torch.Tensor:
        return False  # a config holds no tensors
    if origin in (typing.Union, types.UnionType):
        answers = [_accepts(a, value) for a in args]
        return True if any(a is True for a in answers) else None if any(a is None for a in answers) else False
    if origin is Literal:
        return value in args
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple and args and args[-1] is not Ellipsis:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            return False
        answers = [_accepts(a, v) for a, v in zip(args, value)]
        return False if False in answers else True
    if origin in (tuple, list, Sequence, Iterable):
        if not isinstance(value, (list, tuple)):
            return False
        inner = args[0] if args else typing.Any
        answers = [_accepts(inner, v) for v in value]
        return False if False in answers else True
    return None


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(a) for a in args if a is not torch.Tensor]
        return " or ".join(dict.fromkeys(p for p in parts if p))
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is tuple and args and args[-1] is not Ellipsis:
        return f"a list of {len(args)} numbers" if all(_describe(a).endswith("number") for a in args) else f"a list of {len(args)} values"
    if origin in (tuple, list, Sequence, Iterable):
        return "a list"
    return {bool: "true or false", int: "a whole number", float: "a number", str: "a string", type(None): "null"}.get(hint, "")


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return f"'{value}'"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return str(value)


def _non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, (list, tuple)) and any(_non_finite(v) for v in value)


def _check_arguments(where: str, node: DictConfig) -> None:
    """Each argument the node sets against its class's annotation (and finite, where a number)."""
    from lightning_accel.config.validate import locate

    cls = locate(str(node._target_), where)
    try:
        signature = inspect.signature(cls)
        hints = typing.get_type_hints(cls.__init__ if inspect.isclass(cls) else cls)
    except Exception:  # no signature or unresolvable annotations: torch's own checks still run below
        return
    values = OmegaConf.to_container(node, resolve=True)
    assert isinstance(values, dict)
    name = getattr(cls, "__name__", str(node._target_))
    for key, value in values.items():
        param = signature.parameters.get(str(key))
        if param is None or str(key).startswith("_"):
            continue
        default = param.default if param.default is not inspect.Parameter.empty else None
        if _non_finite(value):
            example = f", e.g. {where}.{key}={_shown(default)}" if default is not None else ""
            raise UserError(f"{where}.{key}={_shown(value)}{_source(node, key)} is not a finite number ({name}'s {key}); pass a "
                            f"finite value{example}")
        hint = hints.get(str(key))
        if hint is not None and _accepts(hint, value) is False:
            wanted = _describe(hint) or "a value of another type"
            fix = f"e.g. {where}.{key}={_shown(default)}" if default is not None else f"{wanted}"
            raise UserError(f"{where}.{key}={_shown(value)}{_source(node, key)}: {name}'s {key} takes {wanted}; pass {fix}")


# ------------------------------------------------------------------------------------------ torch's own checks


def _source(node: DictConfig, key: str) -> str:
    """`` (from trainer.max_steps)`` when the node's key is an interpolation of another, else ''."""
    raw = OmegaConf.to_container(node, resolve=False)
    text = raw.get(key) if isinstance(raw, dict) else None
    match = re.fullmatch(r"\$\{([\w.]+)\}", text) if isinstance(text, str) else None
    return f" (from {match.group(1)})" if match else ""


def _torch_error(err: BaseException, cfg: DictConfig, where: str | None, when: str) -> UserError:
    """torch's error while building or stepping (``when``) the node ``where``, as our line naming the argument."""
    line = one_line(str(err)) or type(err).__name__
    if type(err).__name__ not in ("ValueError", "TypeError"):
        line = f"{type(err).__name__}: {line}"
    node = OmegaConf.select(cfg, where) if where is not None else None
    if not isinstance(node, DictConfig):
        return UserError(f"model: configure_optimizers: {line} ({when}); fix the optimizer or scheduler it builds")
    name = str(node._target_).rsplit(".", 1)[-1]
    keys = [str(k) for k in node.keys() if not str(k).startswith("_")]
    lowered = line.lower()
    named = [k for k in keys if re.search(rf"\b{re.escape(k.lower())}\b", lowered)]
    named += [k for word, k in _ALIASES.items() if word in lowered and k in keys and k not in named]
    if not named and isinstance(err, ZeroDivisionError):  # torch divided by an argument: the one that is 0
        named = [k for k in keys if not isinstance(value := OmegaConf.select(node, k), bool) and value in (0, 0.0)]
    if not named:
        given = ", ".join(f"{k}={_shown(_plain(OmegaConf.select(node, k)))}{_source(node, k)}" for k in keys)
        return UserError(f"{where} ({name}: {given}): {line} ({when}); change one of these {where} values")
    key = named[0]
    value = _plain(OmegaConf.select(node, key))
    source = _source(node, key)
    fix = f"set {source[7:-1]}, which it reads, to a value {name} takes for {key}" if source else \
        f"pass {_fix(node, key, isinstance(err, ZeroDivisionError))}"
    return UserError(f"{where}.{key}={_shown(value)}{source}: {name} refuses it ({line}, {when}); {fix}")


def _fix(node: DictConfig, key: str, divides: bool) -> str:
    """What to pass instead: the class's default, where it has one (``e.g. model.optimizer.betas=[0.9, 0.999]``)."""
    from lightning_accel.config.validate import locate

    try:
        param = inspect.signature(locate(str(node._target_), "model")).parameters.get(key)
    except Exception:  # a target without a signature
        param = None
    default = param.default if param is not None and param.default is not inspect.Parameter.empty else None
    where = node._get_full_key(None) if hasattr(node, "_get_full_key") else "model"
    name = str(node._target_).rsplit(".", 1)[-1]
    if default is not None and not isinstance(default, bool):
        return f"a value {name} takes, e.g. {where}.{key}={_shown(list(default) if isinstance(default, tuple) else default)} (its default)"
    return f"a value {name} takes for {key}" + (" (it divides by it: > 0)" if divides else "")


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _raised_in(err: BaseException) -> str | None:
    """``model.scheduler`` when torch's scheduler code raised ``err``, ``model.optimizer`` for its optimizers."""
    files = [frame.filename.replace("\\", "/") for frame in traceback.extract_tb(err.__traceback__)]
    if any("torch/optim/lr_scheduler" in f for f in files):
        return "model.scheduler"
    if any("torch/optim/" in f for f in files):
        return "model.optimizer"
    return None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()", and the like: not the user's
        warnings.simplefilter("ignore")
        yield


def configured(module: Any, cfg: DictConfig) -> Configured:
    """``configure_optimizers`` of ``module`` (on meta), as Lightning collects it at set-up; torch's refusal of an
    argument is a :class:`UserError` naming it; a ``configure_optimizers`` that needs a Trainer gives nothing."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    configure = getattr(module, "configure_optimizers", None)
    if configure is None:
        return Configured()
    try:
        with _quiet():
            optimizers, schedulers, _ = _configure_optimizers(configure())
    except Exception as err:
        where = _raised_in(err)
        if where is None and not isinstance(err, ValueError):
            return Configured()  # needs a Trainer, or returns nothing Lightning knows: the strategy asks at set-up
        raise _torch_error(err, cfg, where or "model.optimizer", "when built") from None
    # each a dict or LRSchedulerConfig ({"scheduler": ..., "interval": ...}) or the scheduler itself
    found = [c.get("scheduler") if isinstance(c, dict) else getattr(c, "scheduler", c) for c in schedulers]
    return Configured(list(optimizers), [s for s in found if s is not None])


# How a torch optimizer runs on a device, not what it computes: the CPU stand-in runs its own way.
_DEVICE_FLAGS = {"capturable": False, "fused": None, "foreach": None}


def _stand_in(optimizer: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, list[torch.Tensor]] | None:
    """The same optimizer class over one small CPU parameter per group, with the group's settings (but the device
    flags); None for an optimizer outside torch.optim, whose step may need its device (its constructor ran on meta)."""
    if not type(optimizer).__module__.startswith("torch.optim"):
        return None
    params = [torch.zeros(4, requires_grad=True) for _ in optimizer.param_groups]
    groups = [{**{k: v for k, v in g.items() if k != "params"}, **{k: v for k, v in _DEVICE_FLAGS.items() if k in g}, "params": [p]}
              for g, p in zip(optimizer.param_groups, params)]
    try:
        return type(optimizer)(groups), params
    except Exception:  # a constructor that needs more than param groups: built once on meta already
        return None


def _step_once(configured_: Configured, cfg: DictConfig) -> None:
    """Step each optimizer (a stand-in) and each scheduler once, as the first training step does."""
    wheres = [w for w, _ in _nodes(cfg)]
    for optimizer in configured_.optimizers:
        stand_in = _stand_in(optimizer)
        if stand_in is None:
            continue
        copy, params = stand_in

        def closure() -> torch.Tensor:
            # the gradient of sum(p * p), set by hand: a backward here would start autograd's engine before an XLA
            # run's devices exist, and torch_xla's first backward then fails an engine assert (device_ready_queues_)
            with torch.no_grad():
                loss = sum((p * p).sum() for p in params)
                for p in params:
                    p.grad = 2 * p.detach()
            return loss  # type: ignore[return-value]

        try:
            with _quiet():
                copy.step(closure)
        except Exception as err:
            raise _torch_error(err, cfg, "model.optimizer" if "model.optimizer" in wheres else None, "at its first step") from None
    for scheduler in configured_.schedulers:
        try:
            with _quiet():
                scheduler.step()
        except Exception as err:
            raise _torch_error(err, cfg, "model.scheduler" if "model.scheduler" in wheres else None, "at its first step") from None
    for optimizer in configured_.optimizers:  # what a schedule wrote into the groups (a negative max_lr: lr < 0)
        _check_scheduled(optimizer, cfg)


def _check_scheduled(optimizer: torch.optim.Optimizer, cfg: DictConfig) -> None:
    """The settings a scheduler set in each param group, asked of the optimizer's constructor again: torch checks
    them there only, so a schedule that sets a negative learning rate would otherwise train uphill in silence."""
    if not type(optimizer).__module__.startswith("torch.optim") or OmegaConf.select(cfg, "model.scheduler") is None:
        return
    name, takes = type(optimizer).__name__, inspect.signature(type(optimizer)).parameters
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k in takes and k != "params" and k not in _DEVICE_FLAGS}
        try:
            type(optimizer)([torch.zeros(1, requires_grad=True)], **settings)
        except ValueError as err:
            node = cfg.model.scheduler
            scheduler, refused = str(node._target_).rsplit(".", 1)[-1], one_line(str(err))
            keys = [str(k) for k in node if not str(k).startswith("_")]
            negative = [k for k in keys if k != "last_epoch" and _numbers(value := _plain(node[k])) and min(_flat_numbers(value)) < 0]
            if negative:  # what a schedule scales is scaled by its settings: a negative one makes it negative
                key = negative[0]
                raise UserError(f"model.scheduler.{key}={_shown(_plain(node[key]))}{_source(node, key)}: {scheduler} sets {name}'s "
                                f"param group to what {name} refuses ({refused}) at its first step; pass a positive "
                                f"model.scheduler.{key}") from None
            given = ", ".join(f"{k}={_shown(_plain(node[k]))}{_source(node, k)}" for k in keys)
            raise UserError(f"model.scheduler ({scheduler}: {given}) sets {name}'s param group to what {name} refuses ({refused}) "
                            "at its first step; change the model.scheduler value that sets it") from None


def _numbers(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_numbers(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _flat_numbers(value: Any) -> list[float]:
    return [x for v in value for x in _flat_numbers(v)] if isinstance(value, (list, tuple)) else [float(value)]


def check_optimization(module: Any, cfg: DictConfig) -> Configured:
    """The arguments by type, then torch's checks when built and at the first step; returns what was built (on meta:
    the schedulers have stepped once), for the strategy's checks and the checkpoint's."""
    for where, node in _nodes(cfg):
        _check_arguments(where, node)
    result = configured(module, cfg)
    _step_once(result, cfg)
    return result
