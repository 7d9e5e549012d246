"""The runner builds any user LightningModule or nn.Module given by ``_target_``."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from lightning_accel.config.errors import UserError
from lightning_accel.models import ClassifierTask
from lightning_accel.runner import build_model, build_plugins, build_strategy
from lightning_accel.plugins.io import AtomicCheckpointIO


def test_a_user_lightning_module_is_used_as_is() -> None:
    import lightning.pytorch as pl

    cfg = OmegaConf.create({"model": {"_target_": "lightning.pytorch.demos.boring_classes.BoringModel"}})
    model = build_model(cfg)
    assert isinstance(model, pl.LightningModule) and type(model).__name__ == "BoringModel"


def test_a_user_nn_module_trains_inside_a_task() -> None:
    cfg = OmegaConf.create({"model": {
        "_target_": "lightning_accel.models.ClassifierTask",
        "num_classes": 3,
        "net": {"_target_": "torch.nn.Sequential", "_args_": [
            {"_target_": "torch.nn.Flatten"},
            {"_target_": "torch.nn.Linear", "in_features": 12, "out_features": 3},
        ]},
    }})
    model = build_model(cfg)
    assert isinstance(model, ClassifierTask)
    assert model(torch.zeros(2, 3, 2, 2)).shape == (2, 3)


def test_a_bare_nn_module_is_refused_with_the_fix() -> None:
    cfg = OmegaConf.create({"model": {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2}})
    with pytest.raises(UserError, match=r"built a plain nn.Module \(torch.nn.modules.linear.Linear\).*model.net._target_="):
        build_model(cfg)


def test_strategy_by_target_or_auto_and_atomic_checkpoints_by_default() -> None:
    assert build_strategy(OmegaConf.create({"strategy": None})) == "auto"  # strategy=auto: Lightning picks
    ddp = build_strategy(OmegaConf.create({"strategy": {"_target_": "lightning.pytorch.strategies.DDPStrategy"}}))
    assert type(ddp).__name__ == "DDPStrategy"
    plugins = build_plugins(OmegaConf.create({"plugins": []}))
    assert [type(p) for p in plugins] == [AtomicCheckpointIO]


def test_progress_bar_is_off_when_not_on_a_terminal(monkeypatch) -> None:
    import sys

    from omegaconf import OmegaConf

    from lightning_accel.runner import _trainer_kwargs

    unset = OmegaConf.create({"trainer": {"enable_progress_bar": None}})
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert _trainer_kwargs(unset) == {"enable_progress_bar": False}
    assert _trainer_kwargs(OmegaConf.create({"trainer": {"enable_progress_bar": True}})) == {}  # the user's choice stands
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert _trainer_kwargs(unset) == {}


def test_run_output_goes_to_the_log_file_without_tips_or_known_warnings(tmp_path, monkeypatch) -> None:
    import logging
    import warnings

    from lightning.pytorch.utilities import rank_zero_info

    from lightning_accel.runner import route_output

    log = tmp_path / "run.log"
    root = logging.getLogger()
    handler = logging.FileHandler(log)
    monkeypatch.setattr(root, "handlers", [handler])  # what Hydra's job logging installs
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    lightning = logging.getLogger("lightning.pytorch")
    monkeypatch.setattr(lightning, "handlers", list(lightning.handlers))
    monkeypatch.setattr(lightning, "propagate", lightning.propagate)
    route_output()
    try:
        rank_zero_info("GPipeStrategy: a plan")
        rank_zero_info("💡 Tip: For seamless cloud logging, try installing litlogger")
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
        warnings.warn("a warning of ours", UserWarning)
    finally:
        logging.captureWarnings(False)
    handler.flush()
    text = log.read_text()
    assert "GPipeStrategy: a plan" in text and "a warning of ours" in text
    assert "Tip:" not in text and "LeafSpec" not in text


def test_summary_of_a_resumed_run_without_a_new_checkpoint() -> None:
    from lightning_accel.runner import summary

    status = {"recipe": "r", "status": "completed", "global_step": 8, "seconds": 1.0, "metrics": {"val/loss": 1.0},
              "checkpoint": None, "metrics_csv": None, "log": "l", "config": "c"}
    assert "checkpoint: (none new; resumed from /x/last.ckpt)" in summary(status | {"resumed_from": "/x/last.ckpt"})
    assert "callbacks=none" in summary(status)
    assert "interrupted (Ctrl-C) after 8 steps" in summary(status | {"status": "interrupted"})


def test_a_failed_run_ends_the_ranks_it_started_before_removing_their_directory(tmp_path) -> None:
    """Rank 0 removes a failed run's directory only once the ranks it launched are gone: a rank still starting (here, one
    that makes the directory and writes its log 0.3 s later, then hangs in a collective) would leave its log in a
    directory that was removed. One that ends on its own is only waited for."""
    import subprocess
    import time
    from types import SimpleNamespace

    from lightning_accel.run_dir import remove_run_dir
    from lightning_accel.runner import end_ranks

    run_dir = tmp_path / "outputs" / "recipe" / "run"
    run_dir.mkdir(parents=True)
    late = subprocess.Popen(["sh", "-c", f"sleep 0.3; mkdir -p {run_dir}; echo rank1 > {run_dir}/rank_1.log; sleep 60"])
    done = subprocess.Popen(["sh", "-c", "exit 3"])
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=SimpleNamespace(procs=[late, done])))
    started = time.monotonic()
    end_ranks(trainer, grace_s=0.6)  # type: ignore[arg-type]
    remove_run_dir(run_dir)
    assert late.poll() is not None and done.returncode == 3
    assert time.monotonic() - started < 5  # the hanging rank was terminated after its grace, not waited for
    time.sleep(0.5)
    assert not run_dir.exists() and not run_dir.parent.exists()
    end_ranks(None)  # a run that failed before its Trainer existed started no rank
