"""Each kind of bad input becomes one line that names the value and the fix."""

from __future__ import annotations

import pytest

from lightning_accel.config.compose import compose_recipe, resolve_recipe
from lightning_accel.config.errors import UserError, explain
from lightning_accel.config.preflight import preflight
from lightning_accel.config.validate import check_launchable, validate


def _line(recipe: str, overrides: list[str]) -> str:
    with pytest.raises(Exception) as info:
        validate(compose_recipe(recipe, overrides))
    line = explain(info.value)
    assert line is not None and "\n" not in line
    return line


def test_unknown_recipe_suggests_close_names() -> None:
    with pytest.raises(UserError, match=r"unknown recipe 'gpt-tny_cpu' \(did you mean 'gpt-tiny_cpu'"):
        resolve_recipe("gpt-tny_cpu")


def test_missing_recipe_file() -> None:
    with pytest.raises(UserError, match=r"recipe file 'nope/x.yaml' does not exist"):
        resolve_recipe("nope/x.yaml")


def test_unknown_group_option() -> None:
    line = _line("gpt-tiny_cpu", ["model=gtp"])
    assert line.startswith("unknown model option 'gtp' (did you mean 'gpt'?)")
    assert "choose one of: cnn, gpt" in line


def test_unknown_key_in_schema_group() -> None:
    assert "unknown key 'trainer.max_stepz' in trainer (did you mean 'max_steps'" in _line("gpt-tiny_cpu", ["trainer.max_stepz=3"])


def test_unknown_key_in_plain_group() -> None:
    assert "unknown key 'model.net.presett' in model.net (did you mean 'preset'?)" in _line("gpt-tiny_cpu", ["model.net.presett=x"])


def test_wrong_type() -> None:
    line = _line("gpt-tiny_cpu", ["trainer.max_steps=abc"])
    assert line.startswith("trainer.max_steps: Value 'abc'") and "pass a whole number" in line


def test_missing_mandatory_value() -> None:
    with pytest.raises(Exception) as info:
        preflight("gpt-tiny_cpu", ["data=text_file"])
    assert "data.path is required" in explain(info.value)


def test_missing_user_file() -> None:
    with pytest.raises(UserError, match=r"/definitely/not/here.txt"):
        preflight("gpt-tiny_cpu", ["data=text_file", "data.path=/definitely/not/here.txt"])


def test_unknown_target_suggests_close_class() -> None:
    with pytest.raises(UserError, match=r"model.net._target_ 'lightning_accel.models.GTP' does not exist.*did you mean 'GPT'"):
        validate(compose_recipe("gpt-tiny_cpu", ["model.net._target_=lightning_accel.models.GTP"]))


def test_argument_that_does_not_bind() -> None:
    with pytest.raises(UserError, match=r"model.net.n_layers is not an argument of lightning_accel.models.GPT \(did you mean 'n_layer'"):
        validate(compose_recipe("gpt-tiny_cpu", ["+model.net.n_layers=2"]))


def test_bad_precision_flag() -> None:
    with pytest.raises(UserError, match=r"trainer.precision='bf16-mixd' is not a Lightning precision \(did you mean 'bf16-mixed'"):
        validate(compose_recipe("gpt-tiny_cpu", ["trainer.precision=bf16-mixd"]))


def test_bad_strategy_option() -> None:
    assert _line("gpt-tiny_cpu", ["strategy=dpp"]).startswith("unknown strategy option 'dpp' (did you mean 'ddp'?); choose one of: auto, ddp")


def test_recipe_for_absent_hardware_validates_but_cannot_launch() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the absent-hardware path is tested on CPU-only machines")
    cfg = compose_recipe("gpt-small_bf16-accum_1gpu")
    validate(cfg)  # composes and validates anywhere
    with pytest.raises(UserError, match=r"needs 1 CUDA GPU\(s\).*this machine has 0; run it on a GPU machine, or override accelerator=cpu"):
        check_launchable(cfg, "gpt-small_bf16-accum_1gpu")


def test_missing_checkpoint_to_resume() -> None:
    with pytest.raises(UserError, match=r"ckpt_path='/no/such.ckpt' does not exist"):
        preflight("gpt-tiny_cpu", ["ckpt_path=/no/such.ckpt"])
