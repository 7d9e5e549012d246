"""The Python API's ``trainer.fit`` under ``L2LOffloadDDPStrategy`` refuses a host budget its ranks could not keep in
the process that starts them, in the strategy's own line, before any rank starts; a budget they keep starts them."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.utils.data import DataLoader

from lightning_accel.strategies.l2l_offload_ddp import L2LOffloadDDPStrategy
from tests.support.workers.l2l_ddp_worker import PER_RANK_BATCH, TIER_BUDGET, gpt_data, gpt_task


class RanksStarting(Exception):
    """Raised where Lightning's launcher would start the other ranks."""


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    def start(self: Any) -> None:
        raise RanksStarting

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", start)


def _fit(budget: str) -> None:
    trainer = pl.Trainer(strategy=L2LOffloadDDPStrategy(host_budget=budget), accelerator="cpu", devices=2, max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(gpt_task(torch.float32), DataLoader(gpt_data(), batch_size=PER_RANK_BATCH))


@pytest.mark.usefixtures("no_ranks")
def test_a_budget_the_ranks_cannot_keep_is_refused_before_they_start() -> None:
    with pytest.raises(ValueError, match=r"^L2LOffloadDDPStrategy: strategy.host_budget=100.00 kB is less than .*"
                                         r"raise host_budget to at least"):
        _fit("100kB")


@pytest.mark.usefixtures("no_ranks")
def test_a_budget_the_ranks_keep_starts_them() -> None:
    """gpt32 on 2 ranks, partitioned: a rank keeps 456.45 kB within 500 kB (tests/strategies/test_l2l_offload_ddp.py),
    though one process could not: the plan is the rank's, not one process's."""
    with pytest.raises(RanksStarting):
        _fit(TIER_BUDGET)
