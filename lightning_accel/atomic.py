"""Writing files whole or not at all.

Checkpoints, the built corpus, ``run.json`` and the prefetch cache are read by other
processes (a resumed run, another rank, the next session). Each is written to a
temporary file in the destination's directory, flushed to disk, and renamed over the
destination with ``os.replace``: a reader sees the old file or the new one, never half of
one, even when the writer is killed or the disk fills up mid-write.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object], mode: int = 0o644) -> Path:
    """Call ``write(f)`` on a temporary file and move it over ``path`` once complete.

    ``mode``: the file's permissions (``mkstemp`` makes 0600; shared caches need 0644).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """:func:`atomic_write` for UTF-8 text."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))
