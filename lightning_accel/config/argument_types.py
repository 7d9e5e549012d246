"""Every scalar a config hands a constructor, checked against that constructor's own annotation before it is built.

Why: Hydra's ``instantiate`` passes what the YAML or the command line says, and a constructor that does not check its
own arguments (most do not: ``LightningDataModule``'s, a model's, a callback's) keeps ``data.seed=abc`` or
``model.net.dropout=nan`` until the first use, where torch says ``manual_seed expected a long, but got str`` after
set-up, naming neither the key nor the value. The signatures already say what each argument takes (``seed: int``,
``dropout: float``), so the check is generated from them, for every node with a ``_target_`` (the data module, the
model and the nodes inside it, the strategy, callbacks, plugins), and names no argument by hand.

Only what an annotation says exactly is checked: ``int`` (an integer, not a bool: Python's ``True`` is an ``int``),
``float`` (a real number; not NaN, which no setting means), ``bool``, each optionally ``| None``. Richer annotations
(``int | str`` sizes, ``Sequence[int]``, tensors) are the constructors' own business, as are ranges. No Lightning here.
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_accel.config.errors import UserError

__all__ = ["check_argument_types"]

_KINDS = {int: "an integer", float: "a number", bool: "true or false"}
_NAMES = {"int": int, "float": float, "bool": bool}


def _target(path: Any) -> Any:
    """The callable a ``_target_`` names, or None where it does not import (``instantiate`` reports that itself)."""
    if not isinstance(path, str):
        return None
    from hydra.utils import get_object

    try:
        return get_object(path)
    except Exception:
        return None


def _annotations(target: Any) -> dict[str, Any]:
    """``target``'s parameters' annotations, strings of ``from __future__ import annotations`` resolved where possible."""
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return {}
    try:
        hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:
        hints = {}
    return {name: hints.get(name, p.annotation) for name, p in parameters.items()}


def _scalar(annotation: Any) -> tuple[type | None, bool]:
    """``(int | float | bool, None allowed)`` when ``annotation`` is exactly one of them (optionally ``| None``)."""
    if isinstance(annotation, str):  # an annotation get_type_hints could not resolve: its plain spellings only
        parts = [p.strip() for p in annotation.removeprefix("Optional[").removesuffix("]").split("|")]
        optional = annotation.startswith("Optional[") or "None" in parts
        parts = [p for p in parts if p != "None"]
        return (_NAMES.get(parts[0]), optional) if len(parts) == 1 else (None, False)
    if annotation in _KINDS:
        return annotation, False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and rest[0] in _KINDS:
            return rest[0], len(rest) < len(args)
    return None, False


def _fits(kind: type, value: Any) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, int)
    return isinstance(value, (int, float)) and not math.isnan(value)


def check_argument_types(where: str, node: Any) -> None:
    """Refuse, in one line naming ``where.key`` and the value, a scalar of ``node`` (a config node with a ``_target_``,
    and every such node inside it) that its constructor's annotation says it cannot take."""
    if isinstance(node, DictConfig):
        try:
            node = OmegaConf.to_container(node, resolve=True)
        except Exception:  # an interpolation that does not resolve here: preflight names it elsewhere
            return
    if not isinstance(node, Mapping):
        return
    annotations = _annotations(target) if (target := _target(node.get("_target_"))) is not None else {}
    for key, value in node.items():
        if not isinstance(key, str) or key.startswith("_"):
            continue
        if isinstance(value, Mapping):
            check_argument_types(f"{where}.{key}", value)
            continue
        kind, optional = _scalar(annotations.get(key, inspect.Parameter.empty))
        if kind is None or (value is None and optional) or _fits(kind, value):
            continue
        name = getattr(target, "__qualname__", str(target))
        default = inspect.signature(target).parameters[key].default
        example = default if default is not inspect.Parameter.empty and default is not None and _fits(kind, default) else None
        fix = f"e.g. {where}.{key}={str(example).lower() if kind is bool else example}" if example is not None else f"give {where}.{key} {_KINDS[kind]}"
        got = "NaN" if isinstance(value, float) and math.isnan(value) else f"{type(value).__name__} {value!r}"
        raise UserError(f"{where}.{key}={value}: {name} takes {_KINDS[kind]}{' or null' if optional else ''} for {key}, got {got}; {fix}")
