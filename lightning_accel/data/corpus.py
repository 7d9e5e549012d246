"""A real text corpus built offline from the Python standard library's sources.

Every machine that runs this package has a Python standard library, so its ``.py``
files give a few megabytes of real, structured text without any download. The corpus
is built once per (Python, ``max_bytes``) and cached; later calls return the cached
file, and the same Python always yields the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import sysconfig
from pathlib import Path

from lightning_accel.atomic import atomic_write

__all__ = ["default_cache_dir", "stdlib_corpus"]

# Directories that are not stdlib source proper (third-party packages) or that are
# dominated by test fixtures and IDE code, which would skew the text towards boilerplate.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})


def default_cache_dir() -> Path:
    """``$LIGHTNING_ACCEL_CACHE`` if set, else ``~/.cache/lightning_accel``.

    An environment variable (not only an argument) so that tests, clusters with a
    read-only home and CI can all redirect every cache at once.
    """
    env = os.environ.get("LIGHTNING_ACCEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightning_accel"


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _cache_name(root: Path, max_bytes: int) -> str:
    # Keyed by interpreter version and stdlib location: two installs of the same
    # version share nothing on disk, and a distro-patched stdlib must not be mistaken
    # for another one's corpus. The path hash is short; it only has to disambiguate.
    tag = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:8]
    version = f"{platform.python_implementation().lower()}{sys.version_info[0]}.{sys.version_info[1]}.{sys.version_info[2]}"
    return f"stdlib-corpus-{version}-{tag}-{max_bytes}.txt"


def _source_files(root: Path) -> list[Path]:
    """Relative paths of the corpus's source files, sorted so the order is stable."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place: site-packages alone can hold more files than the stdlib.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and d != "__pycache__"]
        base = Path(dirpath).relative_to(root)
        files.extend(base / name for name in filenames if name.endswith(".py"))
    return sorted(files, key=lambda p: p.as_posix())


def _build(root: Path, max_bytes: int) -> bytes:
    """Concatenate headers and sources, stopping at ``max_bytes`` on a UTF-8 boundary."""
    chunks: list[bytes] = []
    size = 0
    for rel in _source_files(root):
        # Decode/encode round trip: the corpus is valid UTF-8 even if a file is not.
        text = (root / rel).read_bytes().decode("utf-8", errors="replace")
        chunk = f"\n# ---- {rel.as_posix()}\n{text}".encode()
        room = max_bytes - size
        if len(chunk) > room:
            # Cut the last file, dropping a partial multi-byte character at the cut so
            # the file still decodes cleanly as UTF-8.
            chunks.append(chunk[:room].decode("utf-8", errors="ignore").encode())
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def stdlib_corpus(cache_dir: str | Path | None = None, max_bytes: int = 8_000_000) -> Path:
    """Return the path of the cached stdlib corpus, building it on the first call.

    The write is a temporary file plus ``os.replace`` so that concurrent builders (one
    per DDP rank, say) and interrupted builds never leave a partial corpus behind.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes!r} is not a positive integer; pass data.max_bytes=<bytes, e.g. 8000000>")
    root = _stdlib_root()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / _cache_name(root, max_bytes)
    if target.is_file():
        return target
    if not root.is_dir():
        raise FileNotFoundError(
            f"Python standard library '{root}' is not a directory; pass data.source=file data.path=<a UTF-8 text file>"
        )
    data = _build(root, max_bytes)
    # readable by others: a shared $LIGHTNING_ACCEL_CACHE serves several users
    return atomic_write(target, lambda f: f.write(data), mode=0o644)
