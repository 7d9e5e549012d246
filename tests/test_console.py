"""`lightning-accel bench` in one voice: our lines and the warnings that matter, no tips, no Lightning chatter."""

from __future__ import annotations

import io
import logging
import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import bench, cli


class _Linear(pl.LightningModule):
    """No validation_step: a validation loader passed to fit makes Lightning warn, a warning that matters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_bench_prints_our_lines_and_real_warnings_without_tips_or_lightning_chatter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    seen: dict[str, str | None] = {}

    def noisy(argv: list[str]) -> int:
        seen["kineto"] = os.environ.get("KINETO_LOG_LEVEL")  # read by kineto at this process's first profiler start
        rank_zero_info("TinyBench: our plan line")
        data = DataLoader(TensorDataset(torch.ones(4, 2), torch.ones(4, 1)), batch_size=2)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(_Linear(), data, data)  # Lightning logs "GPU available: ...", a tip, and warns about the val loader
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)  # as Lightning 2.6 does
        return 0

    bench.load_benchmarks()
    monkeypatch.setitem(bench.BENCHMARKS, "tiny-noise", ("a bench that makes noise", noisy))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)  # stands for Lightning's own stderr handler
    lightning = logging.getLogger("lightning.pytorch")
    lightning.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cli.main(["bench", "tiny-noise"]) == 0
        rank_zero_info("💡 Tip: after the command")  # the filters went with the command
    finally:
        lightning.removeHandler(handler)
    # ours only: no "GPU available", no tip, no "`Trainer.fit` stopped"; after the command, the handler prints as before
    assert stream.getvalue() == "TinyBench: our plan line\n💡 Tip: after the command\n"
    messages = [str(w.message) for w in caught]
    assert any("You passed in a `val_dataloader` but have no `validation_step`" in m for m in messages), messages
    assert not any("LeafSpec" in m for m in messages), messages
    assert seen["kineto"] == "6" and "KINETO_LOG_LEVEL" not in os.environ  # set for the command only
