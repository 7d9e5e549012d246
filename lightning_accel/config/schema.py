"""Structured-config schemas, generated from the signatures they configure.

Hydra checks a YAML against a dataclass registered in its ConfigStore: an unknown key or
a value of the wrong type then fails at composition, before any work. Writing those
dataclasses by hand for ``Trainer`` or ``ModelCheckpoint`` would copy dozens of
parameters that drift with every Lightning release, so we derive them from
``inspect.signature``: each parameter becomes a field with the callable's own default and
the closest type OmegaConf can check (``int``, ``float``, ``bool``, ``str``, their
``Optional``; anything richer becomes ``Any``).

A parameter whose default OmegaConf cannot hold (an object) is left out of the schema and
so cannot be set from a config; ``exclude`` names parameters that our runner supplies
itself (the trainer's callbacks, loggers, strategy and plugins come from their own
groups).
"""

from __future__ import annotations

import dataclasses
import functools
import enum
import inspect
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

from hydra.core.config_store import ConfigStore

_SCALARS = (bool, int, float, str)


def _target_path(target: Callable[..., Any]) -> str:
    return f"{target.__module__}.{target.__qualname__}"


def _field_type(annotation: Any) -> Any:
    """The type OmegaConf should enforce for ``annotation`` (``Any`` when unsure)."""
    if annotation in _SCALARS:
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and args[0] in _SCALARS and len(typing.get_args(annotation)) == 2:
            return typing.Optional[args[0]]
    return Any


def _representable(value: Any) -> bool:
    if value is None or isinstance(value, (*_SCALARS, enum.Enum)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_representable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _representable(v) for k, v in value.items())
    return False


def schema_for(target: Callable[..., Any], *, exclude: Iterable[str] = ()) -> type:
    """A dataclass whose fields mirror ``target``'s keyword parameters, plus ``_target_``.

    Raises ``TypeError`` for a callable that takes ``**kwargs``: a closed schema would
    reject keys the callable accepts.
    """
    signature = inspect.signature(target)
    try:
        hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:  # unresolvable forward references: fall back to Any everywhere
        hints = {}
    skip = set(exclude)
    fields: list[tuple[str, Any, Any]] = [("_target_", str, dataclasses.field(default=_target_path(target)))]
    for param in signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            raise TypeError(f"{_target_path(target)} takes **{param.name}, so a closed schema would reject its keys; check it by binding (validate) instead")
        if param.kind is inspect.Parameter.VAR_POSITIONAL or param.name in skip:
            continue
        kind = _field_type(hints.get(param.name, Any))
        if param.default is inspect.Parameter.empty:
            fields.append((param.name, kind, dataclasses.field(default="???")))
            continue
        if not _representable(param.default):
            continue
        default = param.default
        if isinstance(default, enum.Enum):
            default = default.value
        if isinstance(default, (list, tuple, dict)):
            fields.append((param.name, Any, dataclasses.field(default_factory=lambda d=default: d)))
        else:
            if default is None and kind in _SCALARS:
                kind = typing.Optional[kind]
            fields.append((param.name, kind, dataclasses.field(default=default)))
    name = f"{target.__qualname__.replace('.', '_')}Schema"
    return dataclasses.make_dataclass(name, fields)


def store_schema(group: str, name: str, target: Callable[..., Any], *, exclude: Iterable[str] = ()) -> None:
    """Register ``schema_for(target)`` in Hydra's ConfigStore as ``group/name``."""
    ConfigStore.instance().store(group=group, name=name, node=schema_for(target, exclude=exclude))


# Parameters of Trainer that come from their own config groups, not from trainer/.
TRAINER_SUPPLIED = ("callbacks", "logger", "strategy", "plugins")


def register_schemas() -> None:
    """Store the schemas our config groups extend (``defaults: [base, _self_]``).

    Called by the CLI before composing; registering twice overwrites with the same node.
    """
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import (
        EarlyStopping,
        LearningRateMonitor,
        ModelCheckpoint,
        RichProgressBar,
        TQDMProgressBar,
    )

    store_schema("trainer", "base", Trainer, exclude=TRAINER_SUPPLIED)
    for name, callback in {
        "model_checkpoint": ModelCheckpoint,
        "early_stopping": EarlyStopping,
        "lr_monitor": LearningRateMonitor,
        "tqdm_progress_bar": TQDMProgressBar,
        "rich_progress_bar": RichProgressBar,
    }.items():
        store_schema("schema/callbacks", name, callback)


@functools.lru_cache(maxsize=None)
def path_parameters(target: str) -> tuple[str, ...]:
    """The parameters of ``target`` (a ``_target_`` string) that take a path: typed as a string or a path
    (``str``, ``os.PathLike``, ``Path``, their ``Optional``) and named as one (:func:`lightning_accel.config.paths.rule_for`).
    Empty when the target does not import (binding reports that)."""
    from hydra.utils import get_object

    from lightning_accel.config.paths import rule_for

    try:
        obj = get_object(target)
        signature = inspect.signature(obj)
    except Exception:
        return ()
    names = []
    for param in signature.parameters.values():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) or rule_for(param.name) is None:
            continue
        annotation = str(param.annotation)
        if param.annotation is inspect.Parameter.empty or any(t in annotation for t in ("str", "Path", "PathLike", "_PATH")):
            names.append(param.name)
    return tuple(names)
