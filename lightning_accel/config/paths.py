"""One check for every path a run reads or writes: :func:`check_path`, and :func:`check_config_paths` over a recipe.

A path comes from a key (``strategy.nvme_path``, ``callbacks.model_checkpoint.dirpath``, ``model.net.pretrained_path``,
``ckpt_path``) or from an environment variable (``LIGHTNING_ACCEL_OUTPUTS``, ``LIGHTNING_ACCEL_CACHE``). Each is asked the
same questions before any work: not empty, of the right kind (a directory, a file), existing where it is read, creatable
where it is made (no file on the way, a writable ancestor), writable where it is written, and for a scratch directory
on a file system that holds what the run keeps there. The answer is one line naming the key or variable, the value, the
problem and the fix: ``LIGHTNING_ACCEL_CACHE='/etc/passwd' is a file, not a directory; set LIGHTNING_ACCEL_CACHE to a
directory (made if missing), or unset it to use ~/.cache/lightning_accel``.

Which keys are paths is not a hand list of keys: every ``_target_`` node of the composed config is read against its
constructor's parameters (:func:`lightning_accel.config.schema.path_parameters`), and what a name says (``*_dir``,
``dirpath``, ``*_path``) decides the rule (:func:`rule_for`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_accel.config.errors import UserError

__all__ = ["ENV_PATHS", "PathRule", "check_config_paths", "check_env_paths", "check_path", "config_paths", "path_keys", "path_problem", "rule_for"]


@dataclass(frozen=True)
class PathRule:
    """What a path must be. ``kind``: ``dir``, ``file`` or ``any`` (a directory or a file, as a pretrained model is);
    ``read``: it must exist (else it is made: a directory, or a file's parent); ``write``: we write there."""

    kind: str
    read: bool = False
    write: bool = False

    @property
    def noun(self) -> str:
        return {"dir": "a directory", "file": "a file", "any": "a file or directory"}[self.kind]


WRITE_DIR = PathRule("dir", write=True)
WRITE_FILE = PathRule("file", write=True)
READ_FILE = PathRule("file", read=True)
READ_ANY = PathRule("any", read=True)

# The environment variables that name a directory, the key that reads each, and what unsetting it gives.
ENV_PATHS: dict[str, tuple[str, str]] = {
    "LIGHTNING_ACCEL_OUTPUTS": ("paths.root_dir", "./outputs"),
    "LIGHTNING_ACCEL_CACHE": ("paths.cache_dir", "~/.cache/lightning_accel"),
}


def rule_for(name: str) -> PathRule | None:
    """The rule a parameter's name gives (None: not a path): directories we write (``*_dir``, ``dirpath``,
    ``nvme_path``, ``save_dir``), files we write (``cache_path``), what a run reads (``ckpt_path``, ``pretrained_path``,
    a data module's ``path`` / ``*_path``)."""
    name = name.rsplit(".", 1)[-1]
    if name in ("dirpath", "save_dir", "nvme_path") or name.endswith("_dir"):
        return WRITE_DIR
    if name == "cache_path":
        return WRITE_FILE
    if name == "ckpt_path":
        return READ_FILE
    if name == "pretrained_path":
        return READ_ANY
    if name == "path" or name.endswith("_path"):
        return READ_FILE
    return None


def _existing_ancestor(path: Path) -> Path:
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


def path_problem(value: Any, rule: PathRule) -> str | None:
    """What is wrong with ``value`` as a path under ``rule`` (the words after ``key='value'``), or None."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return "is empty"
    if not isinstance(value, (str, os.PathLike)):
        return f"is a {type(value).__name__}, not a path"
    text = os.fspath(value)
    if "\x00" in text:
        return "holds a NUL character, which no path can"
    path = Path(text).expanduser()
    if path.exists():
        if rule.kind == "dir" and not path.is_dir():
            return "is a file, not a directory"
        if rule.kind == "file" and path.is_dir():
            return "is a directory, not a file"
        if rule.read and not os.access(path, os.R_OK):
            return "is not readable by this user"
        where = path if path.is_dir() else path.parent
        if rule.write and not os.access(where, os.W_OK | os.X_OK):
            return f"is in '{where}', which is not writable by this user" if where != path else "is not writable by this user"
        return None
    if rule.read:
        existing = _existing_ancestor(path)
        if existing.exists() and not existing.is_dir():
            return f"does not exist ('{existing}' on its way is a file)"
        return "does not exist"
    target = path if rule.kind == "dir" else path.parent
    existing = _existing_ancestor(target)
    if not existing.is_dir():
        return f"cannot be made: '{existing}' on its way is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot be made: '{existing}' is not writable by this user"
    return None


def check_path(key: str, value: Any, rule: PathRule, fix: str | None = None) -> Path:
    """``value`` as a :class:`~pathlib.Path` when it meets ``rule``; a one-line :class:`UserError` naming ``key`` otherwise.
    ``fix``: what to do (default: point ``key`` at what the rule asks for)."""
    problem = path_problem(value, rule)
    if problem is not None:
        shown = value if not isinstance(value, os.PathLike) else os.fspath(value)
        made = " (made if missing)" if not rule.read else ""
        raise UserError(f"{key}={shown!r} {problem}; {fix or f'set {key} to {rule.noun}{made} that this user can ' + ('read' if rule.read else 'write')}")
    return Path(os.fspath(value)).expanduser()


def check_env_paths(environ: Mapping[str, str] | None = None) -> None:
    """Every environment variable of :data:`ENV_PATHS` that is set: a writable directory, made if missing (an empty
    ``LIGHTNING_ACCEL_OUTPUTS`` would put the run at the file system's root)."""
    environ = os.environ if environ is None else environ
    for name, (key, default) in ENV_PATHS.items():
        if name in environ:
            check_path(name, environ[name], WRITE_DIR,
                       f"set {name} to a directory this user can write (made if missing), or unset it to use {default} ({key})")


def check_scratch(key: str, path: Path) -> None:
    """A scratch directory (the NVMe tier's files) must take files that are created, grown and renamed; a file system
    that refuses (read-only, a FUSE mount without rename) is said now, with the key."""
    existing = _existing_ancestor(path)
    try:
        fd, probe = tempfile.mkstemp(prefix=".lightning-accel-probe.", dir=existing)
        try:
            os.ftruncate(fd, 4096)
            os.replace(probe, probe + ".renamed")
            probe += ".renamed"
        finally:
            os.close(fd)
            Path(probe).unlink(missing_ok=True)
    except OSError as err:
        raise UserError(f"{key}='{path}' is on a file system that cannot hold the run's scratch files ({err.strerror or err} in "
                        f"'{existing}'); point {key} at a directory on a local disk") from None


def _walk(node: Any, prefix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every ``_target_`` node of a plain container, with its dotted key."""
    if isinstance(node, dict):
        if "_target_" in node:
            yield prefix, node
        for key, value in node.items():
            if not str(key).startswith("_"):
                yield from _walk(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{prefix}[{i}]")


def path_keys(cfg: DictConfig) -> Iterator[tuple[str, PathRule]]:
    """Every path-valued key of a composed config, set or not, and its rule: ``paths.root_dir`` / ``paths.cache_dir``
    (what the environment variables set) and the parameters of every ``_target_`` the schema calls paths
    (:func:`lightning_accel.config.schema.path_parameters`)."""
    from lightning_accel.config.schema import path_parameters

    plain = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]), resolve=False)
    assert isinstance(plain, dict)
    for key in ("root_dir", "cache_dir"):
        if key in (plain.get("paths") or {}):
            yield f"paths.{key}", WRITE_DIR
    for where, node in _walk(plain, ""):
        for name in path_parameters(str(node["_target_"])):
            if (rule := rule_for(name)) is not None:
                yield f"{where}.{name}", rule


def config_paths(cfg: DictConfig) -> Iterator[tuple[str, Any, PathRule]]:
    """:func:`path_keys` that are set, with their values (an interpolation only the run resolves is left to it)."""
    for key, rule in path_keys(cfg):
        try:
            value = OmegaConf.select(cfg, key)
        except Exception:  # ${hydra:runtime.output_dir}: the run makes it
            continue
        if value is not None:
            yield key, value, rule


def check_config_paths(cfg: DictConfig) -> None:
    """:func:`check_path` for every path-valued key of ``cfg`` (``ckpt_path`` is the resume checks' own; ``last`` is no
    path), and the NVMe tier's scratch directory on a file system that holds its files."""
    for key, value, rule in config_paths(cfg):
        env = next((name for name, (read_by, _) in ENV_PATHS.items() if read_by == key and name in os.environ), None)
        if env is not None:
            continue  # check_env_paths named the variable
        path = check_path(key, value, rule)
        if key.endswith(".nvme_path"):
            check_scratch(key, path)
