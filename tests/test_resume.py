"""Exact resume: a run SIGKILLed mid-epoch and resumed with ``ckpt_path=last`` ends with the
same weights and validation loss as the run that was never interrupted (bit-identical on
the CPU), for the plain, L2L-offload and GPipe recipes. The kill is real: the training
process sends itself SIGKILL after step 6, two steps past its step-4 checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
# Tiny and short, dropout on (so the RNG has to continue too); checkpoints every 4 steps.
SMALL = ["trainer.max_steps=8", "trainer.val_check_interval=4", "trainer.limit_val_batches=2", "model.net.dropout=0.1",
         "data.block_size=32", "data.batch_size=4", "trainer.enable_progress_bar=false"]


def cli_env_for(env: dict[str, str], outputs: Path) -> dict[str, str]:
    return env | {"LIGHTNING_ACCEL_OUTPUTS": str(outputs), "PYTHONPATH": os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])}


def run_cli(args: list[str], env: dict[str, str], outputs: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lightning_accel", *args], env=cli_env_for(env, outputs), capture_output=True,
                          text=True, timeout=300)


def run_dirs(outputs: Path, recipe: str) -> list[Path]:
    return sorted(p.parent for p in (outputs / recipe).glob("*/run.json"))


def final_state(run_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    status = json.loads((run_dir / "run.json").read_text())
    assert status["status"] == "completed", status
    weights = torch.load(status["checkpoint"], map_location="cpu", weights_only=False)["state_dict"]
    return weights, status["metrics"]


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "extra"), [
    ("gpt-tiny_cpu", []),
    ("gpt-tiny_l2l_cpu", []),
    ("gpt-tiny_gpipe_cpu", []),
    # two DDP processes on the CPU: every rank kills itself after the same step; each rank's
    # shard continues where it stopped (the loader's own StatefulDistributedSampler)
    ("gpt-tiny_cpu", ["strategy=ddp", "trainer.devices=2"]),
    # one pipeline over two processes: both stages read the same batches (dp=1 shard)
    ("gpt-tiny_gpipe-2proc_cpu", []),
], ids=["plain", "l2l_offload", "gpipe", "ddp-2proc", "gpipe-2proc"])
def test_killed_mid_epoch_and_resumed_equals_uninterrupted(recipe: str, extra: list[str], cli_env: dict[str, str], tmp_path: Path,
                                                            cli_processes) -> None:
    args = [*SMALL, *extra]
    # the uninterrupted run and the one that is killed side by side: most of each is importing Lightning,
    # one core each (the 2-process cases start two ranks each: Lightning picks each job's free port)
    crashed = tmp_path / "crashed"
    reference = cli_processes.start(["run", recipe, *args], cli_env_for(cli_env, tmp_path / "ref"))
    killed = run_cli(["run", recipe, *args, "+callbacks.kill._target_=kill_at_step.KillAtStep", "+callbacks.kill.step=6"], cli_env, crashed)
    reference = cli_processes.finish(reference, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert killed.returncode == -9, killed.stderr[-3000:]
    (killed_dir,) = run_dirs(crashed, recipe)
    assert sorted(p.name for p in (killed_dir / "checkpoints").glob("*.ckpt")) == ["last.ckpt", "step000004.ckpt"]

    resumed = run_cli(["run", recipe, *args, "ckpt_path=last"], cli_env, crashed)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "not resumable" not in resumed.stderr
    resumed_dir = next(d for d in run_dirs(crashed, recipe) if d != killed_dir)
    # output a person can trust: the log file holds the run, plans once, no tips or known warnings
    log = (resumed_dir / "lightning-accel.log").read_text()
    assert "resuming from" in log and f"{recipe} finished 8 steps" in log
    for plan in ("GPipeStrategy:", "L2LOffloadStrategy:"):
        assert resumed.stderr.count(plan) <= 1, resumed.stderr
    assert "Tip:" not in resumed.stderr and "LeafSpec" not in resumed.stderr and "set_vital" not in resumed.stderr

    # the next run of the recipe found the killed one: marked, nothing half-written left
    killed_status = json.loads((killed_dir / "run.json").read_text())
    assert killed_status["status"] == "killed", killed_status
    assert not list(killed_dir.glob("checkpoints/.*.tmp"))

    want_weights, want_metrics = final_state(run_dirs(tmp_path / "ref", recipe)[0])
    got_weights, got_metrics = final_state(resumed_dir)
    assert got_weights.keys() == want_weights.keys()
    for name, tensor in want_weights.items():
        assert torch.equal(got_weights[name], tensor), name
    assert got_metrics == want_metrics


def _global_step(ckpt: Path) -> int:
    return int(torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"])


@pytest.mark.slow
def test_ctrl_c_saves_the_step_in_flight_and_records_interrupted(cli_env: dict[str, str], tmp_path: Path) -> None:
    proc = run_cli(["run", "gpt-tiny_cpu", *SMALL, "+callbacks.kill._target_=kill_at_step.KillAtStep", "+callbacks.kill.step=6",
                    "+callbacks.kill.sig=SIGINT"], cli_env, tmp_path)
    assert proc.returncode == 130, proc.stderr[-3000:]
    (run,) = run_dirs(tmp_path, "gpt-tiny_cpu")
    status = json.loads((run / "run.json").read_text())
    assert status["status"] == "interrupted" and status["global_step"] == 6, status
    assert status["checkpoint"] == str(run / "checkpoints" / "last.ckpt")
    assert _global_step(run / "checkpoints" / "last.ckpt") == 6  # the step in flight, not step 4's checkpoint
    assert "interrupted (Ctrl-C) after 6 steps" in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once(cli_env: dict[str, str], tmp_path: Path) -> None:
    proc = run_cli(["run", "gpt-tiny_cpu", *SMALL, "+callbacks.kill._target_=kill_at_step.KillAtStep", "+callbacks.kill.step=6",
                    "+callbacks.kill.sig=SIGINT", "+callbacks.kill.times=2"], cli_env, tmp_path)
    assert proc.returncode == 130, proc.stderr[-3000:]
    (run,) = run_dirs(tmp_path, "gpt-tiny_cpu")
    status = json.loads((run / "run.json").read_text())
    assert status["status"] == "interrupted" and "second Ctrl-C" in status["error"], status
    assert _global_step(run / "checkpoints" / "last.ckpt") == 4  # nothing saved after the second press
