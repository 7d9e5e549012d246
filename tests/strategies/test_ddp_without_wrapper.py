"""The wiring both strategies without DDP's wrapper share (DDPWithoutWrapper): one timeout default, the same refusals in
each strategy's words, accumulation's flag, and the precision plugin's methods replaced from setup to teardown only.
The 2-rank clipping and found-inf behaviour runs in test_l2l_offload_ddp.py and the pipeline's multi-process tests."""

from __future__ import annotations

from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import MLP
from lightning_accel.strategies.ddp_without_wrapper import DEFAULT_TIMEOUT, DDPWithoutWrapper
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from lightning_accel.strategies.l2l_offload_ddp import L2LOffloadDDPStrategy

STRATEGIES = [DistributedGPipeStrategy, L2LOffloadDDPStrategy]


@pytest.mark.parametrize("cls", STRATEGIES)
def test_one_timeout_default_and_a_number_is_seconds(cls: type[DDPWithoutWrapper]) -> None:
    assert DEFAULT_TIMEOUT == timedelta(minutes=30)
    assert cls()._timeout == DEFAULT_TIMEOUT and cls(timeout=None)._timeout == DEFAULT_TIMEOUT
    assert cls(timeout=60)._timeout == timedelta(seconds=60)
    assert cls(timeout=timedelta(minutes=2))._timeout == timedelta(minutes=2)


@pytest.mark.parametrize(("cls", "how"), [
    (DistributedGPipeStrategy, "each stage's gradients are averaged over the replicas"),
    (L2LOffloadDDPStrategy, "gradients are averaged block by block"),
])
@pytest.mark.parametrize(("kwargs", "name"), [({"find_unused_parameters": True}, "find_unused_parameters"),
                                              ({"ddp_comm_hook": print}, "ddp_comm_hook")])
def test_arguments_for_the_wrapper_are_refused_in_each_strategys_words(
    cls: type[DDPWithoutWrapper], how: str, kwargs: dict, name: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{cls.__name__} does not wrap the model in DistributedDataParallel, so "
                                         rf"{name}=\.\.\. would be ignored; remove it \({how}"):
        cls(**kwargs)
    cls(ddp_comm_hook=None, process_group_backend="gloo", start_method="popen")  # DDPStrategy's own, or unset: taken


@pytest.mark.parametrize("cls", STRATEGIES)
def test_gradients_are_not_averaged_inside_an_accumulation(cls: type[DDPWithoutWrapper]) -> None:
    strategy = cls()
    assert strategy._sync_grads
    with strategy.block_backward_sync():
        assert not strategy._sync_grads
    assert strategy._sync_grads


class Tiny(pl.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = MLP(4, 2, hidden=8, depth=2)
        self.automatic_optimization = not manual
        self.plugin_seen: list[tuple[object, object]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def on_before_optimizer_step(self, optimizer) -> None:
        plugin = self.trainer.precision_plugin
        self.plugin_seen.append((vars(plugin).get("clip_grad_by_norm"), vars(plugin).get("_after_closure")))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: Tiny, strategy: DDPWithoutWrapper, **kwargs) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=2, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )
    data = TensorDataset(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.randn(8, 2))
    trainer.fit(module, DataLoader(data, batch_size=4))
    return trainer


@pytest.mark.usefixtures("one_rank")
def test_manual_optimization_is_refused_in_the_pipelines_words() -> None:
    with pytest.raises(ValueError, match=r"^DistributedGPipeStrategy needs automatic optimization \(Tiny sets "
                                         r"automatic_optimization=False\): the pipeline schedule runs forward and backward"):
        _fit(Tiny(manual=True), DistributedGPipeStrategy(chunks=2, timeout=60))


@pytest.mark.usefixtures("one_rank")
def test_sync_batchnorm_is_refused_as_it_would_convert_nothing() -> None:
    with pytest.raises(ValueError, match=r"^DistributedGPipeStrategy does not convert BatchNorm layers \(Trainer\(sync_batchnorm"):
        _fit(Tiny(), DistributedGPipeStrategy(chunks=2, timeout=60), sync_batchnorm=True)


@pytest.mark.usefixtures("one_rank")
def test_the_plugins_methods_are_replaced_for_the_fit_only() -> None:
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    module = Tiny()
    _fit(module, DistributedGPipeStrategy(chunks=2, timeout=60), plugins=[plugin], gradient_clip_val=1.0)
    assert len(module.plugin_seen) == 2 and all(clip is not None and after is not None for clip, after in module.plugin_seen)
    assert "clip_grad_by_norm" not in vars(plugin) and "_after_closure" not in vars(plugin)
