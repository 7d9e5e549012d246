"""Sweeps: the search-space checks before any trial, and a real 2-trial Optuna sweep."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_accel.config.compose import compose_recipe
from lightning_accel.config.errors import UserError, explain
from lightning_accel.sweep import check_added_keys, check_search_space, check_sweep, metric_direction, sweep_params
from tests.support.warm_python import python as warm_python

pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="needs the sweep extra (hydra-optuna-sweeper)")

TINY = [
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "data.max_bytes=200000",
]


@pytest.mark.parametrize(
    ("metric", "direction"),
    [("val/loss", "minimize"), ("val/ppl", "minimize"), ("val/acc", "maximize"), ("val/f1", "maximize"), ("train/loss_epoch", "minimize")],
)
def test_direction_follows_the_metric_name(metric: str, direction: str) -> None:
    assert metric_direction(metric) == direction


def test_unknown_metric_direction_asks_for_it() -> None:
    with pytest.raises(UserError, match=r"optimized_metric='val/foo'.*hydra.sweeper.direction=minimize"):
        metric_direction("val/foo")


def test_search_space_over_a_missing_key_is_refused() -> None:
    cfg = compose_recipe("gpt-tiny_cpu")
    with pytest.raises(UserError, match=r"'model.optimizer.lrr' does not exist.*did you mean 'model.optimizer.lr'.*\+model.optimizer.lrr"):
        check_search_space(cfg, {"model.optimizer.lrr": "interval(1e-4, 1e-2)"})
    # existing keys, deliberate additions, Hydra's own keys and group choices pass
    check_search_space(
        cfg,
        {"model.optimizer.lr": "x", "+extra.knob": "1,2", "hydra.job.name": "a,b", "precision": "32-true,bf16-mixed"},
        groups=["precision"],
    )


def test_search_space_keys_written_with_plus_or_tilde_on_hydra_keys() -> None:
    """``~key`` must exist; ``+hydra.sweeper.params.K=...`` (a search dimension written as Hydra's own key) checks K,
    then is refused: each trial would set Hydra's key and K would not change."""
    cfg = compose_recipe("gpt-tiny_cpu")
    with pytest.raises(UserError, match=r"'~data.batch_sise' does not exist.*'data.batch_size'.*remove the ~ entry"):
        check_search_space(cfg, {"~data.batch_sise": "8,16"})
    with pytest.raises(UserError, match=r"'model.optimizer.lrr' does not exist.*did you mean 'model.optimizer.lr'"):
        check_search_space(cfg, {"+hydra.sweeper.params.model.optimizer.lrr": "interval(1e-4,1e-2)"})
    with pytest.raises(UserError, match=r"'\+\+hydra.sweeper.params.data.batch_size' sweeps Hydra's own config: .*"
                                        r"data.batch_size would not change; write data.batch_size=choice\(8,16\)"):
        check_search_space(cfg, {"++hydra.sweeper.params.data.batch_size": "choice(8,16)"})
    check_search_space(cfg, {"~model.optimizer.betas": "1,2", "hydra.sweeper.n_trials": "2,4"})


def test_an_added_search_space_key_must_bind_where_it_lands() -> None:
    with pytest.raises(UserError, match=r"^search space key '\+model.optimizer.lrr': model.optimizer.lrr is not an "
                                        r"argument of torch.optim.AdamW \(did you mean 'lr'"):
        check_added_keys("gpt-tiny_cpu", [], {"+model.optimizer.lrr": "tag(log, interval(1e-4, 1e-2))"})
    with pytest.raises(UserError, match=r"'\+trainer.max_stepz': trainer.max_stepz is not an argument of .*Trainer"):
        check_sweep("gpt-tiny_cpu", ["-m", "+trainer.max_stepz=2,4"])
    check_added_keys("gpt-tiny_cpu", [], {"+model.optimizer.foreach": "true,false", "++model.optimizer.lr": "choice(0.1,0.2)",
                                          "model.optimizer.lr": "interval(0,1)"})


def test_sweep_params_merges_config_and_command_line() -> None:
    hydra_cfg = OmegaConf.create({"sweeper": {"params": {"model.optimizer.lr": "interval(1e-4,1e-2)"}}})
    params = sweep_params(hydra_cfg, ["data.batch_size=8,16", "trainer.max_steps=4", "+new.key=choice(1,2)", "-m"])
    assert params == {"model.optimizer.lr": "interval(1e-4,1e-2)", "data.batch_size": "8,16", "+new.key": "choice(1,2)"}


def test_check_sweep_refuses_a_bad_key_in_the_search_space_config(tmp_path: Path) -> None:
    recipe = tmp_path / "my_sweep.yaml"
    recipe.write_text(
        "# @package _global_\n"
        "defaults:\n  - train\n  - override /hparams_search: optuna_lr_batch\n  - _self_\n"
        "hydra:\n  sweeper:\n    params:\n      data.batch_sise: choice(8, 16)\n"
    )
    with pytest.raises(UserError, match=r"search space key 'data.batch_sise' does not exist.*did you mean 'data.batch_size'"):
        check_sweep(str(recipe), [])


def test_check_sweep_refuses_a_bad_key_on_the_command_line() -> None:
    with pytest.raises(UserError, match=r"'trainer.max_stepz' does not exist.*'trainer.max_steps'"):
        check_sweep("gpt-tiny_cpu", ["-m", "trainer.max_stepz=2,4"])


def test_check_sweep_refuses_an_undecidable_direction() -> None:
    with pytest.raises(UserError, match=r"optimized_metric='val/foo'"):
        check_sweep("gpt-tiny_cpu", ["hparams_search=optuna_lr_batch", "optimized_metric=val/foo"])


def test_check_sweep_passes_the_shipped_sweep_recipe() -> None:
    check_sweep("gpt-tiny_sweep_cpu", [])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("hydra/sweeper=optuan", r"^unknown hydra/sweeper option 'optuan' \(did you mean 'optuna'\?\); choose one of: basic, optuna"),
        ("hydra/launcher=submitit_slurmm", r"^unknown hydra/launcher option 'submitit_slurmm' \(did you mean 'submitit_slurm'"),
        ("launcher=slurmm", r"^unknown launcher option 'slurmm' \(did you mean 'slurm'\?\)"),
    ],
)
def test_unknown_sweeper_or_launcher_is_one_line(override: str, message: str) -> None:
    with pytest.raises(Exception) as info:
        check_sweep("gpt-tiny_cpu", ["-m", override])
    line = explain(info.value)
    assert line is not None and "\n" not in line
    assert re.search(message, line), line


def _summary(stdout: str) -> tuple[float, str]:
    match = re.search(r"sweep finished: best val/loss=(\S+) \(minimize\) over (\d+) completed trial\(s\) in (\S+)", stdout)
    assert match, stdout[-3000:]
    return float(match.group(1)), match.group(3)


def _trial_losses(sweep_dir: Path) -> dict[str, float]:
    runs = {p.parent.name: json.loads(p.read_text()) for p in sweep_dir.glob("*/run.json")}
    assert all(r["status"] == "completed" for r in runs.values())
    return {name: r["metrics"]["val/loss"] for name, r in runs.items()}


@pytest.mark.slow
def test_two_trial_optuna_sweep_then_resume(cli_env: dict[str, str]) -> None:
    cmd = [warm_python(), "-m", "lightning_accel", "run", "gpt-tiny_sweep_cpu", "hydra.sweeper.n_trials=2", *TINY]
    done = subprocess.run(cmd, env=cli_env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    best, sweep_dir_text = _summary(done.stdout)
    sweep_dir = Path(sweep_dir_text)
    losses = _trial_losses(sweep_dir)
    assert sorted(losses) == ["0", "1"]
    assert best == pytest.approx(min(losses.values()), rel=1e-5)
    best_dir = re.search(r"run:\s+(\S+)", done.stdout).group(1)
    assert losses[Path(best_dir).name] == pytest.approx(best, rel=1e-5)
    assert (sweep_dir / "optuna.db").is_file()
    results = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    assert set(results.best_params) == {"model.optimizer.lr", "data.batch_size", "trainer.accumulate_grad_batches"}

    # Resume the study: one more trial, in its own dir; the best covers all three.
    resumed = subprocess.run([*cmd[:-5], "hydra.sweeper.n_trials=1", *TINY, f"hydra.sweep.dir={sweep_dir}"],
                             env=cli_env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    best, _ = _summary(resumed.stdout)
    losses = _trial_losses(sweep_dir)
    assert sorted(losses) == ["0", "1", "s1_0"]
    assert best == pytest.approx(min(losses.values()), rel=1e-5)
    assert "over 3 completed trial(s)" in resumed.stdout
