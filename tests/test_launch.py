"""Cluster launch: the SLURM launcher config composes and submits what we expect.

No cluster is needed: the real Hydra submitit launcher builds the real submitit
executor, and only the final ``sbatch`` call is replaced by capturing the script.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate

from lightning_accel.config.compose import compose_recipe
from lightning_accel.config.errors import UserError
from lightning_accel.sweep import check_sweep

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the slurm extra (hydra-submitit-launcher)")


class _Captured(Exception):
    pass


def _sbatch_script(monkeypatch: pytest.MonkeyPatch, recipe: str, overrides: list[str]) -> str:
    from submitit.slurm.slurm import SlurmExecutor

    scripts: list[str] = []

    def capture(self: SlurmExecutor, command: str) -> None:
        scripts.append(self._make_submission_file_text(command, "uid"))
        raise _Captured

    monkeypatch.setattr(SlurmExecutor, "_submit_command", capture)
    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # "srun is on PATH"
    cfg = compose_recipe(recipe, ["launcher=slurm", *overrides], with_hydra=True)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=None, config=cfg)
    with pytest.raises(_Captured):
        launcher.launch([["trainer.max_steps=10"]], initial_job_idx=0)
    return scripts[0]


def test_slurm_launcher_sizes_the_allocation_from_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose_recipe("gpt-small_ddp_4gpu", ["launcher=slurm", "trainer.num_nodes=2"], with_hydra=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, 4)
    assert launcher.submitit_folder.startswith(str(cfg.hydra.sweep.dir))

    script = _sbatch_script(
        monkeypatch,
        "gpt-small_ddp_4gpu",
        ["trainer.num_nodes=2", "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=90"],
    )
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=90",
        "#SBATCH --job-name=gpt-small_ddp_4gpu",
        "#SBATCH --signal=USR2@120",
    ]:
        assert line in script.splitlines(), f"{line!r} not in:\n{script}"
    assert "srun" in script and "submitit.core._submit" in script


def test_slurm_launch_is_remote_so_a_gpu_recipe_submits_from_a_cpu_node() -> None:
    assert check_sweep("gpt-small_ddp_4gpu", ["-m", "launcher=slurm"]) is True
    assert check_sweep("gpt-small_ddp_4gpu", ["-m", "launcher=local"]) is False
    assert check_sweep("gpt-tiny_cpu", ["trainer.max_steps=3"]) is False


def test_slurm_launch_needs_a_device_count() -> None:
    # accelerator=gpus means "every GPU of the node" (devices=-1): SLURM needs a number.
    with pytest.raises(UserError, match=r"trainer.devices=-1 cannot size a SLURM allocation.*trainer.devices=4"):
        check_sweep("gpt-tiny_cpu", ["-m", "launcher=slurm", "accelerator=gpus"])


@pytest.mark.slow
def test_submitit_local_runs_a_job_in_its_own_process(cli_env: dict[str, str]) -> None:
    cmd = [
        sys.executable, "-m", "lightning_accel", "run", "gpt-tiny_cpu", "-m", "launcher=submitit_local",
        "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "data.max_bytes=200000",
    ]
    done = subprocess.run(cmd, env=cli_env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_json,) = Path(cli_env["LIGHTNING_ACCEL_OUTPUTS"]).glob("gpt-tiny_cpu/multirun_*/0/run.json")
    status = json.loads(run_json.read_text())
    assert status["status"] == "completed" and status["global_step"] == 2
    assert list(run_json.parent.parent.glob(".submitit/*/*_result.pkl")), "submitit did not run the job"
