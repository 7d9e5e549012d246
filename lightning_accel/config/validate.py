"""Checking a composed recipe without training it.

``validate`` walks the config for every ``_target_``, imports it, and binds the node's
keys to the callable's signature (``bind_partial`` for ``_partial_: true``), so a wrong
class path or argument name fails in a second instead of minutes into a run. It also
checks the values Lightning would only reject at ``Trainer(...)``: the precision flag and
the strategy name. ``check_launchable`` adds what only matters for a run on *this*
machine: the hardware the recipe asks for, and the data files it names.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_accel.config.errors import UserError, close_matches, explain
from lightning_accel.config.schema import TRAINER_SUPPLIED

# Keyword arguments the runner passes itself, by config path.
SUPPLIED: dict[str, tuple[str, ...]] = {"trainer": TRAINER_SUPPLIED}
_HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


def _targets(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        if "_target_" in node:
            yield path, node
        for key, value in node.items():
            if key != "hydra":
                yield from _targets(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _targets(value, f"{path}[{i}]")


def locate(target: str, where: str) -> Any:
    """Import ``a.b.C`` (a class or function), with close matches on failure."""
    module_name, _, attr = target.rpartition(".")
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        module_name = ".".join(parts[:split])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError:
            continue
        for i, attr in enumerate(parts[split:]):
            if not hasattr(obj, attr):
                names = [n for n in dir(obj) if not n.startswith("_")]
                raise UserError(
                    f"{where}._target_ '{target}' does not exist: {'.'.join(parts[: split + i])} has no "
                    f"'{attr}'{close_matches(attr, names)}; fix the class path"
                )
            obj = getattr(obj, attr)
        return obj
    raise UserError(f"{where}._target_ '{target}' cannot be imported: no module '{parts[0]}'; install it or fix the path")


def _check_binding(where: str, node: dict[str, Any]) -> None:
    target = locate(str(node["_target_"]), where)
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    kwargs = {k: v for k, v in node.items() if k not in _HYDRA_KEYS}
    kwargs.update({name: None for name in SUPPLIED.get(where, ())})
    args = node.get("_args_") or []
    try:
        if node.get("_partial_"):
            signature.bind_partial(*args, **kwargs)
        else:
            signature.bind(*args, **kwargs)
    except TypeError as err:
        names = [p for p in signature.parameters if p != "self"]
        unknown = [k for k in kwargs if k not in signature.parameters]
        if unknown and not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            hint = close_matches(unknown[0], names)
            raise UserError(
                f"{where}.{unknown[0]} is not an argument of {node['_target_']}{hint}; "
                f"it takes: {', '.join(names)}"
            ) from None
        raise UserError(f"{where}: {err} for {node['_target_']}; it takes: {', '.join(names)}") from None


def _check_precision(cfg: DictConfig) -> None:
    from lightning.fabric.connector import _PRECISION_INPUT_STR

    flag = cfg.trainer.get("precision")
    allowed = [str(p) for p in typing_args(_PRECISION_INPUT_STR)]
    if flag is not None and str(flag) not in allowed:
        raise UserError(
            f"trainer.precision={flag!r} is not a Lightning precision{close_matches(str(flag), allowed)}; "
            f"choose one of: {', '.join(allowed)} (e.g. precision=bf16-mixed)"
        )


def typing_args(alias: Any) -> tuple[Any, ...]:
    """The members of a ``Literal[...]`` alias (possibly nested in a Union)."""
    import typing

    out: list[Any] = []
    for arg in typing.get_args(alias):
        out.extend(typing_args(arg) if typing.get_args(arg) else [arg])
    return tuple(out)


def _check_strategy(cfg: DictConfig) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = cfg.get("strategy")
    if strategy is None or "_target_" in strategy:
        return
    names = ["auto", *StrategyRegistry.available_strategies()]
    if strategy.name not in names:
        raise UserError(
            f"strategy.name={strategy.name!r} is not a registered strategy{close_matches(strategy.name, names)}; "
            f"choose a registered name or a strategy option: strategy=ddp"
        )


def validate(cfg: DictConfig) -> list[str]:
    """Check every ``_target_`` and value we can without training; returns the targets."""
    container = OmegaConf.to_container(cfg, resolve=False)
    checked = []
    for where, node in _targets(container):
        _check_binding(where, node)
        checked.append(f"{where}: {node['_target_']}")
    _check_precision(cfg)
    _check_strategy(cfg)
    return checked


def check_launchable(cfg: DictConfig, recipe: str) -> None:
    """What a run on this machine needs beyond :func:`validate`: hardware and data files."""
    import torch

    trainer = cfg.trainer
    accelerator = str(trainer.accelerator)
    if accelerator in ("gpu", "cuda"):
        wanted = trainer.devices
        have = torch.cuda.device_count()
        need = have if wanted in (-1, "-1", "auto") else (len(wanted) if not isinstance(wanted, (int, str)) else int(wanted))
        if have == 0 or need > have:
            raise UserError(
                f"recipe '{recipe}' needs {need or 1} CUDA GPU(s) (trainer.accelerator={accelerator}, "
                f"trainer.devices={wanted}) but this machine has {have}; run it on a GPU machine, or override "
                "accelerator=cpu precision=32-true strategy=auto"
            )
    if accelerator in ("tpu", "xla"):
        raise UserError(
            f"recipe '{recipe}' asks for Lightning's TPU accelerator (trainer.accelerator={accelerator}), which starts only "
            "on a TPU host; run it on a TPU VM, or override accelerator=xla (our xla_pjrt: TPU, CUDA or PJRT_DEVICE=CPU)"
        )
    if accelerator == "xla_pjrt":
        from lightning_accel.accelerators import xla_problem

        problem = xla_problem()
        if problem is not None:
            raise UserError(f"recipe '{recipe}': {problem}")
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path not in (None, "last") and not Path(str(ckpt_path)).is_file():
        raise UserError(f"ckpt_path='{ckpt_path}' does not exist; pass an existing .ckpt file, ckpt_path=last, or leave it unset")
    # Instantiating the data module is cheap (no data is loaded before setup()) and is
    # where a missing user file is reported.
    try:
        instantiate(cfg.data)
    except Exception as err:
        raise UserError(explain(err) or _first_line(err)) from None


def _first_line(err: BaseException) -> str:
    while err.__cause__ is not None:
        err = err.__cause__
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
