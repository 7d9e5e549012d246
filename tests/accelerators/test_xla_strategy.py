"""XLAPJRTStrategy and XLAPJRTPrecision refusals that need no XLA device."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.plugins.precision.xla_pjrt import XLAPJRTPrecision
from lightning_accel.strategies.xla_pjrt import XLAPJRTStrategy


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return self.net(batch[0]).sum()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_strategy_without_its_accelerator_says_which_to_pass() -> None:
    trainer = pl.Trainer(accelerator="cpu", strategy=XLAPJRTStrategy(), max_steps=1, logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="needs accelerator 'xla_pjrt', got CPUAccelerator; use Trainer\\(accelerator='xla_pjrt', strategy='xla_pjrt'\\)"):
        trainer.fit(_Tiny(), DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2))


@pytest.mark.parametrize("precision", ["16-mixed", "16-true", "64-true"])
def test_precision_without_bf16_is_refused_with_the_fix(precision: str) -> None:
    with pytest.raises(ValueError, match=f"precision='{precision}' is not supported on XLA devices.*; use precision='bf16-mixed'"):
        XLAPJRTPrecision(precision)


def test_foreign_precision_plugin_is_refused() -> None:
    from lightning_accel.plugins.precision import OffloadPrecision

    with pytest.raises(TypeError, match="cannot use the precision plugin OffloadPrecision"):
        XLAPJRTStrategy(precision_plugin=OffloadPrecision("32-true"))


def test_lightning_precision_flag_is_kept_and_done_the_xla_way() -> None:
    from lightning.pytorch.plugins.precision import HalfPrecision

    strategy = XLAPJRTStrategy()
    strategy.precision_plugin = HalfPrecision("bf16-true")
    assert isinstance(strategy.precision_plugin, XLAPJRTPrecision)
    assert strategy.precision_plugin.precision == "bf16-true"
