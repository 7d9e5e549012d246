"""Run a test's user script the way a user does (``python script.py ...``): Lightning's launcher starts the other ranks from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from lightning_accel.comm.rendezvous import held_store, store_env
from tests.support.warm_python import python as warm_python


def run_user_script(script: Path, args: Sequence[str], timeout: float, what: str, warm: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` with ``args`` as a fresh job; kill its whole process group (every rank) after ``timeout`` seconds
    and fail the test, so a hang never stalls CI. ``what`` names the job in that failure. The ranks meet in a store
    this process holds (:func:`~lightning_accel.comm.rendezvous.held_store`), not on a port Lightning picks and frees.
    ``warm``: started by the tests' warm Python (:mod:`tests.support.warm_python`), every rank; else fresh interpreters."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_USE_AGENT_STORE", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        env.pop(var, None)  # a fresh launch, not a rank of some outer job (nor a seed an earlier test's seed_everything set)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    store = held_store(timeout)
    env.update(store_env(store.port))
    proc = subprocess.Popen(
        [warm_python() if warm else sys.executable, str(script), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{what} still running after {timeout} s: a hang")
    finally:
        del store
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout)
