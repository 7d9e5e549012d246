"""CommDDPStrategy inside a real Trainer, and the up-front comm-hook checks.

One process (gloo, world size 1) is enough to see what Lightning does with the hook and
with gradient accumulation: DDP still runs its reducer and the hook on every bucket.
The two-process numerics are in tests/comm/test_probe.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from omegaconf import OmegaConf
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lightning_accel.comm import metered_all_reduce
from lightning_accel.config.compose import compose_recipe
from lightning_accel.config.errors import UserError
from lightning_accel.config.preflight import check_comm_strategy
from lightning_accel.runner import build_strategy
from lightning_accel.strategies.ddp_comm import COMM_VARIANTS, CommDDPStrategy

PARAMS = 32 * 2 + 2  # BoringModel: Linear(32, 2)


@pytest.fixture
def restore_env() -> Iterator[None]:
    saved = dict(os.environ)  # Lightning sets MASTER_PORT, WORLD_SIZE, ... for the process group
    yield
    if torch.distributed.is_initialized():  # Lightning's DDP teardown leaves the group; later tests make their own
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def _fit(strategy: DDPStrategy | str, monkeypatch: pytest.MonkeyPatch, accumulate: int = 2, steps: int = 3) -> tuple[dict, int]:
    entered = []
    original = DistributedDataParallel.no_sync

    def counting_no_sync(self: DistributedDataParallel):  # type: ignore[no-untyped-def]
        entered.append(1)
        return original(self)

    monkeypatch.setattr(DistributedDataParallel, "no_sync", counting_no_sync)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, accumulate_grad_batches=accumulate,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    with metered_all_reduce() as traffic:
        trainer.fit(BoringModel())
    return dict(traffic.bytes_by_dtype), len(entered)


def test_fp16_hook_runs_on_cpu_and_accumulation_uses_no_sync(monkeypatch: pytest.MonkeyPatch, restore_env: None) -> None:
    by_dtype, no_sync = _fit(CommDDPStrategy(comm_hook="fp16", process_group_backend="gloo"), monkeypatch)
    # 3 optimizer steps x 2 micro-batches: the first of each pair under no_sync, and
    # one fp16 all-reduce of every gradient per optimizer step.
    assert no_sync == 3
    assert by_dtype.get("float16") == 3 * PARAMS * 2


def test_a_registered_name_trains_like_the_recipe_option(monkeypatch: pytest.MonkeyPatch, restore_env: None) -> None:
    # Trainer(strategy="ddp_fp16") in a user's own script: the fp16 hook runs, as with strategy=ddp_fp16 in a recipe.
    by_dtype, no_sync = _fit("ddp_fp16", monkeypatch)
    assert no_sync == 3
    assert by_dtype.get("float16") == 3 * PARAMS * 2


@pytest.mark.parametrize("name", ["ddp_fp16", "ddp_bf16", "ddp_powersgd"])
def test_registered_names_build_what_the_recipe_options_build(name: str) -> None:
    # The registry entry and conf/strategy/<name>.yaml (with the ddp.yaml it inherits) agree key for key ...
    cfg = compose_recipe("gpt-tiny_cpu", [f"strategy={name}"])
    node = OmegaConf.to_container(cfg.strategy)
    assert isinstance(node, dict)
    target = node.pop("_target_")
    entry = StrategyRegistry[name]
    assert f"{entry['strategy'].__module__}.{entry['strategy'].__qualname__}" == target
    assert entry["init_params"] == node == COMM_VARIANTS[name][1]
    # ... so a plain Trainer given the name holds the strategy a recipe run builds.
    by_name = pl.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False).strategy
    from_recipe = build_strategy(cfg)
    assert type(by_name) is type(from_recipe) is CommDDPStrategy
    assert by_name.comm_hook == from_recipe.comm_hook and by_name.comm_hook.name == name.removeprefix("ddp_")
    assert by_name._ddp_kwargs == from_recipe._ddp_kwargs


def test_lightning_ddp_strategy_drops_the_hook_on_cpu(monkeypatch: pytest.MonkeyPatch, restore_env: None) -> None:
    # Why CommDDPStrategy exists: Lightning registers comm hooks only on CUDA.
    strategy = DDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook, process_group_backend="gloo")
    by_dtype, no_sync = _fit(strategy, monkeypatch)
    assert no_sync == 3
    assert "float16" not in by_dtype


def test_comm_ddp_strategy_refuses_lightning_hook_arguments() -> None:
    with pytest.raises(UserError, match=r"takes the hook by name, not ddp_comm_hook=.*comm_hook=fp16"):
        CommDDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook)


def _strategy(overrides: list[str]):  # type: ignore[no-untyped-def]
    cfg = compose_recipe("gpt-tiny_cpu", overrides)
    return cfg.strategy, str(cfg.trainer.accelerator)


def test_shipped_comm_options_pass_on_cpu() -> None:
    for option in ("ddp", "ddp_fp16", "ddp_powersgd", "auto"):
        check_comm_strategy(*_strategy([f"strategy={option}"]))


def test_bf16_hook_on_cpu_is_refused_before_any_work() -> None:
    with pytest.raises(UserError, match=r"comm_hook=bf16 needs CUDA.*accelerator is cpu.*strategy=ddp_fp16"):
        check_comm_strategy(*_strategy(["strategy=ddp_bf16"]))


def test_unknown_hook_in_a_recipe_override() -> None:
    with pytest.raises(UserError, match=r"comm_hook='powersdg'.*did you mean 'powersgd'"):
        check_comm_strategy(*_strategy(["strategy=ddp_fp16", "strategy.comm_hook=powersdg"]))


def test_comm_hook_on_a_non_ddp_strategy_is_refused() -> None:
    node = {"_target_": "lightning.pytorch.strategies.FSDPStrategy", "comm_hook": "fp16"}
    with pytest.raises(UserError, match=r"strategy.comm_hook=fp16 needs a DDP strategy.*FSDPStrategy.*strategy=ddp_fp16"):
        check_comm_strategy(node, "cuda")


def test_lightning_hook_on_cpu_is_refused() -> None:
    strategy, accelerator = _strategy(["strategy=ddp", "+strategy.ddp_comm_hook={_target_: torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook, _partial_: true}"])
    with pytest.raises(UserError, match=r"registers DDP comm hooks only on CUDA.*accelerator=cpu.*strategy=ddp_fp16"):
        check_comm_strategy(strategy, accelerator)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16 hook needs CUDA with NCCL")
def test_bf16_hook_allowed_on_cuda() -> None:
    check_comm_strategy(*_strategy(["strategy=ddp_bf16", "accelerator=gpu"]))
