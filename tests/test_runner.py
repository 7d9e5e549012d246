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


def test_strategy_by_name_or_target_and_atomic_checkpoints_by_default() -> None:
    assert build_strategy(OmegaConf.create({"strategy": {"name": "auto"}})) == "auto"
    ddp = build_strategy(OmegaConf.create({"strategy": {"_target_": "lightning.pytorch.strategies.DDPStrategy"}}))
    assert type(ddp).__name__ == "DDPStrategy"
    plugins = build_plugins(OmegaConf.create({"plugins": []}))
    assert [type(p) for p in plugins] == [AtomicCheckpointIO]
