"""Bad input: no torch_xla, a torch/torch_xla mismatch, no PJRT device - one line with the fix."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from lightning_accel.accelerators import runtime
from lightning_accel.accelerators.runtime import XLAUnavailableError, xla_problem

HAS_XLA = importlib.util.find_spec("torch_xla") is not None


def _versions(monkeypatch: pytest.MonkeyPatch, **installed: str | None) -> None:
    monkeypatch.setattr(runtime, "_installed", lambda dist: installed.get(dist))


@pytest.mark.skipif(HAS_XLA, reason="torch_xla is installed here; this checks the message where it is not")
def test_accelerator_without_torch_xla_names_the_package() -> None:
    import lightning.pytorch as pl

    from lightning_accel.accelerators import XLAPJRTAccelerator

    with pytest.raises(XLAUnavailableError, match=r"needs the package torch_xla, which is not installed; pip install \"lightning_accel\[xla\]\""):
        pl.Trainer(accelerator=XLAPJRTAccelerator(), logger=False)


def test_missing_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    _versions(monkeypatch, torch="2.9.0")
    assert xla_problem({"PJRT_DEVICE": "CPU"}) == (
        "accelerator 'xla_pjrt' needs the package torch_xla, which is not installed; "
        'pip install "lightning_accel[xla]" (or: pip install torch==2.9.0 torch_xla==2.9.0) in its own virtual environment'
    )


def test_version_mismatch_names_the_torch_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    _versions(monkeypatch, torch="2.13.0+cpu", torch_xla="2.9.0")
    problem = xla_problem({"PJRT_DEVICE": "CPU"})
    assert problem is not None
    assert problem.startswith("torch_xla 2.9.0 needs torch 2.9.*, but torch 2.13.0+cpu is installed; pip install torch==2.9.0")


def test_matching_local_build_suffix_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    _versions(monkeypatch, torch="2.9.0+cu128", torch_xla="2.9.0")
    assert xla_problem({"PJRT_DEVICE": "CPU"}) is None


def test_unset_pjrt_device_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    _versions(monkeypatch, torch="2.9.0", torch_xla="2.9.0")
    problem = xla_problem({})
    assert problem is not None and problem.startswith("PJRT_DEVICE is not set")
    assert "PJRT_DEVICE=TPU" in problem and "PJRT_DEVICE=CPU" in problem


def test_bad_cpu_device_count(monkeypatch: pytest.MonkeyPatch) -> None:
    _versions(monkeypatch, torch="2.9.0", torch_xla="2.9.0")
    assert "CPU_NUM_DEVICES='0' is not a positive integer" in str(xla_problem({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "0"}))


@pytest.mark.xla
@pytest.mark.skipif(not HAS_XLA, reason="torch_xla is not installed; the TPU probe is torch_xla's")
def test_tpu_that_is_not_there(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_xla._internal import tpu

    if tpu.num_available_chips() > 0:
        pytest.skip("this machine has a TPU")
    problem = xla_problem({"PJRT_DEVICE": "TPU"})
    assert problem is not None
    assert problem.startswith("PJRT_DEVICE=TPU but no TPU chip is attached to this machine") and "PJRT_DEVICE=CPU" in problem


@pytest.mark.xla
@pytest.mark.skipif(not HAS_XLA, reason="torch_xla is not installed")
@pytest.mark.parametrize("pjrt_device", ["TPU", None])
def test_trainer_with_missing_pjrt_device_fails_in_one_line(pjrt_device: str | None) -> None:
    """Through the Trainer, in a fresh process (a started PJRT runtime cannot be restarted)."""
    code = (
        "import lightning.pytorch as pl\n"
        "from lightning_accel.accelerators import register_accelerators\n"
        "register_accelerators()\n"
        "pl.Trainer(accelerator='xla_pjrt', logger=False)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    if pjrt_device:
        env["PJRT_DEVICE"] = pjrt_device
    # a generous limit: CI runs this lane at nice 19 beside the main one, which may hold both cores for minutes
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    expected = "PJRT_DEVICE=TPU but no TPU chip" if pjrt_device else "PJRT_DEVICE is not set"
    assert last.startswith(f"lightning_accel.accelerators.runtime.XLAUnavailableError: {expected}"), proc.stderr[-2000:]
