"""Run a test's user script the way a user does (``python script.py ...``): Lightning's launcher starts the other ranks from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from lightning_accel.comm.rendezvous import held_store, store_env
from tests.support.warm_python import python as warm_python


class UserScript:
    """A user script started by :func:`start_user_script`, running while the caller works; :meth:`result` waits for it."""

    def __init__(self, proc: subprocess.Popen[str], store: object, timeout: float, what: str) -> None:
        self.proc, self._store, self._what = proc, store, what
        self._deadline = time.monotonic() + timeout
        self._timeout = timeout
        self._done: subprocess.CompletedProcess | None = None

    def result(self) -> subprocess.CompletedProcess:
        """Its outcome, once it ended; past its ``timeout`` (counted from its start) its whole process group is killed
        and the test fails."""
        if self._done is None:
            try:
                stdout, _ = self.proc.communicate(timeout=max(1.0, self._deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.communicate()
                pytest.fail(f"{self._what} still running after {self._timeout} s: a hang")
            finally:
                self._store = None
            self._done = subprocess.CompletedProcess(self.proc.args, self.proc.returncode, stdout)
        return self._done

    def kill(self) -> None:
        """End it now, every rank (a fixture's teardown, when a test never waited for it)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.communicate()
        self._store = None


def start_user_script(script: Path, args: Sequence[str], timeout: float, what: str, warm: bool = True) -> UserScript:
    """:func:`run_user_script`, started and not waited for: the caller computes its references meanwhile."""
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
    return UserScript(proc, store, timeout, what)


def run_user_script(script: Path, args: Sequence[str], timeout: float, what: str, warm: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` with ``args`` as a fresh job; kill its whole process group (every rank) after ``timeout`` seconds
    and fail the test, so a hang never stalls CI. ``what`` names the job in that failure. The ranks meet in a store
    this process holds (:func:`~lightning_accel.comm.rendezvous.held_store`), not on a port Lightning picks and frees.
    ``warm``: started by the tests' warm Python (:mod:`tests.support.warm_python`), every rank; else fresh interpreters."""
    return start_user_script(script, args, timeout, what, warm).result()


def params_of_collected(request: pytest.FixtureRequest, function: object, name: str) -> list[object]:
    """The values of parameter ``name`` of the session's collected cases of test ``function``, in order, once each."""
    return list(dict.fromkeys(i.callspec.params[name] for i in request.session.items if getattr(i, "function", None) is function))


def finish_beside(job: UserScript, work: object) -> None:
    """While ``job`` runs, call ``work()`` (references fitted in this process); then wait for ``job``, which must
    succeed. ``work`` raising kills ``job`` first."""
    try:
        work()  # type: ignore[operator]
    except BaseException:
        job.kill()
        raise
    result = job.result()
    assert result.returncode == 0, result.stdout[-4000:]
