"""A strategy's set-up checks, asked by preflight with the strategy's own functions, on plain data."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from lightning_accel.config.errors import UserError
from lightning_accel.config.setup_checks import check_strategy_setup
from lightning_accel.strategies.gpipe import GPipeStrategy
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters())


def _cfg(batch_size: int = 8, devices: int = 1, num_nodes: int = 1) -> object:
    return OmegaConf.create({"data": {"batch_size": batch_size}, "trainer": {"devices": devices, "num_nodes": num_nodes}})


def _net() -> nn.Module:
    with torch.device("meta"):
        return Net()


def test_the_strategy_and_preflight_refuse_chunks_over_the_batch_in_the_same_words() -> None:
    strategy = GPipeStrategy(chunks=6, devices=["cpu", "cpu"])
    with pytest.raises(ValueError) as at_setup:
        strategy._chunks_for(4)  # the first batch the network sees, at the first step
    with pytest.raises(UserError) as before_work:
        check_strategy_setup(strategy, _net(), _cfg(batch_size=4))
    assert str(before_work.value) == f"data.batch_size=4: {at_setup.value}"
    check_strategy_setup(strategy, _net(), _cfg(batch_size=6))


@pytest.mark.parametrize("strategy", [
    GPipeStrategy(blocks=["Blok"], devices=["cpu"]), DistributedGPipeStrategy(blocks=["Blok"]), L2LOffloadStrategy(blocks=["Blok"]),
], ids=["gpipe", "gpipe_distributed", "l2l_offload"])
def test_a_block_class_the_model_lacks_is_refused_for_every_strategy_with_a_policy(strategy: object) -> None:
    with pytest.raises(UserError, match=r"^strategy.blocks=\['Blok'\]: block class 'Blok' is not used in Net .*Block.*name one of them"):
        check_strategy_setup(strategy, _net(), _cfg())


def test_a_world_size_the_pipeline_layout_does_not_divide() -> None:
    strategy = DistributedGPipeStrategy(balance=[2, 2])
    with pytest.raises(UserError, match=r"^trainer.devices=3: DistributedGPipeStrategy: world size 3 is not a multiple of "):
        check_strategy_setup(strategy, _net(), _cfg(devices=3))
    with pytest.raises(UserError, match=r"^trainer.devices=1 x num_nodes=3: .*world size 3"):
        check_strategy_setup(strategy, _net(), _cfg(devices=1, num_nodes=3))
    assert strategy.check_layout(4) == 2
    check_strategy_setup(strategy, _net(), _cfg(devices=2))


def test_l2l_asks_the_optimizers_the_meta_model_configures() -> None:
    with pytest.raises(UserError, match=r"^strategy=l2l_offload: L2LOffloadStrategy cannot run LBFGS on the host"):
        check_strategy_setup(L2LOffloadStrategy(), _net(), _cfg())
    check_strategy_setup(GPipeStrategy(devices=["cpu"]), _net(), _cfg())  # gpipe hosts any optimizer
