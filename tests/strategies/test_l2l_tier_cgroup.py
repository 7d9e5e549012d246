"""The NVMe tier under a real memory limit: a transformers Llama (from a ``LlamaConfig``, random weights, built on meta and
given its tensors unit by unit) whose full training state (fp32 weights, gradients and AdamW's two moments: 16 B a
parameter) is at least 4x a memory cgroup's limit fine-tunes fully inside it, two steps and a checkpoint, with the same
weights as the run in memory outside it, bit for bit. The limit counts the worker's own interpreter (torch, Lightning,
transformers: ~340 MiB of anonymous memory before the model). Needs root and the cgroup v1 memory controller (CI here
has both); skipped elsewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install 'lightning-accel[hf]'")

from tests.support.memory_cgroup import in_cgroup, memory_cgroup  # noqa: E402
from tests.support.workers import tier_memory_worker as worker  # noqa: E402

# 70 blocks of 1.77M parameters and a 0.79M resident unit: 124.7M parameters, 2.00 GB of training state in memory; the
# tier keeps 59 MB whatever the depth (4 blocks' gradients, a few buffers; the plan streams the resident unit too)
LAYERS, STEPS, BUDGET = 70, 2, "64MB"
LIMIT = 470 * 2**20


@pytest.fixture
def cgroup() -> Iterator[Path]:
    with memory_cgroup(LIMIT) as path:
        yield path


def _start(tmp_path: Path, cgroup: Path | None) -> subprocess.Popen[str]:
    args = [sys.executable, worker.__file__, str(LAYERS), str(STEPS)]
    if cgroup is not None:  # the tier run, in the cgroup
        args = in_cgroup(cgroup, [*args, str(tmp_path / "nvme"), BUDGET])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the two runs side by side, one core each
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))


def _finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()  # past the timeout
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _field(run: subprocess.CompletedProcess[str], key: str) -> str:
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    match = re.search(rf"{key}=(\S+)", run.stdout)
    assert match is not None, run.stdout
    return match.group(1)


@pytest.mark.slow
def test_a_llama_four_times_the_limit_fine_tunes_inside_it_as_in_memory(tmp_path: Path, cgroup: Path) -> None:
    (tmp_path / "nvme").mkdir()
    in_memory = _start(tmp_path, None)  # no limit, outside the cgroup (it writes no file), beside the tier run
    try:
        tiered = _finish(_start(tmp_path, cgroup))
    except BaseException:
        in_memory.kill()
        raise
    reference = _finish(in_memory)
    params = int(_field(tiered, "params"))
    assert 16 * params >= 4 * LIMIT and int((cgroup / "memory.limit_in_bytes").read_text()) == LIMIT
    assert _field(tiered, "digest") == _field(reference, "digest")  # the same weights, bit for bit
    assert int(_field(tiered, "nvme_read")) > 12 * params  # state and masters read back from disk each step
    # what the plan chose to keep the budget, said on its line; the tier's scratch directory gone after fit
    assert "the blocks step during the backward" in tiered.stdout and "the resident unit streamed through the tier" in tiered.stdout
    assert not any((tmp_path / "nvme").iterdir())
    # its checkpoint, weights and AdamW state (1.5 GB), was written under the limit too
    assert (tmp_path / "last.ckpt").stat().st_size > 12 * params
