"""Every shipped recipe composes, validates, and says how to run it on line 1."""

from __future__ import annotations

import re

import pytest

from lightning_accel.config.compose import compose_recipe, recipe_names, resolve_recipe
from lightning_accel.config.locate import conf_dir
from lightning_accel.config.validate import validate

RECIPES = recipe_names()


def test_there_are_recipes_for_each_required_setup() -> None:
    # The foundation's four: default CPU GPT, 1-GPU bf16 + accumulation, multi-GPU DDP, CPU CNN.
    assert {"gpt-tiny_cpu", "gpt-small_bf16-accum_1gpu", "gpt-small_ddp_4gpu", "resnet-tiny_cpu"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_and_validates(name: str) -> None:
    cfg = compose_recipe(name)
    targets = validate(cfg)
    assert any(t.startswith("trainer:") for t in targets)
    assert any(t.startswith("model:") for t in targets)
    assert cfg.recipe.purpose, f"{name}: recipe.purpose is what `ls` shows; fill it in"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_first_line_is_its_command(name: str) -> None:
    first = resolve_recipe(name).read_text().splitlines()[0]
    assert first == f"# lightning-accel run {name}"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_is_global_package_extending_train(name: str) -> None:
    text = resolve_recipe(name).read_text()
    assert "# @package _global_" in text.splitlines()[:3]
    assert "  - train\n" in text


def test_config_groups_exist() -> None:
    groups = {p.name for p in conf_dir().iterdir() if p.is_dir() and not p.name.startswith("_")}
    required = {"trainer", "model", "data", "strategy", "precision", "callbacks", "logger", "accelerator",
                "hparams_search", "launcher", "paths"}
    assert required <= groups


def test_override_reaches_the_composed_config() -> None:
    cfg = compose_recipe("gpt-tiny_cpu", ["trainer.max_steps=7", "precision=bf16-mixed", "model.net.preset=small"])
    assert cfg.trainer.max_steps == 7
    assert cfg.trainer.precision == "bf16-mixed"
    assert cfg.model.net.preset == "small"
    # interpolations follow the override: the LR schedule spans the new step count
    assert cfg.model.scheduler.total_steps == 7


def test_recipe_file_path_is_accepted(tmp_path) -> None:
    copy = tmp_path / "mine.yaml"
    copy.write_text(resolve_recipe("resnet-tiny_cpu").read_text())
    cfg = compose_recipe(str(copy), ["trainer.max_steps=3"])
    assert cfg.trainer.max_steps == 3 and cfg.data._target_.endswith("ShapesDataModule")



def test_offload_precision_option_reaches_the_plugins() -> None:
    # precision=offload-* sets `plugins`; train.yaml's own `plugins: []` must not override it
    # (it did while train.yaml listed _self_ last: the L2L recipes trained with fp32 copies)
    seen = []
    for name in RECIPES:
        cfg = compose_recipe(name, with_hydra=True)
        choice = cfg.hydra.runtime.choices.get("precision") or ""
        if choice.startswith("offload-"):
            (plugin,) = cfg.plugins
            assert plugin._target_.endswith("OffloadPrecision") and plugin.precision == choice.removeprefix("offload-"), name
            seen.append(name)
    assert {"gpt-tiny_l2l_cpu", "gpt-5b_l2l-bf16_1gpu"} <= set(seen)


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_passes_preflight_here_or_its_cpu_override_does(name: str) -> None:
    """CPU recipes pass every check on this machine; a GPU recipe on a machine without its
    GPUs is refused with an override that runs it on the CPU, and that override passes."""
    import torch

    from lightning_accel.config.errors import UserError
    from lightning_accel.config.preflight import preflight
    from lightning_accel.config.validate import cpu_override, devices_needed

    cfg = compose_recipe(name)
    accelerator = str(cfg.trainer.accelerator)
    if accelerator in ("tpu", "xla", "xla_pjrt"):
        pytest.skip("XLA recipes are checked in tests/accelerators (their own environment)")
    if accelerator in ("gpu", "cuda") and torch.cuda.device_count() < devices_needed(cfg):
        with pytest.raises(UserError, match=f"needs {devices_needed(cfg)} CUDA GPU") as refused:
            preflight(name, [])
        override = re.search(r"or override (.*)$", str(refused.value)).group(1)
        assert override == cpu_override(compose_recipe(name, with_hydra=True))
        try:
            preflight(name, override.split())
        except UserError as err:  # a model larger than this machine's memory (a 7B in fp32 masters here): said so, with its fix
            assert "the network's parameters alone are" in str(err) and "strategy.nvme_path=DIR" in str(err), err
    else:
        preflight(name, [])
