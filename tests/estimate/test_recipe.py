"""Recipes through the whole estimate: the strategy's plan read from the recipe, per rank kind."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.config.compose import compose_recipe
from lightning_accel.estimate import estimate_recipe
from lightning_accel.runner import build_model

SMALL = ["data.batch_size=16", "data.block_size=32"]


def test_pipeline_stages_split_the_model_as_the_recipe_balances_it() -> None:
    recipe = "gpt-small_gpipe-1f1b_4gpu"
    estimate = estimate_recipe(recipe, SMALL)
    assert [(r.kind, r.count) for r in estimate.ranks] == [("stage 0", 1), ("stage 1", 1), ("stage 2", 1), ("stage 3", 1)]
    with torch.device("meta"):
        numel = sum(p.numel() for p in build_model(compose_recipe(recipe, SMALL)).parameters())
    params = [r.device["parameters"] for r in estimate.ranks]
    assert sum(params) == 4 * numel  # fp32 parameters under bf16-mixed, each on exactly one stage
    assert params[1] == params[2]  # balance [1, 2, 2, 1]: two equal blocks each
    key = "activations (16 micro-batches, 1f1b, checkpoint never)"
    assert all(key in r.device for r in estimate.ranks)


def test_l2l_ddp_ranks_each_step_half_the_blocks() -> None:
    (rank,) = estimate_recipe("gpt-tiny_l2l_cpu", [*SMALL, "strategy=l2l_offload_ddp", "trainer.devices=2"]).ranks
    assert rank.count == 2
    with torch.device("meta"):
        net = build_model(compose_recipe("gpt-tiny_l2l_cpu", SMALL)).net
    blocks = sum(p.numel() for p in net.blocks.parameters())
    assert rank.host["masters (fp32)"] == 4 * blocks  # every process keeps the whole host store
    # 4 equal blocks, 2 owned by each rank: AdamW's two fp32 moments (and a step count) for half of them
    assert rank.host["optimizer state"] == pytest.approx(8 * blocks / 2, rel=0.01)


def test_xla_spmd_shards_the_batch_over_its_devices_and_says_the_chip_it_judges_by() -> None:
    overrides = ["data.batch_size=8", "data.block_size=32"]
    spmd = estimate_recipe("gpt-small_bf16-spmd_4tpu", overrides)
    one = estimate_recipe("gpt-small_bf16_1tpu", ["data.batch_size=2", "data.block_size=32"])
    assert [(r.kind, r.count) for r in spmd.ranks] == [("xla device", 4), ("host process", 1)]
    assert spmd.ranks[0].device["activations"] == one.ranks[0].device["activations"]  # 8 rows over 4 chips: 2 each
    assert spmd.device_memory == 32 * 2**30 and "(the recipe's purpose: TPU v4)" in spmd.verdict()


def test_a_gpu_recipe_stating_no_size_is_judged_by_this_machine_s_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 * 2**30, "name": "NVIDIA H100"})())
    estimate = estimate_recipe("gpt-small_bf16-accum_1gpu", ["data.batch_size=2", "data.block_size=32"])
    assert estimate.device_memory == 80 * 2**30 and "(this machine's NVIDIA H100): fits" in estimate.verdict()


def test_the_module_preflight_built_is_the_one_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_accel.runner as runner

    built = []

    def build(cfg: object) -> object:
        built.append(runner_build(cfg))
        return built[-1]

    runner_build = runner.build_model
    monkeypatch.setattr(runner, "build_model", build)
    estimate = estimate_recipe("gpt-tiny_cpu", SMALL)
    assert len(built) == 1 and estimate.ranks  # preflight's build, not a second one
