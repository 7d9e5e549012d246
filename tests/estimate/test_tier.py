"""``estimate`` with the NVMe tier: the strategy's own plan, checked against the strategy set up for real on the same recipe."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_accel.benchmarks.offload_workload import token_data
from lightning_accel.cli import main
from lightning_accel.config.compose import compose_recipe
from lightning_accel.config.errors import UserError
from lightning_accel.estimate import estimate_recipe
from lightning_accel.estimate.tier import TierRefused
from lightning_accel.runner import build_model, build_plugins, build_strategy
from lightning_accel.strategies import L2LOffloadStrategy

RECIPE = "gpt-tiny_l2l_cpu"
SMALL = ["data.batch_size=2", "data.block_size=16"]


def _fit(overrides: list[str], steps: int = 2) -> pl.Trainer:
    """The recipe's own model, strategy, precision and clipping, trained ``steps`` steps on random tokens."""
    cfg = compose_recipe(RECIPE, overrides)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=build_strategy(cfg), plugins=build_plugins(cfg), max_steps=steps,
                         gradient_clip_val=cfg.trainer.gradient_clip_val,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(build_model(cfg), token_data(2, 16, steps))
    return trainer


def test_the_tier_s_bytes_are_the_strategy_s(tmp_path: Path) -> None:
    # 4 blocks of 198k parameters: 11.5 MB holds them only with every block's optimizer state on disk, masters in RAM
    overrides = [*SMALL, f"strategy.nvme_path={tmp_path}", "strategy.host_budget=11.5MB"]
    estimate = estimate_recipe(RECIPE, overrides)
    tier = estimate.tier
    assert tier is not None and tier.state_on_disk == (True,) * 4 and tier.masters_on_disk == (False,) * 4
    strategy = _fit(overrides).strategy
    assert isinstance(strategy, L2LOffloadStrategy)
    stats = strategy.offload_stats
    assert stats.nvme_bytes == tier.disk_bytes > 0  # what the set-up laid out in its files
    assert stats.nvme_read_bytes == 2 * tier.step_read_bytes  # two steps: every spilled byte read and written once a step
    assert stats.nvme_write_bytes == 2 * tier.step_write_bytes  # (nothing written when spilled: no state before the first step)
    (rank,) = estimate.ranks
    assert rank.disk == {"optimizer state": tier.disk_bytes}
    assert "masters (fp32)" in rank.host and "optimizer state" not in rank.host
    assert rank.host["NVMe tier I/O buffers"] == tier.buffer_bytes
    in_ram = estimate_recipe(RECIPE, SMALL).ranks[0]
    assert rank.host_bytes == in_ram.host_bytes - in_ram.host["optimizer state"] + tier.buffer_bytes
    text = estimate.format()
    assert "disk (NVMe tier)" in text.splitlines()[1]
    assert (f"per optimizer step the disk reads {tier.step_read_bytes / 1e6:.1f} MB and writes "
            f"{tier.step_write_bytes / 1e6:.1f} MB; the strategy's plan: NVMe tier: host ") in text
    assert "optimizer state of 4/4 units, fp32 masters of 0/4" in text and "host_budget 11.5 MB bounds what the offload keeps" in text


@pytest.mark.parametrize("nvme", [True, False], ids=["too small even with a disk", "over budget without a disk"])
def test_a_budget_the_strategy_refuses_is_refused_with_its_message(tmp_path: Path, nvme: bool,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    overrides = [*SMALL, "strategy.host_budget=2MB", *([f"strategy.nvme_path={tmp_path}"] if nvme else [])]
    # the recipe's preflight runs the strategy's plan (issue 58: refused before any rank starts), so estimate stops there
    # with the same line, as a UserError; estimate's own plan refuses it as TierRefused where no preflight runs
    with pytest.raises((TierRefused, UserError)) as refused:
        estimate_recipe(RECIPE, overrides)
    with pytest.raises(ValueError) as strategy:
        _fit(overrides)  # the Python API: L2LOffloadStrategy(host_budget=..., nvme_path=...) in a Trainer
    said, own = str(refused.value), str(strategy.value)
    assert said == own  # one plan, one line, advice included, at either door
    assert said.startswith("L2LOffloadStrategy: strategy.host_budget=2.00 MB is less than the ")
    assert "raise host_budget to at least" in said
    # without a disk, "set nvme_path" alone would lead nowhere at 2 MB (the tier's I/O buffers join what stays): the
    # plan's advice names the budget the disk needs, and that budget with the disk is met
    floor = re.search(r"or set strategy.nvme_path=DIR and host_budget to at least ([\d.]+ [kMG]B) \(what stays", said)
    assert (floor is None) == nvme, said
    assert main(["estimate", RECIPE, *overrides]) == 2  # the CLI's preflight says the same line
    assert capsys.readouterr().err.strip().endswith(own)
    if floor is not None:
        fixed = [*SMALL, f"strategy.host_budget='{floor.group(1).replace(' ', '')}'", f"strategy.nvme_path={tmp_path}"]
        assert estimate_recipe(RECIPE, fixed).tier is not None
    assert os.listdir(tmp_path) == []  # refused (or only planned) before any file


def test_cli_prints_the_tiers_and_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", RECIPE, *SMALL, f"strategy.nvme_path={tmp_path}", "--json"]
    assert main(args) == 0  # no budget: everything the tier can move goes to disk
    out = json.loads(capsys.readouterr().out)
    tier, (rank,) = out["tier"], out["ranks"]
    assert tier["plan"].startswith("NVMe tier: host ") and "optimizer state of 4/4 units, fp32 masters of 4/4" in tier["plan"]
    assert rank["disk_bytes"] == sum(rank["components"]["disk"].values()) == tier["disk_bytes"]
    # each block's masters and AdamW state (two moments: 3 x its masters) read by the step, and its masters read by
    # the compute (fp32 on the CPU: blocks compute on them): 3 checkpointed blocks twice, the last one once
    assert tier["read_bytes_per_step"] == tier["disk_bytes"] + 7 * tier["disk_bytes"] // 12
    assert main([*args[:-1], "strategy.host_budget=1kB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "L2LOffloadStrategy: strategy.host_budget=1.00 kB is less than" in err


def test_data_parallel_the_plan_is_one_ranks_with_its_own_share_of_the_state(tmp_path: Path) -> None:
    """l2l_offload_ddp on 2 ranks, partitioned: each rank's files hold every block's masters and the optimizer state of
    its own 2 of the 4 equal blocks (the strategy's own plan: tests/strategies/test_l2l_offload_ddp.py); replicated,
    all of it, as on one device. The budget is per rank."""
    one = estimate_recipe(RECIPE, [*SMALL, f"strategy.nvme_path={tmp_path}"])
    ddp = ["strategy=l2l_offload_ddp", "trainer.devices=2", f"strategy.nvme_path={tmp_path}"]
    part, repl = (estimate_recipe(RECIPE, [*SMALL, *ddp, f"strategy.host_step={how}"]) for how in ("partitioned", "replicated"))
    (one_rank,), (part_rank,), (repl_rank,) = one.ranks, part.ranks, repl.ranks
    assert repl_rank.disk == one_rank.disk and repl.tier == one.tier
    assert part_rank.disk == {"masters (fp32)": one_rank.disk["masters (fp32)"], "optimizer state": one_rank.disk["optimizer state"] // 2}
    assert "optimizer state of 2/2 units, fp32 masters of 4/4" in part.tier.describe()
    assert "optimizer state" not in part_rank.host and part_rank.host_bytes == one_rank.host_bytes
    assert any(n.startswith("the NVMe tier: each rank its own files under nvme_path") for n in part.notes)
    budget = estimate_recipe(RECIPE, [*SMALL, *ddp, "strategy.host_budget=13MB"])
    assert any("bounds what the offload keeps on each rank" in n for n in budget.notes)
