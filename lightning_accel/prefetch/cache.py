"""Remembering tuned settings per dataset and machine, so the next run starts tuned.

The key names what the answer depends on: the dataset's type and length, the batch
size, the machine's name and core count, and the ranks sharing it. A JSON file holds
one entry per key; an unreadable file is treated as empty rather than stopping a run.
Runs sharing the file (``LIGHTNING_ACCEL_CACHE``) store under a lock beside it
(``<file>.lock``, :mod:`filelock`): each reads, adds its entry and writes while holding
it, so two runs storing at once both keep their entry. Readers need no lock: a write
replaces the file whole (rename).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from filelock import FileLock

from lightning_accel.atomic import atomic_write_text
from lightning_accel.prefetch.settings import LoaderSettings


def cache_key(dataset: Any, batch_size: int | None, local_world_size: int = 1) -> str:
    try:
        length: Any = len(dataset)
    except TypeError:
        length = "?"
    kind = f"{type(dataset).__module__}.{type(dataset).__qualname__}"
    return f"{kind}|len={length}|batch={batch_size}|{platform.node()}|cores={os.cpu_count()}|ranks={local_world_size}"


def load(path: str | os.PathLike, key: str) -> LoaderSettings | None:
    try:
        entry = json.loads(Path(path).read_text())[key]
        return LoaderSettings(**entry)
    except (OSError, ValueError, KeyError, TypeError):
        return None


# Seconds a store waits for another run's store (a read and a write of a small file) before failing.
LOCK_TIMEOUT_S = 60.0


def store(path: str | os.PathLike, key: str, settings: LoaderSettings) -> None:
    """Add (or replace) ``key``'s entry, keeping every other run's: the read-modify-write holds the file's lock."""
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{file}.lock", timeout=LOCK_TIMEOUT_S):
        try:
            entries = json.loads(file.read_text())
            if not isinstance(entries, dict):
                entries = {}
        except (OSError, ValueError):
            entries = {}
        entries[key] = settings.as_kwargs()
        atomic_write_text(file, json.dumps(entries, indent=1, sort_keys=True))  # a reader sees one whole file
