"""What a strategy would refuse at set-up is refused before any rank starts: the NVMe tier's plan under
``l2l_offload_ddp`` (a host budget it cannot keep) and ``load_by_block``'s need of an L2L strategy, each in one line
naming the value; each fix the line suggests, applied, passes. The Python API refuses ``load_by_block`` under another
strategy with a one-line ValueError before the first step (was torch's "Cannot copy out of meta tensor")."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_accel.config.errors import UserError
from lightning_accel.config.preflight import check_job
from lightning_accel.config.compose import resolve_recipe
from tests.support.edited_configs import composed, edited

DDP_TIER = ["trainer.devices=2", "trainer.max_steps=2"]


def _check(recipe: str, groups: tuple[str, ...], overrides: list[str]) -> None:
    check_job(edited(composed(recipe, groups), overrides), resolve_recipe(recipe), False)


def test_a_host_budget_l2l_offload_ddp_cannot_keep_is_refused_before_the_ranks_and_each_fix_passes(tmp_path: Path) -> None:
    groups = ("strategy=l2l_offload_ddp",)
    with pytest.raises(UserError) as raised:
        _check("gpt-tiny_cpu", groups, [*DDP_TIER, "strategy.host_budget=1MB"])
    line = str(raised.value)
    assert "\n" not in line and line.startswith("L2LOffloadDDPStrategy: strategy.host_budget=1.00 MB is less than"), line
    fixes = re.fullmatch(r".*; raise host_budget to at least ([\d.]+ [kMG]B), or set strategy.nvme_path=DIR and host_budget to "
                         r"at least ([\d.]+ [kMG]B) .*", line)
    assert fixes is not None, line
    in_ram, with_disk = (f"strategy.host_budget='{fixes.group(i).replace(' ', '')}'" for i in (1, 2))
    _check("gpt-tiny_cpu", groups, [*DDP_TIER, in_ram])  # the first fix, applied
    _check("gpt-tiny_cpu", groups, [*DDP_TIER, with_disk, f"strategy.nvme_path={tmp_path / 'nvme'}"])  # the second
    with pytest.raises(UserError, match=r"strategy.host_budget=1.00 MB is less than"):  # the disk alone would not do
        _check("gpt-tiny_cpu", groups, [*DDP_TIER, "strategy.host_budget=1MB", f"strategy.nvme_path={tmp_path / 'nvme'}"])


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_accel.models.hf import hf_causal_lm

    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    hf_causal_lm({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64, "use_cache": False}).save_pretrained(path)
    return path


def test_load_by_block_without_an_l2l_strategy_is_refused_before_work_and_the_fix_passes(saved_llama: Path) -> None:
    by_block = [f"model.net.pretrained_path={saved_llama}", "model.net.config=null", "+model.net.load_by_block=true",
                "data.block_size=32"]
    with pytest.raises(UserError) as raised:
        _check("llama-tiny_cpu", (), by_block)
    line = str(raised.value)
    assert "\n" not in line and line.startswith("model.net.load_by_block=true: ") and "the strategy is auto" in line, line
    assert "use strategy=l2l_offload" in line and "or set model.net.load_by_block=false" in line, line
    _check("llama-tiny_cpu", ("strategy=l2l_offload",), by_block)  # the fix it names
    _check("llama-tiny_cpu", (), [*by_block[:2], "+model.net.load_by_block=false", "data.block_size=32"])  # the other


def test_the_python_api_refuses_load_by_block_under_another_strategy_with_one_valueerror(saved_llama: Path, tmp_path: Path) -> None:
    from lightning_accel.models import LanguageModelTask
    from lightning_accel.models.hf import hf_causal_lm

    task = LanguageModelTask(hf_causal_lm(pretrained_path=str(saved_llama), load_by_block=True),
                             functools.partial(torch.optim.AdamW, lr=1e-3))
    tokens = torch.randint(0, 256, (8, 17))
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu",
                         default_root_dir=tmp_path, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"^the model is on the meta device, .* but the strategy is \w+; use strategy=l2l_offload") as raised:
        trainer.fit(task, DataLoader(list(zip(tokens[:, :-1], tokens[:, 1:])), batch_size=4))
    assert "\n" not in str(raised.value) and trainer.global_step == 0


def test_every_adapter_target_a_refusal_suggests_trains(tmp_path: Path) -> None:
    """Advice that works: the target modules a refused LoRA target list suggests each build the adapted model (the list
    was cut at 12 names, leaving out ones that would work)."""
    recipe = "llama-tiny_lora_cpu"
    with pytest.raises(UserError) as raised:
        _check(recipe, (), ["model.adapter.target_modules=[no_such_proj]"])
    line = str(raised.value)
    assert "\n" not in line and line.startswith("model.adapter.target_modules=['no_such_proj']: "), line
    names = line.rsplit("any of its Linear layers: ", 1)[1].split(", ")
    assert {"q_proj", "v_proj", "down_proj"} <= set(names), names
    for name in names:  # each suggestion, applied
        _check(recipe, (), [f"model.adapter.target_modules=[{name}]"])
