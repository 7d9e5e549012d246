"""The `lightning-accel` command end to end, in subprocesses like a user would run it."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_accel import cli
PYTHON = sys.executable


def _run(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "lightning_accel", *args], env=env, capture_output=True, text=True, timeout=timeout)


def _train_losses(metrics_csv: Path) -> list[float]:
    with metrics_csv.open() as f:
        return [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]


def test_no_arguments_runs_the_default_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    monkeypatch.setattr(cli, "cmd_run", lambda recipe, args: seen.setdefault("run", (recipe, list(args))) and 0)
    assert cli.main([]) == 0
    assert seen["run"] == (cli.DEFAULT_RECIPE, [])


@pytest.mark.slow
def test_run_trains_and_reports(cli_env: dict[str, str], tmp_path: Path) -> None:
    proc = _run(["run", "gpt-tiny_cpu", "trainer.max_steps=40", "trainer.val_check_interval=20",
                 "trainer.limit_val_batches=4", "trainer.log_every_n_steps=5", "trainer.enable_progress_bar=false"], cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "outputs" / "gpt-tiny_cpu").iterdir())
    assert len(runs) == 1
    status = json.loads((runs[0] / "run.json").read_text())
    assert status["status"] == "completed" and status["global_step"] == 40
    assert Path(status["checkpoint"]).is_file() and status["checkpoint"].endswith("last.ckpt")
    losses = _train_losses(Path(status["metrics_csv"]))
    assert len(losses) >= 6 and losses[-1] < losses[0] - 0.5, losses
    # the summary says where things went and the final validation loss and perplexity
    assert f"checkpoint: {status['checkpoint']}" in proc.stdout
    assert "val/loss=" in proc.stdout and "val/ppl=" in proc.stdout
    assert status["metrics"]["val/ppl"] == pytest.approx(2.718281828 ** status["metrics"]["val/loss"], rel=1e-3)


@pytest.mark.slow
def test_multirun_sweeps(cli_env: dict[str, str], tmp_path: Path) -> None:
    proc = _run(["run", "resnet-tiny_cpu", "-m", "model.optimizer.lr=1e-3,3e-3", "trainer.max_steps=4",
                 "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "data.train_samples=256",
                 "data.val_samples=64", "trainer.enable_progress_bar=false"], cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted((tmp_path / "outputs" / "resnet-tiny_cpu").glob("multirun_*/*/run.json"))
    assert [json.loads(j.read_text())["status"] for j in jobs] == ["completed", "completed"]


@pytest.mark.slow
def test_ddp_two_cpu_processes_from_the_cli(cli_env: dict[str, str], tmp_path: Path) -> None:
    # Lightning re-launches rank 1 with the overrides only; the recipe reaches it by env.
    proc = _run(["run", "resnet-tiny_cpu", "strategy=ddp_fp16", "trainer.devices=2", "trainer.max_steps=4",
                 "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "data.train_samples=256",
                 "trainer.enable_progress_bar=false"], cli_env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_json,) = (tmp_path / "outputs" / "resnet-tiny_cpu").glob("*/run.json")
    assert json.loads(run_json.read_text())["global_step"] == 4


BAD_INPUT = [
    (["run", "gpt-tny_cpu"], r"unknown recipe 'gpt-tny_cpu' \(did you mean 'gpt-tiny_cpu'"),
    (["run", "gpt-tiny_cpu", "model=gtp"], r"unknown model option 'gtp' \(did you mean 'gpt'\?\)"),
    (["run", "gpt-tiny_cpu", "trainer.max_stepz=3"], r"unknown key 'trainer.max_stepz'"),
    (["run", "gpt-tiny_cpu", "trainer.max_steps=abc"], r"trainer.max_steps: Value 'abc'.*pass a whole number"),
    (["run", "gpt-tiny_cpu", "data=text_file", "data.path=/no/such/file.txt"], r"/no/such/file.txt"),
    (["run", "gpt-tiny_cpu", "data=text_file"], r"data.path is required"),
    (["run", "gpt-small_bf16-accum_1gpu"], r"needs 1 CUDA GPU\(s\)"),
    (["validate", "gpt-tiny_cpu", "trainer.precision=bf16-mixd"], r"did you mean 'bf16-mixed'"),
    (["bench", "offlaod"], r"unknown benchmark 'offlaod'"),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_leaves_no_run(args: list[str], message: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    import re

    if "gpu" in args[1] and __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = _run(args, cli_env, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightning-accel: error: "), proc.stderr
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "outputs").exists()  # no run directory was made


@pytest.mark.slow
def test_failure_inside_a_run_is_marked_failed(cli_env: dict[str, str], tmp_path: Path) -> None:
    # The model's context (16) is shorter than the data's windows (128): GPT raises mid-run.
    proc = _run(["run", "gpt-tiny_cpu", "model.net.block_size=16", "trainer.max_steps=3"], cli_env)
    assert proc.returncode != 0
    (run,) = (tmp_path / "outputs" / "gpt-tiny_cpu").iterdir()
    status = json.loads((run / "run.json").read_text())
    assert status["status"] == "failed" and "block_size" in status["error"]
    assert not list(run.glob("checkpoints/*.ckpt"))


def test_ls_lists_every_recipe_with_columns(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_accel.config.compose import recipe_names

    assert cli.main(["ls"]) == 0
    import re

    out = capsys.readouterr().out.splitlines()
    assert re.split(r"\s{2,}", out[0])[:4] == ["recipe", "model", "accelerator", "techniques"]
    rows = {line.split()[0]: re.split(r"\s{2,}", line) for line in out[1:]}
    assert set(rows) == set(recipe_names())
    # the size is counted on the meta device: 10,844,160 parameters for GPT small at vocab 256
    assert rows["gpt-small_bf16-accum_1gpu"][1:4] == ["gpt:small (10.8M)", "gpux1", "bf16-mixed,grad-accumulation"]


def test_cp_copies_a_runnable_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_accel.config.compose import compose_recipe

    dest = tmp_path / "mine.yaml"
    assert cli.main(["cp", "gpt-tiny_cpu", str(dest)]) == 0
    assert compose_recipe(str(dest)).model.net.preset == "tiny"
    assert cli.main(["cp", "gpt-tiny_cpu", str(dest)]) == 2  # never overwrites
    assert "already exists" in capsys.readouterr().err


def test_validate_all(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_accel.config.compose import recipe_names

    assert cli.main(["validate", "--all"]) == 0
    assert capsys.readouterr().out.count("ok  ") == len(recipe_names())
