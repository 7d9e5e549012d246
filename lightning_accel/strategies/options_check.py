"""The strategies' constructor arguments, checked when a strategy is built: :func:`check_options`.

A Python user who writes ``L2LOffloadStrategy(prefetch_blocks='2')`` or ``checkpoint_blocks='false'`` gets,
from the constructor, one line naming the argument, the value and the fix, instead of a ``TypeError`` from a
comparison deep in set-up or, worse, a truthy string silently taken for ``True``. The four strategies
(``L2LOffloadStrategy``, ``L2LOffloadDDPStrategy``, ``GPipeStrategy``, ``DistributedGPipeStrategy``) call
:func:`check_options` first thing with their arguments (``locals()``); an argument is checked by its *kind*
(a count, a flag, a timeout, a block policy, a device), one table for all four, so the same option is checked
the same way wherever it appears. The checks of a value against the model (``prefetch_blocks`` against the
blocks, the stages against the blocks) need the model and run at set-up, and in preflight
(:mod:`lightning_accel.config.setup_checks`); :func:`check_device_accelerator` runs when the Trainer hands the
strategy its accelerator.

Errors are :class:`OptionValueError` / :class:`OptionTypeError` (a ``ValueError`` / ``TypeError``) that also
carry the argument's name and value, so preflight can name the config key (``strategy.prefetch_blocks=0.5``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn

__all__ = ["OptionTypeError", "OptionValueError", "check_device_accelerator", "check_options", "shown"]


def shown(value: Any) -> str:
    """A value as the user wrote it: ``'2'`` for a string, ``0.5``, ``torch.nn.functional.relu`` for a function."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}".lstrip(".")
    return repr(value)


class _Keyed:
    """An option's error: ``owner: problem; fix``, and :meth:`keyed`, the same line for a config key. ``problem``
    names the option and its value; ``{key}`` in ``fix`` becomes the argument's name, or the config key."""

    def __init__(self, owner: str, name: str, value: Any, problem: str, fix: str) -> None:
        self.owner, self.name, self.value, self.problem, self.fix = owner, name, value, problem, fix
        super().__init__(f"{owner}: {problem}; {fix.format(key=name)}")

    def keyed(self, where: str) -> str:
        """``strategy.prefetch_blocks=0.5: L2LOffloadStrategy: ...; pass strategy.prefetch_blocks=1`` (``where``: the node's key)."""
        key = f"{where}.{self.name}"
        return f"{key}={shown(self.value)}: {self.owner}: {self.problem}; {self.fix.format(key=key)}"


class OptionValueError(_Keyed, ValueError):
    """A strategy argument of the right type and a wrong value."""


class OptionTypeError(_Keyed, TypeError):
    """A strategy argument of the wrong type."""


def _type_name(value: Any) -> str:
    return f"the {type(value).__name__} {shown(value)}"


def _count(minimum: int, what: str, example: int, optional: bool = False) -> Callable[[str, str, Any], None]:
    """An int >= ``minimum`` (not a bool, not a float that happens to be whole)."""

    def check(owner: str, name: str, value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            given = value.strip() if isinstance(value, str) else None
            fix = f"pass {{key}}={int(given)}" if given is not None and given.lstrip("-").isdigit() else f"pass an int, e.g. {{key}}={example}"
            raise OptionTypeError(owner, name, value, f"{name} takes an int >= {minimum} ({what}), got {_type_name(value)}", fix)
        if value < minimum:
            raise OptionValueError(owner, name, value, f"{name} must be >= {minimum}, got {value} ({what})", f"pass e.g. {{key}}={example}")

    return check


def _flag(optional: bool = False) -> Callable[[str, str, Any], None]:
    """True or False; a string such as ``'false'`` (truthy) is refused with the bool it meant."""

    def check(owner: str, name: str, value: Any) -> None:
        if isinstance(value, bool) or (value is None and optional):
            return
        meant = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}.get(str(value).strip().lower())
        fix = f"pass {{key}}={meant}" if meant is not None else "pass {key}=True or {key}=False"
        also = " or None" if optional else ""
        raise OptionTypeError(owner, name, value, f"{name} takes True or False{also}, got {_type_name(value)}", fix)

    return check


def _deferred_init(owner: str, name: str, value: Any) -> None:
    """True, False or ``"parts"``."""
    if isinstance(value, bool) or (isinstance(value, str) and value == "parts"):
        return
    raise OptionTypeError(owner, name, value, f"{name} takes True, False or 'parts', got {_type_name(value)}",
                          "pass {key}=True, {key}=False or {key}='parts'")


def _timeout(owner: str, name: str, value: Any) -> None:
    """Seconds (a positive number) or a positive timedelta; None is the default (30 minutes)."""
    if value is None:
        return
    fix = "pass {key}=1800 (seconds: 30 minutes) or a datetime.timedelta"
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise OptionTypeError(owner, name, value, f"{name} takes seconds (a number > 0) or a timedelta, got {_type_name(value)}", fix)
    if not math.isfinite(seconds) or seconds <= 0:
        raise OptionValueError(owner, name, value, f"{name} must be a finite number of seconds > 0 (how long a rank waits for "
                               f"another before every rank fails), got {shown(value)}", fix)


_BLOCKS_FIX = "pass e.g. {key}=['GPTBlock'] (the repeated block's class), {key}='auto', or a callable model -> block modules"


def _block_entry(owner: str, name: str, policy: Any, entry: Any) -> None:
    if isinstance(entry, str) and entry.strip():
        return  # a class name (or dotted path) resolved against the model at set-up
    if isinstance(entry, type) and issubclass(entry, nn.Module):
        return
    what = "a function" if callable(entry) and not isinstance(entry, type) else _type_name(entry)
    raise OptionTypeError(owner, name, policy, f"{name} lists {shown(entry)}, {what}, where each entry is a block's nn.Module "
                          "class or its name", _BLOCKS_FIX)


def _blocks(owner: str, name: str, value: Any) -> None:
    """``'auto'``, a class (name), an iterable of classes (names), or a callable ``model -> block modules``."""
    if isinstance(value, (str, type)):
        _block_entry(owner, name, value, value)
        return
    if callable(value) and not isinstance(value, Iterable):
        return  # a callable policy: asked at set-up, where it gets the model
    if not isinstance(value, Iterable) or isinstance(value, (bytes, Mapping)):
        raise OptionTypeError(owner, name, value, f"{name} takes 'auto', block classes (or their names) or a callable, got "
                              f"{_type_name(value)}", _BLOCKS_FIX)
    entries = list(value)
    if not entries:
        raise OptionValueError(owner, name, value, f"{name} lists no block class", _BLOCKS_FIX)
    for entry in entries:
        _block_entry(owner, name, value, entry)


def _device(owner: str, name: str, value: Any) -> None:
    """None (the Trainer's accelerator picks), a ``torch.device``, or a string or index torch reads as one."""
    if value is None or isinstance(value, torch.device):
        return
    fix = "pass e.g. {key}='cuda:0' or {key}='cpu', or leave it unset (the Trainer's accelerator picks)"
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise OptionTypeError(owner, name, value, f"{name} takes a device, got {_type_name(value)}", fix)
    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        raise OptionValueError(owner, name, value, f"{name}={value!r} is not a device torch knows", fix) from None


# Each option, by kind: one check wherever the option appears (the four strategies share most of them).
_KINDS: dict[str, Callable[[str, str, Any], None]] = {
    "prefetch_blocks": _count(0, "blocks copied to the device ahead of the one computing", 1),
    "delayed_update_warmup": _count(0, "steps updated at once before the delay starts", 10, optional=True),
    "offload_resident": _flag(optional=True),
    "checkpoint_blocks": _flag(),
    "delayed_update": _flag(),
    "offload_activations": _flag(),
    "overlap_step": _flag(optional=True),
    "deferred_batch_norm": _flag(optional=True),
    "deferred_init": _deferred_init,
    "timeout": _timeout,
    "blocks": _blocks,
    "device": _device,
}


def _stage_count(devices: Any) -> int | None:
    """Stages an explicit ``devices`` spec asks for (an int, a list); None for ``None`` (every visible GPU)."""
    if isinstance(devices, int) and not isinstance(devices, bool):
        return devices
    if isinstance(devices, Sequence) and not isinstance(devices, str):  # a list, or Hydra's ListConfig
        return len(devices)
    return None


def _check_stages(owner: str, options: Mapping[str, Any]) -> None:
    """One device per stage: an explicit device list longer than a balance list leaves devices idle (a shorter one,
    stages without a device, the constructor refuses itself)."""
    balance, devices = options.get("balance"), options.get("devices")
    count = _stage_count(devices)
    if count is None or isinstance(balance, str) or not isinstance(balance, Sequence) or count <= len(balance):
        return
    raise OptionValueError(owner, "balance", list(balance), f"balance {list(balance)} has {len(balance)} stages but devices="
                           f"{shown(devices)} gives {count} ({count - len(balance)} device(s) idle)",
                           f"list one device per stage (devices of length {len(balance)}), or a balance of {count} stages")


def check_options(owner: str, options: Mapping[str, Any]) -> None:
    """Check a strategy's constructor arguments by kind (``options``: the constructor's ``locals()``; names this
    module does not know are left to the constructor). Raises :class:`OptionTypeError` / :class:`OptionValueError`."""
    for name, value in options.items():
        kind = _KINDS.get(name)
        if kind is not None:
            kind(owner, name, value)
    _check_stages(owner, options)


# The device type each Lightning accelerator computes on (Accelerator.setup_device refuses any other).
_ACCELERATOR_DEVICE = {"CPUAccelerator": "cpu", "cpu": "cpu", "CUDAAccelerator": "cuda", "cuda": "cuda", "gpu": "cuda",
                       "MPSAccelerator": "mps", "mps": "mps"}


def check_device_accelerator(owner: str, device: Any, accelerator: Any) -> None:
    """A ``device=`` given to a single-device strategy must be of the Trainer's accelerator (``accelerator``: the
    Accelerator object, or the Trainer flag ``'cpu'``/``'gpu'``/...; others, e.g. ``'auto'``, pass)."""
    if device is None:
        return
    name = accelerator if isinstance(accelerator, str) else type(accelerator).__name__
    wanted = _ACCELERATOR_DEVICE.get(name)
    kind = torch.device(device).type
    if wanted is None or kind == wanted or kind not in _ACCELERATOR_DEVICE.values():
        return  # another accelerator's device (xla): the strategy's own set-up says why it does not run there
    flag = {"cpu": "accelerator='cpu'", "cuda": "accelerator='gpu'", "mps": "accelerator='mps'"}.get(kind)
    raise OptionValueError(owner, "device", str(device), f"device={str(device)!r} computes on {kind}, but the Trainer's "
                           f"accelerator is {wanted}", "drop device= (the Trainer's accelerator picks the device)"
                           + (f", or set the Trainer's {flag}" if flag else ""))
