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
from typing import Any, BinaryIO

# written bytes between two flushes to disk of a checkpoint being written (see CacheBoundedWriter)
FLUSH_EVERY = 64 << 20


class CacheBoundedWriter:
    """A file wrapper that writes ``FLUSH_EVERY`` bytes at a time to disk and drops them from the page cache.

    Why: what a process writes waits in the page cache, dirty, until the kernel writes it back, and the page cache is
    charged to the process's memory cgroup. A checkpoint of a run whose state lives on disk (the NVMe tier) is as
    large as that state: written through the cache it filled a 760 MiB cgroup v1 (which has no per-cgroup dirty
    throttling) and the run was killed while saving, though no tensor was in memory twice. Flushed and dropped every
    64 MiB, the cache holds at most that much of it."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self._pending = 0

    def write(self, data: Any) -> int:
        written = self.file.write(data)
        self._pending += len(memoryview(data).cast("B")) if not isinstance(data, (bytes, bytearray)) else len(data)
        if self._pending >= FLUSH_EVERY:
            self.drop()
        return written

    def drop(self) -> None:
        self.file.flush()
        fd = self.file.fileno()
        os.fdatasync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self._pending = 0

    def flush(self) -> None:
        self.file.flush()


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object], mode: int = 0o644, bounded_cache: bool = False) -> Path:
    """Call ``write(f)`` on a temporary file and move it over ``path`` once complete.

    ``mode``: the file's permissions (``mkstemp`` makes 0600; shared caches need 0644). ``bounded_cache``: ``f`` is a
    :class:`CacheBoundedWriter` (checkpoints: at most 64 MiB of it in the page cache at once).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            write(CacheBoundedWriter(f) if bounded_cache else f)  # type: ignore[arg-type]
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
