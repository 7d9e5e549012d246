"""Which PJRT devices the xla_pjrt strategy trains on: one by index, or all of them by SPMD.

The device plan is a pure function, tested here without torch_xla. The fits need
``CPU_NUM_DEVICES=2``, which the PJRT runtime reads once when it starts, so they run in a
fresh process each (``xla_devices_worker.py``) and compare against plain CPU there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.accelerators.spmd import Placement, plan_placement
from tests.support.workers import WORKERS

WORKER = WORKERS / "xla_devices_worker.py"


def test_one_index_is_that_device() -> None:
    assert plan_placement([1], 2) == Placement(index=1)
    assert not Placement(index=1).spmd


def test_all_devices_are_spmd_data_parallel() -> None:
    assert plan_placement([0, 1, 2, 3], 4) == Placement(count=4)
    assert plan_placement([3, 2, 1, 0], 4).spmd


@pytest.mark.parametrize("indices", [[0, 1], [1, 3]])
def test_some_but_not_all_devices_is_refused_with_the_fix(indices: list[int]) -> None:
    with pytest.raises(ValueError, match=re.escape(f"devices={indices} asks for 2 of the 4 PJRT devices") + ".*; set devices=4 or devices=-1; or start"):
        plan_placement(indices, 4, "start the process with CPU_NUM_DEVICES=2")


def test_no_device_is_refused() -> None:
    with pytest.raises(ValueError, match=r"devices=\[\] names no device"):
        plan_placement([], 4)


def _run_worker(mode: str, steps: int, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{mode}.pt"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    # a generous limit: CI runs this lane at nice 19 beside the main one, which may hold both cores for minutes
    proc = subprocess.run(
        [sys.executable, str(WORKER), mode, str(steps), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = torch.load(out, weights_only=False)
    result["log"] = proc.stdout + proc.stderr
    return result


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], **tol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.xla
def test_two_devices_spmd_matches_one_cpu_process(xla_cpu_available: None, tmp_path: Path) -> None:
    # 48 steps = 3 epochs of 16 batches of 16, validation at every 10th batch of an epoch.
    r = _run_worker("spmd", 48, tmp_path)
    assert r["spmd_count"] == 2 and r["root_device"] == "xla:0"
    assert "data parallel over 2 PJRT devices by SPMD" in r["log"]
    # Each global batch of 16 is split 8 + 8 over the two CPU PJRT devices.
    for batch in r["batches"]:
        assert batch["sharding"] == "{devices=[2,1]0,1}"
        assert batch["shards"] == [((8, 8), "CPU:0"), ((8, 8), "CPU:1")]
    # Gradients all-reduced: after 48 updates each device's copy of every parameter is
    # the same (per-device gradients of different half-batches would drift apart) ...
    for name, copies in r["replicas"].items():
        assert [d for d, _ in copies] == ["CPU:0", "CPU:1"], name
        torch.testing.assert_close(copies[1][1], copies[0][1], rtol=0, atol=0)
    # ... and the same as one CPU process training on the whole global batches. SPMD
    # splits each reduction in two and XLA fuses differently: rounding, which Adam carries
    # forward; stated tolerance 1e-4 relative / 1e-5 absolute (seen: 3e-7).
    torch.testing.assert_close(r["xla_losses"], r["cpu_losses"], rtol=1e-4, atol=1e-5)
    _assert_same_weights(r["xla_weights"], r["cpu_weights"], rtol=1e-4, atol=1e-5)
    assert r["xla_losses"][-8:].mean() < 0.5 * r["xla_losses"][:4].mean()  # it learned
    # One process, one rank: it alone logs and writes the checkpoint, with host tensors.
    assert r["world_size"] == 1 and r["global_zero"]
    _assert_same_weights(r["checkpoint"], r["xla_weights"], rtol=0, atol=0)
    # One SPMD program for both devices; warm-up is over after the second epoch and its
    # validation (step 33); steps 34-47 (a validation at step 42) compile nothing new. (The
    # final step adds one graph: Lightning's end-of-fit bookkeeping.)
    counts = r["compilations"]
    assert len(counts) == 48 and counts[46] == counts[32], counts
    assert counts[-1] <= 8, counts


@pytest.mark.xla
def test_device_index_trains_on_that_device(xla_cpu_available: None, tmp_path: Path) -> None:
    r = _run_worker("index", 12, tmp_path)
    assert r["root_device"] == "xla:1"
    assert [b["runtime_device"] for b in r["batches"]] == ["CPU:1"] * 3  # the second PJRT CPU device
    assert all(b["sharding"] == "" for b in r["batches"])
    torch.testing.assert_close(r["xla_losses"], r["cpu_losses"], rtol=1e-4, atol=1e-5)
    _assert_same_weights(r["xla_weights"], r["cpu_weights"], rtol=1e-4, atol=1e-5)
    # That process has used an XLA device: SPMD can no longer start in it, and says so.
    assert r["refusal"].startswith("data parallel over 2 devices needs SPMD, which must start before the process uses an XLA device")
    assert r["refusal"].endswith("; run the multi-device fit in a fresh process")


@pytest.mark.xla
def test_index_beyond_the_runtime_names_the_variable(xla) -> None:
    import lightning.pytorch as pl

    with pytest.raises(ValueError, match=r"devices=\[1\] names indices outside 0..0 of the PJRT runtime.*CPU_NUM_DEVICES=2"):
        pl.Trainer(accelerator="xla_pjrt", strategy="xla_pjrt", devices=[1])
