"""Run directories: what ``run.json`` says about a run, kept true after a crash.

Every run writes ``<outputs>/<recipe>/<time>/run.json`` with its status: ``running``,
then ``completed``, ``failed`` (an exception), ``interrupted`` (Ctrl-C; the last completed
step was saved) or ``killed``. A process that is SIGKILLed, loses power or runs out of
memory cannot write ``killed`` itself: the next run of the recipe finds its ``running``
entry, sees that the process is gone and records it (:func:`reap`), removing the
temporary files of a checkpoint write it did not finish and making ``last.ckpt`` the
newest checkpoint again.

``ckpt_path=last`` (:func:`find_last_checkpoint`) takes the newest checkpoint of the
recipe whose run built the same network as the run about to start. A run that fails
before its first checkpoint has nothing to resume from and is removed
(:func:`remove_run_dir`) unless ``keep_failed=true``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_accel.atomic import atomic_write_text
from lightning_accel.config.errors import UserError

STATUSES = ("running", "completed", "failed", "interrupted", "killed")


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def this_process() -> dict[str, Any]:
    """What identifies the running process in its ``run.json``."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "pid_start": _start_time(os.getpid())}


def is_alive(status: dict[str, Any]) -> bool:
    """Whether the process a ``running`` entry names still runs (True when we cannot tell:
    another host, or an entry without a pid)."""
    pid = status.get("pid")
    if not isinstance(pid, int) or status.get("host") != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    started = status.get("pid_start")
    return started is None or _start_time(pid) in (None, started)


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The most recently written ``.ckpt`` of a run (``last.ckpt`` or a step checkpoint)."""
    found = [p for p in (run_dir / "checkpoints").glob("*.ckpt") if p.is_file()]
    return max(found, key=lambda p: (p.stat().st_mtime_ns, p.name == "last.ckpt"), default=None)


def _fix_last(run_dir: Path) -> None:
    """Make ``last.ckpt`` the newest checkpoint: a kill between the step checkpoint's write
    and ``last.ckpt``'s leaves it one interval old."""
    newest = newest_checkpoint(run_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    if newest is None or newest == last:
        return
    tmp = last.with_name(f".{last.name}.relink.tmp")
    tmp.unlink(missing_ok=True)
    os.link(newest, tmp)  # same directory: a hard link, no copy
    os.replace(tmp, last)


def reap(recipe_root: Path) -> list[Path]:
    """Mark the dead ``running`` runs under ``recipe_root`` as ``killed``; returns their dirs."""
    reaped = []
    for status_file in sorted(recipe_root.glob("**/run.json")):
        try:
            status = json.loads(status_file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if status.get("status") != "running" or is_alive(status):
            continue
        run_dir = status_file.parent
        for tmp in [*run_dir.glob(".*.tmp"), *run_dir.glob("checkpoints/.*.tmp")]:
            tmp.unlink(missing_ok=True)
        _fix_last(run_dir)
        status.update(status="killed", error=f"process {status.get('pid')} ended without recording an outcome (killed, or out of memory)")
        atomic_write_text(status_file, json.dumps(status, indent=2, default=str))
        reaped.append(run_dir)
    return reaped


def _net_config(cfg: DictConfig) -> Any:
    model = cfg.get("model")
    if model is None:
        return None
    node = OmegaConf.to_container(model.get("net", model), resolve=True)  # attached: interpolations resolve
    return {k: v for k, v in node.items() if k not in ("optimizer", "scheduler", "scheduler_interval")}


def _difference(old: Any, new: Any, where: str) -> str | None:
    """The first key whose value differs, as ``key: old in that run, new now``."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            found = _difference(old.get(key, "(unset)"), new.get(key, "(unset)"), f"{where}.{key}")
            if found:
                return found
        return None
    return None if old == new else f"{where}={old} in that run, {new} now"


def find_last_checkpoint(recipe_root: Path, cfg: DictConfig) -> Path:
    """The newest checkpoint under ``recipe_root`` from a run whose network config equals
    ``cfg``'s; a one-line :class:`UserError` naming the newest run otherwise."""
    dirs = [c.parent.parent for c in recipe_root.glob("**/.hydra/config.yaml")]
    runs = [(ckpt, d) for d in dirs if (ckpt := newest_checkpoint(d)) is not None]
    runs.sort(key=lambda r: r[0].stat().st_mtime_ns, reverse=True)
    if not runs:
        raise UserError(f"ckpt_path=last but no earlier run of this recipe under {recipe_root} has a checkpoint; start without ckpt_path")
    want = _net_config(cfg)
    reasons = []
    for ckpt, run_dir in runs:
        try:
            had = _net_config(OmegaConf.load(run_dir / ".hydra" / "config.yaml"))
        except Exception as err:  # a config that no longer resolves: cannot tell, do not take it
            reasons.append((run_dir, f"its config cannot be read ({type(err).__name__})"))
            continue
        difference = _difference(had, want, "model.net" if "net" in (cfg.get("model") or {}) else "model")
        if difference is None:
            return ckpt
        reasons.append((run_dir, f"its network differs: {difference}"))
    run_dir, why = reasons[0]
    raise UserError(
        f"ckpt_path=last found {run_dir} but {why}; resume with the same model overrides, "
        "pass ckpt_path=<a .ckpt file>, or start without ckpt_path"
    )


def requeued_checkpoint(recipe_root: Path, job: str) -> Path | None:
    """The checkpoint a requeued SLURM job resumes from: the newest of this recipe's runs whose ``run.json`` names the
    job (``slurm_job``, recorded by the run that SLURM's requeue signal interrupted); None when there is none."""
    found = []
    for status_file in recipe_root.glob("**/run.json"):
        try:
            status = json.loads(status_file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if status.get("slurm_job") == job and (ckpt := newest_checkpoint(status_file.parent)) is not None:
            found.append(ckpt)
    return max(found, key=lambda p: p.stat().st_mtime_ns, default=None)


CLAIM_TRIES = 1000


def claim_run_dir(where: Path) -> Path:
    """Make ``where`` for this run alone and return it: an exclusive create (``mkdir`` of a directory that must not exist),
    so two runs started in the same second (a job array, a sweep launched by hand, two terminals) never share a run
    directory; when another run holds ``where``, the first free of ``where_1``, ``where_2``, ... (Hydra's run directory
    is named by the second it starts)."""
    where.parent.mkdir(parents=True, exist_ok=True)
    for n in range(CLAIM_TRIES):
        candidate = where if n == 0 else where.with_name(f"{where.name}_{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise UserError(f"'{where}' and {CLAIM_TRIES - 1} numbered variants of it exist already; remove old runs there, or point "
                    "LIGHTNING_ACCEL_OUTPUTS at another directory")


def remove_run_dir(run_dir: Path, *, keep_parent: bool = False) -> None:
    """Remove a failed run's directory, and its recipe's directory when that is left empty
    (``keep_parent``: a sweep's trial, whose parent holds the sweep's own files)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    if not keep_parent:
        with contextlib.suppress(OSError):
            run_dir.parent.rmdir()  # only when empty: the recipe's other runs stay
