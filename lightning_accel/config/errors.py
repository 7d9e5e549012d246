"""One-line messages for bad input: the value, what is allowed, and the fix.

Hydra and OmegaConf report composition problems as multi-line exceptions with a
traceback. A user who typed ``model=gtp`` needs one line that names the value, the close
matches and what to type instead; :func:`explain` turns the known exception types into
that line, and :class:`UserError` carries our own checks' messages.

Every message here has one shape: ``<the value and what is wrong>; <what to do>``, the
fix after a semicolon, in the imperative (``...; choose one of: cnn, gpt``). A message
from a constructor the checks run (a strategy's ``... HINT: set chunks=4``) is brought
to that shape by :func:`one_line` before it is shown.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationKeyError,
    InterpolationResolutionError,
    InterpolationToMissingValueError,
    InterpolationValidationError,
    MissingMandatoryValue,
    UnsupportedInterpolationType,
    ValidationError,
)

_KEY_ERRORS = (ConfigKeyError, ConfigAttributeError)
# the type OmegaConf names in a ValidationError ("... could not be converted to Integer", "is not a valid bool"):
# what to pass, and an example
_KINDS = {"Integer|int": ("a whole number", "1"), "Float": ("a number", "0.5"), "Boolean|bool": ("true or false", "true"),
          "String|str": ("a string", "text")}


class UserError(Exception):
    """Bad input a user can fix: printed as one line, exit status 2, no traceback."""


_HINT = re.compile(r"[.;:,]?\s+HINT:\s*")


def one_line(message: str) -> str:
    """``message``'s first line in this module's shape: Lightning-style ``... . HINT: fix``
    becomes ``...; fix``; a message already in shape comes back unchanged."""
    text = message.strip()
    first = text.splitlines()[0] if text else ""
    return _HINT.sub("; ", first, count=1)


def missing_file_line(key: str, path: str | Path, fix: str) -> str:
    """``key='path' does not exist`` only when it does not: ``is a directory, not a file`` when it is one (so the line
    says what is true), then ``; fix``."""
    where = Path(str(path)).expanduser()
    what = "is a directory, not a file" if where.is_dir() else "is not a regular file" if where.exists() else "does not exist"
    return f"{key} '{path}' {what}; {fix}" if " " in key else f"{key}='{path}' {what}; {fix}"


def close_matches(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest choices, or an empty string."""
    matches = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(repr(m) for m in matches)}?)" if matches else ""


# Hydra plugins our extras install: a missing one gets the install line, not a list.
_PLUGIN_EXTRAS = {
    ("hydra/sweeper", "optuna"): "sweep",
    ("hydra/launcher", "submitit_slurm"): "slurm",
    ("hydra/launcher", "submitit_local"): "slurm",
}


def _explain_missing_config(err: MissingConfigException) -> str | None:
    missing = err.missing_cfg_file or ""
    if "/" not in missing or not err.options:
        return None
    group, option = missing.rsplit("/", 1)
    options = sorted(o for o in err.options if o != "base")
    extra = _PLUGIN_EXTRAS.get((group, option))
    if extra is not None and option not in options:
        return f'{group}={option} comes with the {extra} extra, which is not installed; install it: pip install "lightning-accel[{extra}]"'
    return (
        f"unknown {group} option {option!r}{close_matches(option, options)}; "
        f"choose one of: {', '.join(options)} (e.g. {group}={options[0]})"
    )


def _explain_omegaconf(err: Exception) -> str | None:
    full_key = getattr(err, "full_key", None) or ""
    if isinstance(err, _KEY_ERRORS):
        key = str(getattr(err, "key", "") or full_key.rsplit(".", 1)[-1])
        parent = getattr(err, "parent_node", None)
        known = [str(k) for k in parent.keys()] if parent is not None and hasattr(parent, "keys") else []
        where = full_key.rsplit(".", 1)[0] if "." in full_key else "the config"
        return (
            f"unknown key {full_key or key!r} in {where}{close_matches(key, known)}; "
            f"check the spelling, or add a new key with +{full_key or key}=VALUE"
        )
    if isinstance(err, ValidationError):
        value = getattr(err, "msg", str(err)).split("\n")[0]
        wanted, example = next(((v, e) for k, (v, e) in _KINDS.items() if re.search(rf"\b(?:{k})\b", value.split(" (type ")[0], re.IGNORECASE)),
                               ("a value of the right type", "<value>"))
        return f"{full_key}: {value}; pass {wanted}, e.g. {full_key}={example}"
    if isinstance(err, MissingMandatoryValue):
        return f"{full_key} is required and has no value; set it on the command line: {full_key}=VALUE"
    return None


def _dotted_keys(node: Any, prefix: str = "") -> Iterable[str]:
    from omegaconf import DictConfig

    if isinstance(node, DictConfig):
        for key in node.keys():
            path = f"{prefix}.{key}" if prefix else str(key)
            yield path
            yield from _dotted_keys(node._get_node(key), path)


def _explain_interpolation(err: InterpolationResolutionError) -> str:
    """``key=${...}`` that does not resolve: the key it names does not exist, its resolver is unknown, or it reads a
    value that was never set."""
    key = getattr(err, "full_key", None) or "a value"
    child = getattr(err, "child_node", None)
    raw = child._value() if child is not None else None
    shown = f"{key}={raw}" if isinstance(raw, str) else str(key)
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, InterpolationKeyError):
        match = re.search(r"key '([^']+)'", message)
        missing = match.group(1) if match else "?"
        parent = getattr(err, "parent_node", None)
        root = parent._get_root() if parent is not None and hasattr(parent, "_get_root") else None
        hint = close_matches(missing, _dotted_keys(root)) if root is not None else ""
        return f"{shown}: the interpolation reads '{missing}', which does not exist{hint}; point it at an existing key (e.g. ${{trainer.max_steps}}) or give a plain value"
    if isinstance(err, UnsupportedInterpolationType):
        match = re.search(r"type (\S+)", message)
        return (f"{shown}: there is no resolver '{match.group(1) if match else '?'}'; write ${{a.key}} for another key's value, "
                "a resolver Hydra knows (now, oc.env, oc.select, ...), or a plain value")
    if isinstance(err, InterpolationToMissingValueError):
        match = re.search(r"Missing mandatory value: (\S+)", message)
        unset = match.group(1) if match else "KEY"
        return f"{shown}: it reads {unset}, which has no value (???); set it on the command line: {unset}=VALUE"
    if isinstance(err, InterpolationValidationError):  # the value it reads is not of this key's type
        source = re.fullmatch(r"\$\{([\w.]+)\}", raw) if isinstance(raw, str) else None
        problem = re.sub(r"^While dereferencing interpolation '[^']*': ", "", message)
        if source is not None:
            return (f"{shown}: {problem} (it reads {source.group(1)}); set {key} to a value of its own, or "
                    f"{source.group(1)} to one {key} takes")
    return f"{shown}: {message}; fix the interpolation or give a plain value"


def explain(err: BaseException) -> str | None:
    """The one-line explanation of a composition error, or None for unknown errors."""
    if isinstance(err, UserError):
        return str(err)
    if isinstance(err, MissingConfigException):
        return _explain_missing_config(err)
    if isinstance(err, OverrideParseException):
        return f"cannot parse override: {str(err).splitlines()[0]}; overrides look like key=value or group=option"
    if isinstance(err, InterpolationResolutionError):
        return _explain_interpolation(err)
    if isinstance(err, (*_KEY_ERRORS, ValidationError, MissingMandatoryValue)):
        return _explain_omegaconf(err)
    if isinstance(err, ConfigCompositionException):
        cause = err.__cause__ or err.__context__
        if cause is not None and (line := explain(cause)) is not None:
            return line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        added = re.search(r"Could not append to config\. An item is already at '([^']+)'", first)
        if added:  # +key=value for a key the config has
            key = added.group(1)
            return f"+{key}=... adds a key, but {key} is already in the config; set it without the +: {key}=VALUE (or ++{key}=VALUE)"
        return f"{first}; rerun with HYDRA_FULL_ERROR=1 for the traceback"
    cause = err.__cause__ or err.__context__
    return explain(cause) if cause is not None else None


def failure_line(err: BaseException) -> str:
    """One line for an exception that got past the checks and stopped a run (in set-up, a step, a checkpoint write).

    Our own messages (:class:`UserError`, and an exception whose class sets ``explained = True``: its
    ``str()`` is already that line, as a failed checkpoint write's is) come as they are; Hydra's
    ``InstantiationException`` gives way to the constructor's error it wraps; anything else is
    ``Type: first line`` in this module's shape (a ``HINT:`` becomes the fix after ``;``).
    """
    while err.__cause__ is not None and type(err).__name__ == "InstantiationException":
        err = err.__cause__
    if isinstance(err, UserError) or getattr(type(err), "explained", False) is True:
        return one_line(str(err)) or type(err).__name__
    text = one_line(str(err))
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
