"""The NVMe tier's scratch directory: one per run under ``nvme_path``, never read as another run's state.

The tier's files hold a run's optimizer state and masters between steps, and nothing else: the
truth is the checkpoint. So each run makes a fresh directory of its own (``mkdtemp``: two runs,
or two ranks, pointed at one ``nvme_path`` never share a file), writes every file from what it
holds in memory before it reads one, and removes the directory when the fit ends. A directory left
by a run that was killed (SIGKILL leaves no chance to clean up) is never read: the next run on the
same host removes it once no process of that id is alive, so a crash does not leak the disk.
Nothing here imports Lightning.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time

PREFIX = "lightning-accel-tier-"
OWNER = "owner.json"


def make_run_dir(nvme_path: str) -> str:
    """A new, empty directory of this process under ``nvme_path`` (made if missing); stale ones of dead runs
    on this host are removed first. ``nvme_path`` that cannot hold a directory is refused in one line."""
    if os.path.exists(nvme_path) and not os.path.isdir(nvme_path):
        raise ValueError(f"strategy.nvme_path={nvme_path!r} is a file; give a directory on a fast local disk")
    try:
        os.makedirs(nvme_path, exist_ok=True)
        remove_stale(nvme_path)
        path = tempfile.mkdtemp(prefix=PREFIX, dir=nvme_path)
    except PermissionError:
        raise ValueError(f"strategy.nvme_path={nvme_path!r} is not writable; give a directory this user can write to") from None
    with open(os.path.join(path, OWNER), "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}, f)
    return path


def remove_stale(nvme_path: str) -> list[str]:
    """Remove the tier directories under ``nvme_path`` whose owner is a process of this host that no longer
    runs (a killed run's scratch); returns what was removed. Directories of other hosts are left alone."""
    removed = []
    host = socket.gethostname()
    for name in os.listdir(nvme_path):
        path = os.path.join(nvme_path, name)
        if not name.startswith(PREFIX) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER)) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            continue  # being made right now by another run, or not ours
        if owner.get("host") == host and not _alive(int(owner.get("pid", -1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
