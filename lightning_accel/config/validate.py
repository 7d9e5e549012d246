"""Checking a composed recipe without training it.

``validate`` walks the config for every ``_target_``, imports it, and binds the node's
keys to the callable's signature (``bind_partial`` for ``_partial_: true``), so a wrong
class path or argument name fails in a second instead of minutes into a run. It also
checks the values Lightning would only reject at ``Trainer(...)``: the precision flag, a
strategy node that names no class, and the accelerator and strategy that only run
together (``xla_pjrt``). ``check_launchable`` adds what only matters for a run on *this*
machine: the hardware the recipe asks for, and the data files it names.

A strategy is chosen one way, the Hydra way: an option of ``conf/strategy`` whose node
has a ``_target_`` (``strategy=ddp``), or ``strategy=auto``, which leaves the node empty
(``null``) and lets Lightning pick, as ``Trainer(strategy="auto")`` does.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_accel.config.errors import UserError, close_matches, one_line
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
                f"use one of: {', '.join(names)}"
            ) from None
        raise UserError(f"{where}: {err} for {node['_target_']}; pass its arguments by name: {', '.join(names)}") from None


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


def strategy_options() -> list[str]:
    """The options of the ``strategy`` config group (``conf/strategy/*.yaml``)."""
    from lightning_accel.config.locate import conf_dir

    return sorted(p.stem for p in (conf_dir() / "strategy").glob("*.yaml"))


def _by_name_fix(name: str) -> str:
    """The override that builds what ``Trainer(strategy=name)`` would: our option of that
    name, else the registered class by ``_target_`` (with the registry's own arguments)."""
    from lightning.pytorch.strategies import StrategyRegistry

    options = strategy_options()
    if name in options:
        return f"strategy={name}"
    if name in StrategyRegistry:
        entry = StrategyRegistry[name]
        cls = entry["strategy"]
        params = " ".join(f"+strategy.{k}={v}" for k, v in entry.get("init_params", {}).items())
        return f"+strategy._target_={cls.__module__}.{cls.__qualname__}" + (f" {params}" if params else "")
    return f"one of the options{close_matches(name, options)}: {', '.join(options)} (e.g. strategy={options[0]})"


def _check_strategy(cfg: DictConfig) -> None:
    """A strategy node either builds its class (``_target_``) or is empty (``strategy=auto``)."""
    strategy = cfg.get("strategy")
    if not strategy or "_target_" in strategy:
        return
    if "name" in strategy:
        raise UserError(
            f"strategy.name={strategy.name!r}: a strategy is chosen by option or by _target_, not by name; "
            f"use {_by_name_fix(str(strategy.name))}"
        )
    key = next(iter(strategy.keys()), None)
    raise UserError(
        f"strategy.{key} is set but the strategy node has no _target_ (strategy=auto builds none); "
        f"choose a strategy option (strategy=ddp, strategy=l2l_offload, ...) or set +strategy._target_=<class path>"
    )


def _check_xla_pairing(cfg: DictConfig) -> None:
    """The ``xla_pjrt`` accelerator and strategy run only together (each refuses the other's
    absence once the Trainer starts; here it is one line before any work)."""
    from lightning_accel.strategies.xla_pjrt import XLAPJRTStrategy

    accelerator = str(cfg.trainer.get("accelerator"))
    strategy = cfg.get("strategy")
    cls = locate(str(strategy._target_), "strategy") if strategy is not None and "_target_" in strategy else None
    xla_strategy = isinstance(cls, type) and issubclass(cls, XLAPJRTStrategy)
    if accelerator == "xla_pjrt" and not xla_strategy:
        what = getattr(cls, "__name__", str(cls)) if cls is not None else "strategy=auto"
        raise UserError(f"trainer.accelerator=xla_pjrt runs only under the xla_pjrt strategy, not {what}; add strategy=xla_pjrt")
    if xla_strategy and accelerator != "xla_pjrt":
        raise UserError(f"strategy=xla_pjrt needs trainer.accelerator=xla_pjrt, not {accelerator}; add accelerator=xla")


# The top-level keys a run reads (conf/train.yaml and its groups; ``hydra`` is Hydra's own). A key added beside them
# (``+seeds=3``) would be composed and then read by nothing: a typo trained on in silence.
TOP_LEVEL = frozenset({"trainer", "model", "data", "strategy", "callbacks", "logger", "paths", "plugins", "recipe", "seed",
                       "ckpt_path", "keep_failed", "interrupt_grace_s", "optimized_metric", "hydra"})


def check_top_level(cfg: DictConfig) -> None:
    """A top-level key nothing reads (:data:`TOP_LEVEL`) is refused, naming it and the nearest known one."""
    unknown = sorted(str(k) for k in cfg.keys() if str(k) not in TOP_LEVEL)
    if unknown:
        key = unknown[0]
        raise UserError(
            f"unknown top-level key '{key}' (added with +{key}=...){close_matches(key, TOP_LEVEL)}: nothing reads it; check "
            f"the spelling, or put it where it is read (e.g. +model.net.{key}=... for the network's constructor)"
        )


def validate(cfg: DictConfig) -> list[str]:
    """Check every ``_target_`` and value we can without training; returns the targets."""
    check_top_level(cfg)
    container = OmegaConf.to_container(cfg, resolve=False)
    checked = []
    for where, node in _targets(container):
        _check_binding(where, node)
        checked.append(f"{where}: {node['_target_']}")
    _check_precision(cfg)
    _check_strategy(cfg)
    _check_xla_pairing(cfg)
    return checked


def devices_needed(cfg: DictConfig) -> int:
    """Accelerators a run of ``cfg`` occupies: the Trainer's devices, or the stages a
    single-process pipeline places on devices of its own (``strategy.devices``)."""
    import torch

    wanted = cfg.trainer.devices
    if wanted in (-1, "-1", "auto"):
        count = torch.cuda.device_count()
    elif isinstance(wanted, (int, str)):
        count = int(wanted)
    else:
        count = len(wanted)
    strategy = cfg.get("strategy")
    stages = strategy.get("devices") if strategy is not None and "_target_" in strategy else None
    if isinstance(stages, (list, tuple)) or OmegaConf.is_list(stages):
        count = max(count, len({str(d) for d in stages if str(d) != "cpu"}))
    return count


def cpu_override(cfg: DictConfig) -> str:
    """The overrides that run a GPU recipe on the CPU with the same techniques: the recipe's
    own ``recipe.cpu_override`` when it has one (a 5B model also needs shrinking), else
    derived: ``accelerator=cpu``, the CPU twin of the precision option (offload-32-true for
    the offload ones), the pipeline stages on ``cpu``, no pinned memory."""
    own = OmegaConf.select(cfg, "recipe.cpu_override", default=None)
    if own:
        return str(own)
    choice = str(OmegaConf.select(cfg, "hydra.runtime.choices.precision", default="") or "")
    parts = ["accelerator=cpu", "precision=offload-32-true" if choice.startswith("offload-") else "precision=32-true"]
    strategy = cfg.get("strategy")
    stages = strategy.get("devices") if strategy is not None and "_target_" in strategy else None
    if OmegaConf.is_list(stages):
        parts.append(f"strategy.devices=[{','.join(['cpu'] * len(stages))}]")
    if OmegaConf.select(cfg, "data.pin_memory", default=False):
        parts.append("data.pin_memory=false")
    return " ".join(parts)


def check_launchable(cfg: DictConfig, recipe: str) -> None:
    """What a run on this machine needs beyond :func:`validate`: the hardware."""
    import torch

    trainer = cfg.trainer
    accelerator = str(trainer.accelerator)
    if accelerator in ("gpu", "cuda"):
        wanted = trainer.devices
        have = torch.cuda.device_count()
        need = devices_needed(cfg)
        if have == 0 or need > have:
            raise UserError(
                f"recipe '{recipe}' needs {need or 1} CUDA GPU(s) (trainer.accelerator={accelerator}, "
                f"trainer.devices={wanted}{_stage_devices(cfg)}) but this machine has {have}; run it on a GPU machine, "
                f"or override {cpu_override(cfg)}"
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
            raise UserError(f"recipe '{recipe}': {one_line(problem)}")


def _stage_devices(cfg: DictConfig) -> str:
    strategy = cfg.get("strategy")
    stages = strategy.get("devices") if strategy is not None and "_target_" in strategy else None
    return f", strategy.devices={list(stages)}" if OmegaConf.is_list(stages) else ""
