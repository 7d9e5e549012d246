"""Remembering tuned settings per dataset and machine, so the next run starts tuned.

The key names what the answer depends on: the dataset's type and length, the batch
size, the machine's name and core count, and the ranks sharing it. A JSON file holds
one entry per key; an unreadable file is treated as empty rather than stopping a run.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

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


def store(path: str | os.PathLike, key: str, settings: LoaderSettings) -> None:
    file = Path(path)
    try:
        entries = json.loads(file.read_text())
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    entries[key] = settings.as_kwargs()
    file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(file, json.dumps(entries, indent=1, sort_keys=True))  # two ranks at once leave one whole file
