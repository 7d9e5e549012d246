"""Run a test's user script the way a user does (``python script.py ...``): Lightning's launcher starts the other ranks from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest


def run_user_script(script: Path, args: Sequence[str], timeout: float, what: str) -> subprocess.CompletedProcess:
    """Run ``script`` with ``args`` as a fresh job; kill its whole process group (every rank) after ``timeout`` seconds
    and fail the test, so a hang never stalls CI. ``what`` names the job in that failure."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        env.pop(var, None)  # a fresh launch, not a rank of some outer job (nor a seed an earlier test's seed_everything set)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{what} still running after {timeout} s: a hang")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout)
