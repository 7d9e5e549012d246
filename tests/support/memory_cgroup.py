"""A memory cgroup (v1) to run a worker process under a real limit: ``with memory_cgroup(limit) as path``, then start
the process with ``echo $$ > path/cgroup.procs && exec ...``. Needs root and /sys/fs/cgroup/memory; skips the test
elsewhere (pytest.skip), as the tier's cgroup tests do."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path("/sys/fs/cgroup/memory")


@contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    if os.geteuid() != 0 or not (ROOT / "cgroup.procs").exists():
        pytest.skip("needs root and the cgroup v1 memory controller (/sys/fs/cgroup/memory)")
    path = ROOT / f"lightning-accel-test-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(str(limit))
    except OSError as err:
        pytest.skip(f"cannot make a memory cgroup here: {err}")
    try:
        yield path
    finally:
        for _ in range(50):  # (a killed process leaves the group a moment later)
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def in_cgroup(cgroup: Path, args: list[str]) -> list[str]:
    """``args`` as a command that enters ``cgroup`` first."""
    return ["sh", "-c", f"echo $$ > {cgroup / 'cgroup.procs'} && exec " + " ".join(args)]
