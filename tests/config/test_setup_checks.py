"""A strategy's set-up checks, asked by preflight with the strategy's own functions, on plain data."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from lightning_accel.config.errors import UserError
from lightning_accel.config.setup_checks import check_offload_precision, check_strategy_setup
from lightning_accel.plugins.precision import OffloadPrecision
from lightning_accel.strategies.gpipe import GPipeStrategy
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy
from lightning_accel.strategies.l2l_offload_ddp import L2LOffloadDDPStrategy


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


class Manual(Net):
    """A module that steps its own optimizer (``automatic_optimization = False``), with one the host can step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _manual() -> nn.Module:
    with torch.device("meta"):
        return Manual()


@pytest.mark.parametrize("strategy", [DistributedGPipeStrategy(), L2LOffloadDDPStrategy()], ids=["gpipe_distributed", "l2l_offload_ddp"])
def test_what_a_fit_needs_of_a_strategy_wired_without_ddps_wrapper_is_asked_before_work(strategy: object) -> None:
    """Manual optimization and ``sync_batchnorm``: refused by preflight in the words of the strategy's set-up."""
    with pytest.raises(ValueError) as at_setup:
        strategy.check_fit(_manual(), False)
    with pytest.raises(UserError) as before_work:
        check_strategy_setup(strategy, _manual(), _cfg())
    assert str(before_work.value) == f"strategy={strategy.strategy_name}: {at_setup.value}"
    assert "needs automatic optimization (Manual sets automatic_optimization=False)" in str(at_setup.value)
    cfg = _cfg()
    cfg.trainer.sync_batchnorm = True
    with pytest.raises(UserError, match=r"^trainer.sync_batchnorm=true: \w+ does not convert BatchNorm layers"):
        check_strategy_setup(strategy, _net() if isinstance(strategy, DistributedGPipeStrategy) else _sgd(), cfg)
    cfg.trainer.sync_batchnorm = False
    check_strategy_setup(strategy, _net() if isinstance(strategy, DistributedGPipeStrategy) else _sgd(), cfg)


def _sgd() -> nn.Module:
    module = _manual()
    module.automatic_optimization = True
    return module


def test_the_delayed_update_refuses_manual_optimization_and_fp16_scaling_before_work() -> None:
    strategy = L2LOffloadStrategy(delayed_update=True)
    with pytest.raises(UserError, match=r"^strategy.delayed_update=true: L2LOffloadStrategy\(delayed_update=True\) needs "
                                        r"automatic optimization, but Manual sets automatic_optimization=False"):
        check_strategy_setup(strategy, _manual(), _cfg())
    check_strategy_setup(strategy, _sgd(), _cfg())
    fp16 = r"^strategy.delayed_update=true: L2LOffloadStrategy\(delayed_update=True\) cannot run with fp16 loss scaling"
    with pytest.raises(UserError, match=fp16):
        check_offload_precision(strategy, [OffloadPrecision("16-mixed")], None)
    with pytest.raises(UserError, match=fp16):
        check_offload_precision(strategy, [], "16-mixed")  # Lightning's flag, paired with the offload plugin of it
    check_offload_precision(strategy, [OffloadPrecision("bf16-mixed")], None)
    check_offload_precision(L2LOffloadStrategy(), [OffloadPrecision("16-mixed")], None)  # no delayed update: fp16 is fine


def test_gpipe_preflight_takes_a_model_without_blocks_where_the_strategy_does() -> None:
    """Preflight asks gpipe's own block search: a model of chained layers (no block container) passes, as it trains
    (tests/strategies/test_gpipe_children.py); one whose forward reorders them is refused in the strategy's one line."""
    from tests.strategies.test_gpipe_children import Attributes, Reordered

    with torch.device("meta"):
        chained, reordered = Attributes(), Reordered()
    check_strategy_setup(GPipeStrategy(), chained, _cfg(), [])
    with pytest.raises(UserError) as refused:
        check_strategy_setup(GPipeStrategy(), reordered, _cfg(), [])
    assert "\n" not in str(refused.value) and "blocks=" in str(refused.value), refused.value
