"""The tests' warm Python (tests/support/warm_python.py) behaves as a fresh interpreter would, for what the tests use."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.warm_python import python as warm_python

SCRIPT = '''
import json, os, signal, sys, time, torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "threads": torch.get_num_threads(), "env": os.environ.get("WARM_TEST"),
                  "path0": sys.path[0], "rank": rank_zero_only.rank, "affinity": sorted(os.sched_getaffinity(0)),
                  "executable": sys.executable, "main": __name__, "pid": os.getpid()}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
mode = sys.argv[1]
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "raise":
    raise ValueError("boom")
if mode == "interrupt":
    raise KeyboardInterrupt
if mode == "sleep":
    time.sleep(60)
sys.exit(int(mode))
'''

pytestmark = pytest.mark.skipif(os.environ.get("LIGHTNING_ACCEL_TESTS_COLD") == "1", reason="the warm Python is off")


def _run(tmp_path: Path, mode: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    return subprocess.run([warm_python(), str(script), mode], cwd=tmp_path, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize(("mode", "code", "stderr"), [("0", 0, "to stderr"), ("3", 3, "to stderr"), ("raise", 1, "ValueError: boom"),
                                                      ("kill", -signal.SIGKILL, "to stderr"),
                                                      ("interrupt", -signal.SIGINT, "KeyboardInterrupt")])
def test_exit_status_streams_and_state_are_a_fresh_processs(tmp_path: Path, mode: str, code: int, stderr: str) -> None:
    done = _run(tmp_path, mode, WARM_TEST="here", OMP_NUM_THREADS="1", LOCAL_RANK="1")
    assert done.returncode == code, done.stderr
    assert stderr in done.stderr
    seen = json.loads(done.stdout.splitlines()[0])
    assert seen["argv"] == [str(tmp_path / "script.py"), mode] and seen["cwd"] == str(tmp_path) and seen["main"] == "__main__"
    assert (seen["env"], seen["threads"], seen["path0"], seen["rank"]) == ("here", 1, str(tmp_path), 1)
    assert seen["affinity"] == sorted(os.sched_getaffinity(0))
    assert seen["executable"] == warm_python()  # what Lightning launches other ranks with: warm too


def test_a_process_group_kill_of_the_launcher_ends_the_child(tmp_path: Path) -> None:
    """run_user_script's end for a hang: SIGKILL to the launcher's group, which the zygote's child is not in."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([warm_python(), str(script), "sleep"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = json.loads(proc.stdout.readline())["pid"]  # running
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    pytest.fail(f"the child {child} outlived its launcher")
