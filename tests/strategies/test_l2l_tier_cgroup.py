"""The NVMe tier under a real memory limit: a memory cgroup (v1) that kills the in-memory run lets the tier run finish,
with the same weights as the in-memory run outside it. Needs root and the cgroup v1 memory controller (CI here has both);
skipped elsewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.memory_cgroup import memory_cgroup

WORKER = Path(__file__).parents[1] / "support" / "workers" / "tier_memory_worker.py"
# 16 blocks of 1536 x 1536 Linears (37.8M parameters): in memory 16 B a parameter (fp32 master, gradient, two AdamW
# moments), 0.60 GB beside the interpreter's ~0.33 GB; with the tier the state and masters (0.45 GB) are on disk and
# 3 buffers of one block's (0.085 GB) take their place
WIDTH, DEPTH, STEPS = 1536, 16, 2
LIMIT = 760 * 2**20


@pytest.fixture
def cgroup() -> Iterator[Path]:
    with memory_cgroup(LIMIT) as path:
        yield path


def _start(tmp_path: Path, cgroup: Path | None, nvme: bool) -> subprocess.Popen[str]:
    args = [sys.executable, str(WORKER), str(WIDTH), str(DEPTH), str(STEPS)] + ([str(tmp_path / "nvme")] if nvme else [])
    enter = f"echo $$ > {cgroup / 'cgroup.procs'} && " if cgroup is not None else ""
    command = enter + "exec " + " ".join(args)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.Popen(["sh", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))


def _finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()  # past the timeout
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _run(tmp_path: Path, cgroup: Path | None, nvme: bool) -> subprocess.CompletedProcess[str]:
    return _finish(_start(tmp_path, cgroup, nvme))


def _digest(run: subprocess.CompletedProcess[str]) -> str:
    assert run.returncode == 0, run.stderr[-3000:]
    match = re.search(r"digest=([0-9a-f]+)", run.stdout)
    assert match is not None, run.stdout
    return match.group(1)


@pytest.mark.slow
def test_the_tier_run_and_its_checkpoint_finish_under_a_limit_that_kills_the_in_memory_run(tmp_path: Path, cgroup: Path) -> None:
    # in memory, no limit, outside the cgroup (it writes no file): beside the two runs in it, which take turns
    unlimited = _start(tmp_path, None, nvme=False)
    try:
        killed = _run(tmp_path, cgroup, nvme=False)
        assert killed.returncode == -9 or killed.returncode == 137, (killed.returncode, killed.stderr[-2000:])
        assert int((cgroup / "memory.failcnt").read_text()) > 0
        tiered = _run(tmp_path, cgroup, nvme=True)
    except BaseException:
        unlimited.kill()
        raise
    reference = _finish(unlimited)
    assert _digest(tiered) == _digest(reference)  # the same weights, bit for bit
    assert re.search(r"nvme_read=[1-9]", tiered.stdout)
    assert not any((tmp_path / "nvme").iterdir())  # and its scratch directory is gone
    # its checkpoint, weights and AdamW state (0.45 GB with the interpreter beside it in 0.74 GB), was written under the limit
    assert (tmp_path / "last.ckpt").stat().st_size > 12 * WIDTH * WIDTH * DEPTH
