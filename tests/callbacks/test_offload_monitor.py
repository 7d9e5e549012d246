"""OffloadMonitor by Lightning's conventions: one row per logged optimizer step, the summary said once on rank zero."""

from __future__ import annotations

import csv
import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning_utilities.core.rank_zero import rank_zero_only
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.callbacks import OffloadMonitor
from lightning_accel.models import GPT, LanguageModelTask
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy


def _lm_data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (32, 17), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)


def _fit(tmp_path, monitor: OffloadMonitor, strategy="l2l_offload", **kwargs) -> pl.Trainer:
    torch.manual_seed(0)
    options = dict(max_steps=4, accumulate_grad_batches=2, log_every_n_steps=2, logger=CSVLogger(tmp_path, name="csv"))
    options.update(kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, callbacks=[monitor], limit_val_batches=0,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **options)
    trainer.fit(LanguageModelTask(GPT("tiny", n_layer=2, block_size=16)), _lm_data())
    return trainer


def _rows(trainer: pl.Trainer) -> list[dict[str, str]]:
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        return list(csv.DictReader(f))


def test_one_row_per_logged_optimizer_step_under_accumulation(tmp_path) -> None:
    # 8 micro-batches, 4 optimizer steps (2 micro-batches each), a row every 2 optimizer steps
    trainer = _fit(tmp_path, OffloadMonitor(log_every_n_steps=2))
    rows = _rows(trainer)
    offload = [r for r in rows if r["offload/steps"]]
    assert [float(r["offload/steps"]) for r in offload] == [2.0, 4.0]  # after optimizer steps 2 and 4, once each
    # at the step index Lightning writes the same batch's self.log values under (log_every_n_steps=2 alike)
    lightning = [r["step"] for r in rows if r.get("train/loss")]
    assert [r["step"] for r in offload] == lightning == ["1", "3"]


def test_the_summary_is_said_once_through_rank_zero_info(tmp_path, caplog, capsys, monkeypatch) -> None:
    monitor = OffloadMonitor()
    with caplog.at_level(logging.INFO):
        trainer = _fit(tmp_path, monitor, logger=False)
    said = [r.getMessage() for r in caplog.records if "L2L offload:" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("L2L offload: 4 steps"), said
    assert "L2L offload:" not in capsys.readouterr().out  # not printed
    caplog.clear()
    monkeypatch.setattr(rank_zero_only, "rank", 1)  # another rank says nothing
    monitor.on_train_end(trainer, trainer.lightning_module)
    assert not [r for r in caplog.records if "L2L offload:" in r.getMessage()]


def test_a_strategy_without_offload_is_said_once(tmp_path) -> None:
    with pytest.warns(UserWarning, match=r"OffloadMonitor: SingleDeviceStrategy does not offload; nothing to report") as record:
        _fit(tmp_path, OffloadMonitor(log_every_n_steps=1), strategy="auto", logger=False)
    assert sum("does not offload" in str(w.message) for w in record) == 1
