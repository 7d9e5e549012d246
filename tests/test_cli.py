"""The `lightning-accel` command end to end, in subprocesses like a user would run it."""

from __future__ import annotations

import csv
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from lightning_accel import cli
from tests.support.warm_python import python as warm_python


def _run(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([warm_python(), "-m", "lightning_accel", *args], env=env, capture_output=True, text=True, timeout=timeout)


def _train_losses(metrics_csv: Path) -> list[float]:
    with metrics_csv.open() as f:
        return [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]


def test_no_arguments_runs_the_default_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    monkeypatch.setattr(cli, "cmd_run", lambda recipe, args: seen.setdefault("run", (recipe, list(args))) and 0)
    assert cli.main([]) == 0
    assert seen["run"] == (cli.DEFAULT_RECIPE, [])


# the CLI runs this module's tests check, run side by side by the cli_runs fixture: test name -> (args, processes)
CLI_RUNS: dict[str, tuple[list[str], int]] = {
    "test_run_trains_and_reports": (["run", "gpt-tiny_cpu", "trainer.max_steps=40", "trainer.val_check_interval=20",
                                     "trainer.limit_val_batches=4", "trainer.log_every_n_steps=5", "trainer.enable_progress_bar=false"], 1),
    # -m before the recipe, as Hydra users write it (test_multirun_flag_before_or_after_the_recipe: both places)
    "test_multirun_sweeps": (["run", "-m", "resnet-tiny_cpu", "model.optimizer.lr=1e-3,3e-3", "trainer.max_steps=4",
                              "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "data.train_samples=256",
                              "data.val_samples=64", "trainer.enable_progress_bar=false"], 1),
    # Lightning re-launches rank 1 with the overrides only; the recipe reaches it by env.
    "test_ddp_two_cpu_processes_from_the_cli": (["run", "resnet-tiny_cpu", "strategy=ddp_fp16", "trainer.devices=2", "trainer.max_steps=4",
                                                 "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "data.train_samples=256",
                                                 "trainer.enable_progress_bar=false"], 2),
}


@pytest.fixture(scope="module")
def cli_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, make_cli_env: Any,
             cli_processes: Any) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """The CLI_RUNS of the tests this session collected, side by side (:meth:`CliProcesses.side_by_side`; one after
    another, the three took CI 37 s, mostly importing on one core): test name -> (its outputs directory, the run)."""
    names = {getattr(i, "originalname", None) for i in request.session.items if getattr(i, "module", None) is request.module}
    root = tmp_path_factory.mktemp("cli_runs")
    jobs = {name: cli_processes.job(args, make_cli_env(root / name / "outputs"), processes)
            for name, (args, processes) in CLI_RUNS.items() if name in names}
    done = cli_processes.side_by_side(jobs)
    return {name: (root / name / "outputs", proc) for name, proc in done.items()}


@pytest.mark.slow
def test_run_trains_and_reports(cli_runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]]) -> None:
    outputs, proc = cli_runs["test_run_trains_and_reports"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((outputs / "gpt-tiny_cpu").iterdir())
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
def test_the_nvme_recipe_trains_past_its_host_budget(cli_env: dict[str, str], tmp_path: Path) -> None:
    """gpt-tiny_l2l-nvme_cpu as shipped (14 MB budget, 26.8 MB of host state in memory), shortened (the resident unit's
    position embedding for 32 tokens: 13.36 MB kept, where the recipe's 128 keep 13.56): its blocks' state and
    masters go to files under outputs/, the run and its checkpoint complete, and the scratch directory goes with it."""
    proc = _run(["run", "gpt-tiny_l2l-nvme_cpu", "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.limit_val_batches=2",
                 "trainer.log_every_n_steps=2", "trainer.enable_progress_bar=false", "data.block_size=32"], cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "outputs" / "gpt-tiny_l2l-nvme_cpu").iterdir()
    status = json.loads((run / "run.json").read_text())
    assert status["status"] == "completed" and status["global_step"] == 6 and Path(status["checkpoint"]).is_file()
    said = proc.stdout + proc.stderr
    assert "NVMe tier: host 13.36 MB" in said and "optimizer state of 8/8 units, fp32 masters of 7/8" in said, said[-3000:]
    assert " GiB on disk (" in said  # the offload's closing line counts what crossed the disk
    assert not [p for p in run.rglob("lightning-accel-tier-*")]  # the scratch directory went with the fit


@pytest.mark.parametrize("args", [
    ["run", "-m", "gpt-tiny_cpu", "trainer.max_steps=1,2"],
    ["run", "--multirun", "gpt-tiny_cpu", "trainer.max_steps=1,2"],
    ["run", "gpt-tiny_cpu", "-m", "trainer.max_steps=1,2"],
    ["run", "gpt-tiny_cpu", "trainer.max_steps=1,2", "--multirun"],
], ids=lambda a: " ".join(a))
def test_multirun_flag_before_or_after_the_recipe(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Hydra users write ``-m`` before the config's name too: the recipe and the flag reach Hydra either way
    (before, ``run -m RECIPE`` ended in "unrecognized arguments: -m")."""
    seen = {}
    monkeypatch.setattr(cli, "cmd_run", lambda recipe, args: seen.setdefault("run", (recipe, list(args))) and 0)
    assert cli.main(args) == 0
    recipe, overrides = seen["run"]
    assert recipe == "gpt-tiny_cpu"
    assert sorted(overrides) == sorted(a for a in args[1:] if a != recipe)


@pytest.mark.slow
def test_multirun_sweeps(cli_runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]]) -> None:
    outputs, proc = cli_runs["test_multirun_sweeps"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted((outputs / "resnet-tiny_cpu").glob("multirun_*/*/run.json"))
    assert [json.loads(j.read_text())["status"] for j in jobs] == ["completed", "completed"]


@pytest.mark.slow
def test_ddp_two_cpu_processes_from_the_cli(cli_runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]]) -> None:
    outputs, proc = cli_runs["test_ddp_two_cpu_processes_from_the_cli"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_json,) = (outputs / "resnet-tiny_cpu").glob("*/run.json")
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
def test_bad_input_is_one_line_and_leaves_no_run(args: list[str], message: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """In process: an interpreter start per case cost ~10 s of importing Lightning; the real process's stderr and
    exit status are checked once, below."""
    if "gpu" in args[1] and __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv("LIGHTNING_ACCEL_OUTPUTS", str(tmp_path / "outputs"))
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightning-accel: error: "), captured.err
    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "outputs").exists()  # no run directory was made


@pytest.mark.slow
def test_bad_input_in_a_real_process_is_one_line_on_stderr_and_exit_2(cli_env: dict[str, str], tmp_path: Path) -> None:
    proc = _run(["run", "gpt-tiny_cpu", "model=gtp"], cli_env, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightning-accel: error: unknown model option 'gtp'"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_failure_inside_a_run_is_marked_failed(cli_env: dict[str, str], tmp_path: Path) -> None:
    # a network whose forward raises at the first step: nothing before work can see it
    proc = _run(["run", "gpt-tiny_cpu", "model.net._target_=tests.support.failing_nets.GPTFailingInForward", "trainer.max_steps=3",
                 "keep_failed=true"], cli_env | {"PYTHONPATH": str(Path(__file__).parent.parent)})
    assert proc.returncode == 1
    (run,) = (tmp_path / "outputs" / "gpt-tiny_cpu").iterdir()
    status = json.loads((run / "run.json").read_text())
    assert status["status"] == "failed" and "GPTFailingInForward" in status["error"]
    assert not list(run.glob("checkpoints/*.ckpt"))


def test_ls_lists_every_recipe_with_columns(ls_output: tuple[int, str]) -> None:
    from lightning_accel.config.compose import recipe_names

    status, printed = ls_output
    assert status == 0
    import re

    out = printed.splitlines()
    assert re.split(r"\s{2,}", out[0])[:4] == ["recipe", "model", "accelerator", "techniques"]
    rows = {line.split()[0]: re.split(r"\s{2,}", line) for line in out[1:]}
    assert set(rows) == set(recipe_names())
    # the size is counted on the meta device: 10,844,160 parameters for GPT small at vocab 256
    assert rows["gpt-small_bf16-accum_1gpu"][1:4] == ["gpt:small (10.8M)", "gpux1", "bf16-mixed,grad-accumulation"]
    # a one-process pipeline over two GPUs needs two, though the Trainer sees one root device
    assert rows["resnet-tiny_gpipe-bn_2gpu"][2] == "gpux2"
    assert rows["gpt-tiny_sweep_cpu"][-1].endswith("[sweep extra]")


def test_cp_copies_a_runnable_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_accel.config.compose import compose_recipe

    dest = tmp_path / "mine.yaml"
    assert cli.main(["cp", "gpt-tiny_cpu", str(dest)]) == 0
    assert compose_recipe(str(dest)).model.net.preset == "tiny"
    assert cli.main(["cp", "gpt-tiny_cpu", str(dest)]) == 2  # never overwrites
    assert "already exists" in capsys.readouterr().err


def test_validate_all_applies_the_overrides_to_every_recipe(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``validate --all OVERRIDES``: each recipe checked with them, a recipe they break reported on its own line,
    the others still checked, exit status 2 (before: "validate takes one recipe or --all")."""
    import lightning_accel.config.compose as compose

    # three recipes keep it cheap; batch_size=1 cannot feed the 2-process pipeline's 1F1B (2 stages need 2 micro-batches)
    monkeypatch.setattr(compose, "recipe_names", lambda: ["gpt-tiny_cpu", "gpt-tiny_gpipe-2proc_cpu", "resnet-tiny_cpu"])
    assert cli.main(["validate", "--all", "data.batch_size=1", "trainer.max_steps=3"]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ok  gpt-tiny_cpu" and out[2] == "ok  resnet-tiny_cpu"
    assert out[1].startswith("FAIL  gpt-tiny_gpipe-2proc_cpu  data.batch_size=1: ") and "cannot be split into equal micro-batches" in out[1]
    assert cli.main(["validate", "--all", "data.batch_size=8"]) == 0
    assert capsys.readouterr().out.count("ok  ") == 3
    # a recipe name beside --all is neither: refused, with the usage
    assert cli.main(["validate", "--all", "gpt-tiny_cpu"]) == 2
    assert "validate takes one recipe or --all, then overrides" in capsys.readouterr().err


def test_validate_warns_when_the_estimate_exceeds_the_stated_device(capsys: pytest.CaptureFixture[str]) -> None:
    """A recipe whose purpose states its device: one warning line when the estimated peak is larger
    (gpt-small_bf16-accum_1gpu at batch 64 peaks at 1.65 GB), none when it fits; validation still passes."""
    small = ["data.batch_size=64"]
    assert cli.main(["validate", "gpt-small_bf16-accum_1gpu", "recipe.purpose='GPT small on one 1 GB GPU'", *small]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"warn  gpt-small_bf16-accum_1gpu  estimated device peak 1\.\d\d GB exceeds the 1\.00 GB device "
                        r"the recipe states; HINT: lightning-accel estimate gpt-small_bf16-accum_1gpu shows where it goes", out[0])
    assert out[1:] == ["ok  gpt-small_bf16-accum_1gpu"]
    assert cli.main(["validate", "gpt-small_bf16-accum_1gpu", "recipe.purpose='GPT small on one 2 GB GPU'", *small]) == 0
    assert capsys.readouterr().out.splitlines() == ["ok  gpt-small_bf16-accum_1gpu"]


# Bad input caught by preflight, in process (no interpreter start-up per case): run and
# validate alike end in one line and exit status 2, and no run directory is made.
PREFLIGHT_BAD = [
    (["strategy=gpipe", "strategy.chunks=0"], r"strategy.chunks=0: chunks must be a positive int"),
    (["strategy=gpipe", "strategy.checkpoint=sometimes"], r"checkpoint must be one of always, except_last, never"),
    (["strategy=gpipe_distributed", "strategy.schedule=zigzag"], r"schedule must be one of"),
    (["strategy=gpipe_distributed", "trainer.devices=2", "data.batch_size=1"], r"data.batch_size=1: .*chunks=4, schedule='1f1b'.* cannot be split"),
    (["strategy=gpipe", "strategy.devices=[cpu,cpu]", "strategy.balance=[3,3]"], r"does not cover the model's blocks \(blocks: 4"),
    (["strategy=l2l_offload", "strategy.prefetch_blocks=-1"], r"prefetch_blocks must be >= 0, got -1"),
    (["trainer.max_steps=-5"], r"trainer.max_steps=-5 is not allowed; pass a number of optimizer steps >= 1, or -1"),
    # torch's own check, under every strategy
    (["model.optimizer.lr=-1"], r"model.optimizer.lr=-1: AdamW refuses it \(Invalid learning rate: -1, when built\); pass a value"),
    (["trainer.accumulate_grad_batches=0"], r"trainer.accumulate_grad_batches=0 is not allowed; pass a number of batches >= 1"),
    # what a fit needs of the strategy, asked as its set-up asks (DDPWithoutWrapper.check_fit, check_delayed_update)
    (["strategy=gpipe_distributed", "trainer.devices=2", "trainer.sync_batchnorm=true"],
     r"trainer.sync_batchnorm=true: DistributedGPipeStrategy does not convert BatchNorm layers"),
    (["strategy=l2l_offload", "strategy.delayed_update=true", "precision=offload-16-mixed"],
     r"strategy.delayed_update=true: .*cannot run with fp16 loss scaling"),
    (["model.net.preset=huge"], r"model.net.preset=huge: unknown GPT preset 'huge'"),
    (["callbacks=prefetch", "callbacks.prefetch_tuner.max_workers=0"], r"callbacks.prefetch_tuner.max_workers=0: max_workers=0 must be a positive integer"),
    (["data=null"], r"data=null removes the data config"),
    (["ckpt_path=last"], r"ckpt_path=last but no earlier run of this recipe"),
    # a strategy's set-up checks, asked by preflight with the strategy's own functions (config/setup_checks.py)
    (["strategy=l2l_offload", "strategy.blocks=[GPTBlok]"], r"strategy.blocks=\['GPTBlok'\]: block class 'GPTBlok' is not used in .*name one of them"),
    (["strategy=gpipe", "strategy.blocks=[GPTBlock,Attention]"], r"block class 'Attention' is not used in GPT"),
    (["strategy=gpipe", "strategy.chunks=6", "data.batch_size=4"], r"data.batch_size=4: chunks=6 is greater than the batch size 4"),
    (["strategy=l2l_offload", "model.optimizer._target_=torch.optim.LBFGS", "~model.optimizer.betas",
      "~model.optimizer.weight_decay"], r"strategy=l2l_offload: .*cannot run LBFGS on the host.*; use a per-parameter optimizer"),
    (["strategy=l2l_offload", "strategy.delayed_update=true", "model.optimizer._target_=torch.optim.ASGD",
      "~model.optimizer.betas"], r"delayed_update=True\) .* not ASGD"),
    (["strategy=gpipe_distributed", "strategy.balance=[2,2]", "trainer.devices=3"],
     r"trainer.devices=3: .*world size 3 is not a multiple of pipeline_parallel_size=2 \(ranks per pipeline, from len\(balance\)=2\)"),
    (["strategy=gpipe_distributed", "+strategy.pipeline_parallel_size=4", "trainer.devices=2", "trainer.num_nodes=3"],
     r"trainer.devices=2 x num_nodes=3: .*world size 6 is not a multiple of pipeline_parallel_size=4"),
    # a sweeper's search space, written the way Hydra users often write it
    (["hparams_search=optuna_lr_batch", "+hydra.sweeper.params.model.optimizer.lrr=interval(1e-4,1e-2)"],
     r"search space key 'model.optimizer.lrr' does not exist.*did you mean 'model.optimizer.lr'"),
    (["hparams_search=optuna_lr_batch", "+hydra.sweeper.params.data.batch_size=choice(4,8)"],
     r"'\+hydra.sweeper.params.data.batch_size' sweeps Hydra's own config.*write data.batch_size=choice\(4,8\)"),
    (["hparams_search=optuna_lr_batch", "+model.optimizer.lrr=interval(1e-4,1e-2)"],
     r"search space key '\+model.optimizer.lrr': model.optimizer.lrr is not an argument of torch.optim.AdamW \(did you mean 'lr'"),
    (["hparams_search=optuna_lr_batch", "~model.optimizer.betass=1,2"], r"search space key '~model.optimizer.betass' does not exist .*remove the ~ entry"),
]


@pytest.mark.parametrize("command", ["run", "validate"])
@pytest.mark.parametrize(("overrides", "message"), PREFLIGHT_BAD, ids=[" ".join(o) for o, _ in PREFLIGHT_BAD])
def test_preflight_refuses_before_any_work(command: str, overrides: list[str], message: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    import re

    assert cli.main([command, "gpt-tiny_cpu", *overrides]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("lightning-accel: error: ") and re.search(message, last), last
    assert not (tmp_path / "outputs").exists()


def _checkpoint(tmp_path: Path, kind: str) -> Path:
    import os

    from tests.support.checkpoints import write_checkpoint

    path = tmp_path / f"{kind}.ckpt"
    if kind == "random":
        path.write_bytes(os.urandom(4096))
        return path
    write_checkpoint(path, "resnet-tiny_cpu" if kind == "other-model" else "gpt-tiny_cpu", ["trainer.max_steps=800"])
    if kind == "truncated":
        path.write_bytes(path.read_bytes()[:2000])
    return path


@pytest.mark.parametrize(("kind", "message"), [
    ("truncated", r"is not a readable checkpoint"),
    ("random", r"is not a readable checkpoint"),
    ("other-model", r"does not fit this model: .*tensors missing"),
])
def test_bad_checkpoints_are_refused_before_the_trainer_starts(kind: str, message: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    import re

    ckpt = _checkpoint(tmp_path, kind)
    for command in ("run", "validate"):
        assert cli.main([command, "gpt-tiny_cpu", f"ckpt_path={ckpt}"]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert re.search(message, last), last
    assert not (tmp_path / "outputs").exists()


def test_a_fitting_checkpoint_passes(tmp_path: Path) -> None:
    from lightning_accel.config.preflight import preflight

    ckpt = _checkpoint(tmp_path, "fits")
    assert preflight("gpt-tiny_cpu", [f"ckpt_path={ckpt}"]).ckpt_path == str(ckpt)


def test_malformed_recipe_yaml_unwritable_outputs_and_bad_sweep_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("# @package _global_\ndefaults:\n  - train\n  - _self_\nmodel: [unclosed\n")
    assert cli.main(["run", str(bad)]) == 2
    assert "YAML syntax error in" in capsys.readouterr().err
    assert cli.main(["validate", str(bad)]) == 2
    assert "line 6, column 1" in capsys.readouterr().err

    assert cli.main(["run", "gpt-tiny_cpu", "-m", "trainer.max_steps=abc,2"]) == 2
    assert "sweep value trainer.max_steps=abc (from trainer.max_steps=abc,2) is refused" in capsys.readouterr().err

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    monkeypatch.setenv("LIGHTNING_ACCEL_OUTPUTS", str(a_file / "outputs"))
    assert cli.main(["run", "gpt-tiny_cpu"]) == 2
    assert "on its way is a file, not a directory; set LIGHTNING_ACCEL_OUTPUTS to a directory" in capsys.readouterr().err


def test_validate_all_with_and_without_the_extras(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Every recipe validates; without the sweep extra (as after `pip install .`) its recipe is skipped with the
    install line and every other still validates. One pass over all recipes (each costs a composition and a meta
    model), not one with the extras and one without."""
    from hydra.core.config_store import ConfigStore

    from lightning_accel import commands
    from lightning_accel.config.compose import recipe_names

    # the device estimate of the three 24 GB recipes takes a minute; tests/estimate/test_regenerate.py checks their figures
    monkeypatch.setattr(commands, "_device_warning", lambda *args: None)
    sweepers = ConfigStore.instance().repo["hydra"]["sweeper"]
    if "optuna.yaml" in sweepers:
        assert cli.main(["validate", "gpt-tiny_sweep_cpu"]) == 0
        assert capsys.readouterr().out.splitlines() == ["ok  gpt-tiny_sweep_cpu"]
        monkeypatch.delitem(sweepers, "optuna.yaml")  # as after `pip install .` (no extras)
    assert cli.main(["ls"]) == 0
    out = capsys.readouterr().out
    assert 'gpt-tiny_sweep_cpu' in out and '(needs the sweep extra: pip install "lightning-accel[sweep]")' in out
    assert cli.main(["validate", "--all"]) == 0
    out = capsys.readouterr().out
    assert "skip  gpt-tiny_sweep_cpu  (needs the sweep extra" in out
    assert out.count("ok  ") == len(recipe_names()) - 1
