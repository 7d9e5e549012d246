"""Exact resume: a run SIGKILLed mid-epoch and resumed with ``ckpt_path=last`` ends with the
same weights and validation loss as the run that was never interrupted (bit-identical on
the CPU), for the plain, L2L-offload and GPipe recipes. The kill is real: the training
process sends itself SIGKILL after step 6, two steps past its step-4 checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

TESTS = Path(__file__).parent
# Tiny and short, dropout on (so the RNG has to continue too); checkpoints every 4 steps.
SMALL = ["trainer.max_steps=8", "trainer.val_check_interval=4", "trainer.limit_val_batches=2", "model.net.dropout=0.1",
         "data.block_size=32", "data.batch_size=4", "trainer.enable_progress_bar=false"]
KILL = ["+callbacks.kill._target_=kill_at_step.KillAtStep", "+callbacks.kill.step=6"]
CASES = {
    "plain": ("gpt-tiny_cpu", []),
    "l2l_offload": ("gpt-tiny_l2l_cpu", []),
    "gpipe": ("gpt-tiny_gpipe_cpu", []),
    # two DDP processes on the CPU: every rank kills itself after the same step; each rank's
    # shard continues where it stopped (the loader's own StatefulDistributedSampler)
    "ddp-2proc": ("gpt-tiny_cpu", ["strategy=ddp", "trainer.devices=2"]),
    # one pipeline over two processes: both stages read the same batches (dp=1 shard)
    "gpipe-2proc": ("gpt-tiny_gpipe-2proc_cpu", []),
}
# Ctrl-C at step 6: once (the step in flight is saved), twice (the second press exits at once)
CTRL_C = {"once": [*KILL, "+callbacks.kill.sig=SIGINT"], "twice": [*KILL, "+callbacks.kill.sig=SIGINT", "+callbacks.kill.times=2"]}

# SIGTERM at step 6 (what SLURM, Kubernetes and spot instances send): the step is saved, exit 143, and the resume ends as
# the uninterrupted run of the case named; under DDP only rank 1 is signalled (Kubernetes signals one process)
SIGTERM = {"sigterm": ("plain", [*KILL, "+callbacks.kill.sig=SIGTERM"]),
           "sigterm-ddp-rank1": ("ddp-2proc", [*KILL, "+callbacks.kill.sig=SIGTERM", "+callbacks.kill.rank=1"])}


def run_dirs(outputs: Path, recipe: str) -> list[Path]:
    return sorted(p.parent for p in (outputs / recipe).glob("*/run.json"))


def final_state(run_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    status = json.loads((run_dir / "run.json").read_text())
    assert status["status"] == "completed", status
    weights = torch.load(status["checkpoint"], map_location="cpu", weights_only=False)["state_dict"]
    return weights, status["metrics"]


@dataclass
class Case:
    """One recipe run three ways: uninterrupted (``reference``, outputs under ``ref``), SIGKILLed at step 6
    (``killed``) and resumed from its last checkpoint (``resumed``), those two under ``crashed``."""

    ref: Path
    crashed: Path
    reference: subprocess.CompletedProcess[str]
    killed: subprocess.CompletedProcess[str]
    resumed: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, make_cli_env: Callable[[Path], dict[str, str]],
         cli_processes: Any) -> tuple[dict[str, Case], dict[str, tuple[Path, subprocess.CompletedProcess[str]]], dict[str, Any]]:
    """Every run this file checks, side by side (:meth:`CliProcesses.side_by_side`): most of a short run is
    importing Lightning, on one core, and a launched DDP rank imports only after its rank 0 has; one case
    after another, the seven took 4 minutes with a core idle much of it. Killed runs go first, so that each
    resume can start as soon as its killed run ends. The 2-process cases' ranks find their own free ports
    (Lightning's launcher)."""
    root = tmp_path_factory.mktemp("resume")

    def env(outputs: Path) -> dict[str, str]:  # kill_at_step.KillAtStep importable by the CLI
        base = make_cli_env(outputs)
        return base | {"PYTHONPATH": os.pathsep.join([str(TESTS), base.get("PYTHONPATH", "")])}

    jobs = {}
    for case, (recipe, extra) in CASES.items():
        processes = 2 if case.endswith("2proc") else 1
        jobs[f"{case}/killed"] = cli_processes.job(["run", recipe, *SMALL, *extra, *KILL], env(root / case / "crashed"), processes)
        jobs[f"{case}/resumed"] = cli_processes.job(["run", recipe, *SMALL, *extra, "ckpt_path=last"], env(root / case / "crashed"),
                                                    processes, after=f"{case}/killed")
    for name, (case, more) in SIGTERM.items():
        recipe, extra = CASES[case]
        processes = 2 if case.endswith("2proc") else 1
        jobs[f"{name}/killed"] = cli_processes.job(["run", recipe, *SMALL, *extra, *more], env(root / name), processes)
        jobs[f"{name}/resumed"] = cli_processes.job(["run", recipe, *SMALL, *extra, "ckpt_path=last"], env(root / name), processes,
                                                    after=f"{name}/killed")
    for name, more in CTRL_C.items():
        jobs[f"ctrl-c/{name}"] = cli_processes.job(["run", "gpt-tiny_cpu", *SMALL, *more], env(root / f"ctrl-c-{name}"))
    for case, (recipe, extra) in CASES.items():
        jobs[f"{case}/reference"] = cli_processes.job(["run", recipe, *SMALL, *extra], env(root / case / "ref"),
                                                      2 if case.endswith("2proc") else 1)
    done = cli_processes.side_by_side(jobs)
    cases = {case: Case(root / case / "ref", root / case / "crashed", done[f"{case}/reference"], done[f"{case}/killed"],
                        done[f"{case}/resumed"]) for case in CASES}
    signalled = {name: (root / name, done[f"{name}/killed"], done[f"{name}/resumed"]) for name in SIGTERM}
    return cases, {name: (root / f"ctrl-c-{name}", done[f"ctrl-c/{name}"]) for name in CTRL_C}, signalled


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_killed_mid_epoch_and_resumed_equals_uninterrupted(case: str, runs: Any) -> None:
    recipe = CASES[case][0]
    run = runs[0][case]
    assert run.reference.returncode == 0, run.reference.stderr[-3000:]
    assert run.killed.returncode == -9, run.killed.stderr[-3000:]
    resumed = run.resumed
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "not resumable" not in resumed.stderr
    killed_dir, resumed_dir = run_dirs(run.crashed, recipe)  # named by their start, to the second
    assert sorted(p.name for p in (killed_dir / "checkpoints").glob("*.ckpt")) == ["last.ckpt", "step000004.ckpt"]
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

    want_weights, want_metrics = final_state(run_dirs(run.ref, recipe)[0])
    got_weights, got_metrics = final_state(resumed_dir)
    assert got_weights.keys() == want_weights.keys()
    for name, tensor in want_weights.items():
        assert torch.equal(got_weights[name], tensor), name
    assert got_metrics == want_metrics


def _global_step(ckpt: Path) -> int:
    return int(torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"])


@pytest.mark.slow
def test_ctrl_c_saves_the_step_in_flight_and_records_interrupted(runs: Any) -> None:
    outputs, proc = runs[1]["once"]
    assert proc.returncode == 130, proc.stderr[-3000:]
    (run,) = run_dirs(outputs, "gpt-tiny_cpu")
    status = json.loads((run / "run.json").read_text())
    assert status["status"] == "interrupted" and status["global_step"] == 6, status
    assert status["checkpoint"] == str(run / "checkpoints" / "last.ckpt")
    assert _global_step(run / "checkpoints" / "last.ckpt") == 6  # the step in flight, not step 4's checkpoint
    assert "interrupted (Ctrl-C) after 6 steps" in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once(runs: Any) -> None:
    outputs, proc = runs[1]["twice"]
    assert proc.returncode == 130, proc.stderr[-3000:]
    (run,) = run_dirs(outputs, "gpt-tiny_cpu")
    status = json.loads((run / "run.json").read_text())
    assert status["status"] == "interrupted" and "second Ctrl-C" in status["error"], status
    assert _global_step(run / "checkpoints" / "last.ckpt") == 4  # nothing saved after the second press


def _processes_naming(text: str) -> list[int]:
    """Processes whose command line holds ``text`` (a launched rank's names its run directory)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SIGTERM))
def test_sigterm_saves_the_step_exits_143_and_the_resume_equals_uninterrupted(name: str, runs: Any) -> None:
    case = SIGTERM[name][0]
    recipe = CASES[case][0]
    outputs, killed, resumed = runs[2][name]
    assert killed.returncode == 143, killed.stderr[-3000:]
    assert "SIGTERM: stopping after the step in flight" in killed.stderr and "Traceback" not in killed.stderr
    interrupted, resumed_dir = run_dirs(outputs, recipe)
    status = json.loads((interrupted / "run.json").read_text())
    assert status["status"] == "interrupted" and status["signal"] == "SIGTERM" and status["global_step"] == 6, status
    assert _global_step(interrupted / "checkpoints" / "last.ckpt") == 6
    assert not list(interrupted.glob("checkpoints/.*.tmp"))
    assert not _processes_naming(str(interrupted)), "a rank of the interrupted run is still running"
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {interrupted / 'checkpoints' / 'last.ckpt'}" in resumed.stderr + resumed.stdout
    want_weights, want_metrics = final_state(run_dirs(runs[0][case].ref, recipe)[0])
    got_weights, got_metrics = final_state(resumed_dir)
    for key, tensor in want_weights.items():
        assert torch.equal(got_weights[key], tensor), key
    assert got_metrics == want_metrics
