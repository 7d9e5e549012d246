"""Checkpoints written whole or not at all.

Lightning's ``TorchCheckpointIO`` opens the destination and writes into it, so a crash,
a kill or a full disk in the middle leaves a truncated file where a good checkpoint (say
``last.ckpt``) used to be. We write to a temporary file in the same directory, flush it
to disk, and ``os.replace`` it over the destination: readers see the old file or the new
one, never half of one.

A write that fails (a full disk, an I/O error, a read-only directory) removes its
temporary file and raises :class:`CheckpointWriteError`, whose one line names the path,
the cause and the bytes the checkpoint needed: torch's own error from inside its zip
writer ("enforce fail at inline_container.cc") names neither.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_accel.atomic import atomic_write

_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written; the previous file at ``path`` is untouched.

    An ``OSError`` with the cause's ``errno``, so code that handles a failed write as an
    ``OSError`` still does; ``str()`` is one line: path, cause, bytes needed, fix (``explained``:
    :func:`lightning_accel.config.errors.failure_line` shows it as it is).
    """

    explained = True

    def __init__(self, path: str | Path, needed: int, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.path, self.needed, self.cause = Path(path), needed, cause

    def __str__(self) -> str:
        code = errno.errorcode.get(self.errno, "") if self.errno is not None else ""
        reason = f"{self.cause.strerror or self.cause}" + (f" ({code})" if code else "")
        need = f"it needs about {self.needed:,} bytes ({_human(self.needed)}, estimated from its tensors)"
        free = _free(self.path.parent)
        if self.errno in _NO_ROOM:
            fix = (f"{need} and {_human(free) if free is not None else 'an unknown amount'} is free there; free that much "
                   "or write checkpoints to another disk (callbacks.model_checkpoint.dirpath=...)")
        elif self.errno in _NOT_WRITABLE:
            fix = f"{need}; make '{self.path.parent}' writable or write checkpoints elsewhere (callbacks.model_checkpoint.dirpath=...)"
        else:
            fix = f"{need}; check the disk (dmesg) or write checkpoints to another one (callbacks.model_checkpoint.dirpath=...)"
        return f"cannot write checkpoint '{self.path}': {reason}; {fix}"


def _human(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def _free(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def checkpoint_bytes(checkpoint: Any) -> int:
    """About what ``torch.save(checkpoint)`` writes: each tensor storage once (torch.save writes a view's
    whole storage, and tied weights' shared one once); the pickled rest is small beside it and not counted."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in _tensors(checkpoint):
        try:
            storage = tensor.untyped_storage()
            seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
            seen[("other", id(tensor))] = tensor.nbytes
    return sum(seen.values())


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that saves through a temporary file and an atomic rename."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"AtomicCheckpointIO does not take storage_options (got {storage_options!r}); "
                "use a CheckpointIO plugin that supports them"
            )
        if "://" in str(path):  # remote filesystems: no atomic rename to rely on
            return super().save_checkpoint(checkpoint, path, storage_options)
        try:
            atomic_write(path, lambda f: torch.save(checkpoint, f), bounded_cache=True)
        except OSError as err:
            raise CheckpointWriteError(path, checkpoint_bytes(checkpoint), err) from err
        except RuntimeError as err:  # torch's zip writer turns the file's OSError into "enforce fail at inline_container.cc"
            cause = _os_error_of(err)
            if cause is None:
                raise
            raise CheckpointWriteError(path, checkpoint_bytes(checkpoint), cause) from err


def _os_error_of(err: BaseException) -> OSError | None:
    """The OSError a write raised inside torch's zip writer, which keeps it only as the context of its own error."""
    seen = 0
    cause = err.__cause__ or err.__context__
    while cause is not None and seen < 8:
        if isinstance(cause, OSError):
            return cause
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return None
