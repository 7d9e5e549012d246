"""A checkpoint and a config that disagree are refused before work, naming both sides (issue 51's resume escapes:
another optimizer failed at the next step with ``KeyError: 'momentum'``, a finished one-cycle schedule extended by
``trainer.max_steps`` failed in OneCycleLR's words, a changed learning rate was silently ignored)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_accel import cli
from lightning_accel.config.compose import compose_recipe
from lightning_accel.config.errors import UserError
from lightning_accel.config.preflight import check_checkpoint, check_job
from tests.support.checkpoints import write_checkpoint
from tests.support.edited_configs import job

WROTE = ["trainer.max_steps=800"]  # the run that wrote the checkpoint: gpt-tiny_cpu, AdamW, one-cycle over 800 steps


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint in a run directory, beside the config that run composed (``.hydra/config.yaml``)."""
    run = tmp_path_factory.mktemp("run")
    (run / ".hydra").mkdir()
    OmegaConf.save(compose_recipe("gpt-tiny_cpu", WROTE), run / ".hydra" / "config.yaml")
    return write_checkpoint(run / "checkpoints" / "last.ckpt", "gpt-tiny_cpu", WROTE)


SGD = ["model.optimizer._target_=torch.optim.SGD", "~model.optimizer.betas", "+model.optimizer.momentum=0.9"]
MISMATCHES = [
    ("another optimizer", SGD, r"holds the state of torch.optim.AdamW, and this config's model.optimizer is SGD, which needs momentum, "
                               r"dampening, nesterov it lacks; resume with model.optimizer._target_=torch.optim.AdamW"),
    ("a longer schedule", ["trainer.max_steps=1600"], r"has a OneCycleLR with total_steps=800, this config builds total_steps=1600 "
                                                       r"\(trainer.max_steps\): .*; resume with trainer.max_steps=800, or start without ckpt_path"),
    ("another learning rate", [*WROTE, "model.optimizer.lr=0.01"], r"has a OneCycleLR with base_lrs=\[8e-05\], this config builds "
                                                                   r"base_lrs=\[0.0004\] \(model.optimizer.lr: the rate the schedule starts from\): .*; resume with model.optimizer.lr=0.002"),
    ("another weight decay", [*WROTE, "model.optimizer.weight_decay=0.01"],
     r"has AdamW weight_decay=0.1, this config model.optimizer.weight_decay=0.01: the checkpoint's would silently win; resume with "
     r"model.optimizer.weight_decay=0.1"),
    ("no scheduler", [*WROTE, "model.scheduler=null"], r"was written with torch.optim.lr_scheduler.OneCycleLR, model.scheduler builds none"),
]


def _resume(checkpoint: Path, overrides: list[str]) -> None:
    """What preflight asks of ``ckpt_path`` (on the module and optimizers its job checks built), without composing."""
    cfg, path = job("gpt-tiny_cpu", overrides)
    module, optimization = check_job(cfg, path, launch=False)
    check_checkpoint(str(checkpoint), module, optimization, cfg)


@pytest.mark.parametrize(("overrides", "pattern"), [c[1:] for c in MISMATCHES], ids=[c[0] for c in MISMATCHES])
def test_a_checkpoint_that_disagrees_with_the_config_is_refused_naming_both(overrides: list[str], pattern: str, checkpoint: Path) -> None:
    with pytest.raises(UserError) as refused:
        _resume(checkpoint, overrides)
    line = str(refused.value)
    assert line.startswith(f"ckpt_path='{checkpoint}' ") and "\n" not in line
    assert re.search(pattern, line), line


def test_the_config_that_wrote_it_resumes(checkpoint: Path) -> None:
    _resume(checkpoint, WROTE)


def test_a_weights_only_checkpoint_an_unnamed_optimizer_and_a_directory(checkpoint: Path, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Outside a run directory the other optimizer is named by its param groups' keys (Adam's and AdamW's are one set);
    ``run`` refuses before any work and makes no run directory."""
    import shutil

    import torch

    weights = tmp_path / "weights.ckpt"
    torch.save({k: v for k, v in torch.load(checkpoint, weights_only=False).items() if k not in ("optimizer_states", "lr_schedulers")}, weights)
    with pytest.raises(UserError, match=r"holds the weights only \(ModelCheckpoint\(save_weights_only=True\)\), no optimizer or scheduler "
                                        r"state to resume; pass a full checkpoint"):
        _resume(weights, WROTE)
    loose = shutil.copy(checkpoint, tmp_path / "loose.ckpt")  # no run directory around it
    assert cli.main(["run", "gpt-tiny_cpu", f"ckpt_path={loose}", *WROTE, *SGD]) == 2
    assert "holds the state of torch.optim.Adam or torch.optim.AdamW, and this config's model.optimizer is SGD" in capsys.readouterr().err
    assert cli.main(["run", "gpt-tiny_cpu", f"ckpt_path={tmp_path}"]) == 2
    assert f"ckpt_path='{tmp_path}' is a directory, not a file; pass an existing .ckpt file" in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists()
