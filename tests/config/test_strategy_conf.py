"""Config conventions: a strategy is chosen one way (an option whose node has a ``_target_``,
or ``auto``: no node), XLA has its option like the others, and L2L offload's precision is
its own plugin, paired before any work."""

from __future__ import annotations

import pytest
import yaml

from lightning_accel.config.compose import compose_recipe, recipe_names
from lightning_accel.config.errors import UserError, one_line
from lightning_accel.config.locate import conf_dir
from lightning_accel.config.preflight import check_offload_precision, preflight
from lightning_accel.config.validate import strategy_options, validate
from lightning_accel.plugins.precision import OffloadPrecision
from lightning_accel.runner import build_strategy
from lightning_accel.strategies import L2LOffloadStrategy


def _node(option: str) -> dict:
    """The composed strategy node of an option, following its defaults (ddp_fp16 extends ddp)."""
    cfg = compose_recipe("gpt-tiny_cpu", [f"strategy={option}"] + (["accelerator=xla"] if option == "xla_pjrt" else []))
    return cfg.strategy


@pytest.mark.parametrize("option", strategy_options())
def test_every_strategy_option_builds_by_target_or_is_auto(option: str) -> None:
    node = _node(option)
    if option == "auto":
        assert node is None and build_strategy(compose_recipe("gpt-tiny_cpu")) == "auto"
    else:
        assert "_target_" in node and "name" not in node, option


def test_recipes_choose_a_strategy_option_and_xla_recipes_the_xla_one() -> None:
    from lightning_accel.config.compose import resolve_recipe

    xla = []
    for name in recipe_names():
        cfg = compose_recipe(name, with_hydra=True)
        choice = cfg.hydra.runtime.choices.strategy
        assert choice in strategy_options(), f"{name}: strategy={choice}, not an option (override /strategy: null?)"
        recipe = yaml.safe_load(resolve_recipe(name).read_text())
        assert "_target_" not in (recipe.get("strategy") or {}), f"{name}: choose strategy=<option> instead of a _target_"
        if cfg.trainer.accelerator == "xla_pjrt":
            assert choice == "xla_pjrt", name
            xla.append(name)
    assert {"gpt-small_bf16_1tpu", "resnet-tiny_1tpu", "gpt-small_bf16-spmd_4tpu"} <= set(xla)
    assert "strategy=xla_pjrt" in (conf_dir() / "accelerator" / "xla.yaml").read_text()


@pytest.mark.parametrize(("overrides", "message"), [
    (["accelerator=xla"], r"trainer.accelerator=xla_pjrt runs only under the xla_pjrt strategy, not strategy=auto; add strategy=xla_pjrt"),
    (["accelerator=xla", "strategy=ddp"], r"not DDPStrategy; add strategy=xla_pjrt"),
    (["strategy=xla_pjrt"], r"strategy=xla_pjrt needs trainer.accelerator=xla_pjrt, not cpu; add accelerator=xla"),
])
def test_xla_accelerator_and_strategy_only_together(overrides: list[str], message: str) -> None:
    with pytest.raises(UserError, match=message):
        validate(compose_recipe("gpt-tiny_cpu", overrides))


@pytest.mark.parametrize(("name", "fix"), [
    ("ddp", r"use strategy=ddp$"),
    ("l2l_offload", r"use strategy=l2l_offload$"),
    # a Lightning name without an option of ours: its registered class, with the registry's arguments
    ("ddp_spawn", r"use \+strategy._target_=lightning.pytorch.strategies.ddp.DDPStrategy \+strategy.start_method=spawn$"),
    ("dpp", r"use one of the options \(did you mean 'ddp'.*\): auto, ddp"),
])
def test_a_strategy_chosen_by_name_is_refused_with_the_option_or_class(name: str, fix: str) -> None:
    cfg = compose_recipe("gpt-tiny_cpu", [f"+strategy.name={name}"])
    with pytest.raises(UserError, match=rf"strategy.name='{name}': a strategy is chosen by option or by _target_, not by name; {fix}"):
        validate(cfg)


def test_strategy_keys_without_a_class_are_refused() -> None:
    with pytest.raises(UserError, match=r"strategy.chunks is set but the strategy node has no _target_ \(strategy=auto builds none\); choose"):
        validate(compose_recipe("gpt-tiny_cpu", ["+strategy.chunks=4"]))


def test_the_by_name_fix_builds_what_lightning_would() -> None:
    """The override the refusal gives for a Lightning name builds the registry's class and arguments."""
    from lightning.pytorch.strategies import DDPStrategy

    cfg = compose_recipe("gpt-tiny_cpu", ["+strategy._target_=lightning.pytorch.strategies.ddp.DDPStrategy",
                                          "+strategy.start_method=spawn"])
    validate(cfg)
    built = build_strategy(cfg)
    assert type(built) is DDPStrategy and built._start_method == "spawn"


# --- L2L offload and its precision ---------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["l2l_offload", "l2l_offload_ddp"])
@pytest.mark.parametrize("flag", ["bf16-true", "64-true"])
def test_l2l_offload_refuses_a_precision_that_changes_the_masters(strategy: str, flag: str) -> None:
    # the strategy's own refusal (when the Trainer is built), said before launch
    with pytest.raises(UserError, match=rf"^trainer.precision={flag}: strategy={strategy} keeps fp32 masters on the host and "
                                        r"makes only the device copies low precision; use precision=bf16-mixed, 16-mixed or 32-true$"):
        preflight("gpt-tiny_cpu", [f"strategy={strategy}", f"precision={flag}"], launch=False)


@pytest.mark.parametrize("flag", ["bf16-mixed", "16-mixed", "32-true"])
def test_l2l_offload_takes_a_lightning_mixed_flag(flag: str) -> None:
    # the strategy pairs bf16-mixed/16-mixed with its offload plugin itself (tests/strategies/test_l2l_offload.py)
    preflight("gpt-tiny_cpu", ["strategy=l2l_offload", f"precision={flag}"], launch=False)


def test_the_offload_option_passes() -> None:
    preflight("gpt-tiny_cpu", ["strategy=l2l_offload", "precision=offload-bf16-mixed"], launch=False)


def test_offload_precision_and_a_lightning_flag_both_set() -> None:
    with pytest.raises(UserError, match=r"trainer.precision=bf16-mixed and precision=offload-bf16-mixed are both set; keep one"):
        preflight("gpt-tiny_l2l_cpu", ["precision=offload-bf16-mixed", "trainer.precision=bf16-mixed"], launch=False)


def test_offload_precision_without_the_offload_strategy() -> None:
    with pytest.raises(UserError, match=r"precision=offload-32-true is for strategy=l2l_offload or l2l_offload_ddp, but the strategy is auto; use precision=32-true"):
        preflight("gpt-tiny_l2l_cpu", ["strategy=auto"], launch=False)


def test_check_offload_precision_on_objects() -> None:
    """The same rule on built objects, as a user's own launcher would call it."""
    strategy = L2LOffloadStrategy()
    check_offload_precision(strategy, [OffloadPrecision("bf16-mixed")], None)
    check_offload_precision(strategy, [], "32-true")
    check_offload_precision(strategy, [], 16)  # Lightning's 16 is 16-mixed: the strategy pairs it
    check_offload_precision(None, [], "bf16-mixed")  # no offload anywhere: nothing to pair
    with pytest.raises(UserError, match=r"^trainer.precision=bf16-true: strategy=l2l_offload keeps fp32 masters"):
        check_offload_precision(strategy, [], "bf16-true")


# --- one hint style ------------------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "shown"), [
    ("x=2 is not a multiple of 4. HINT: set x=4", "x=2 is not a multiple of 4; set x=4"),
    ("x=3 has no effect; HINT: set y=True", "x=3 has no effect; set y=True"),
    ("already in shape; choose one of: a, b", "already in shape; choose one of: a, b"),
    ("first line. HINT: fix\nsecond line", "first line; fix"),
])
def test_one_line_brings_a_hint_to_the_config_shape(raw: str, shown: str) -> None:
    assert one_line(raw) == shown


def test_a_strategy_hint_reaches_the_user_in_the_config_shape() -> None:
    """DistributedGPipeStrategy says '... HINT: ...'; preflight shows it as '...; ...'."""
    with pytest.raises(UserError) as refused:
        preflight("gpt-tiny_gpipe-2proc_cpu", ["data.batch_size=1"], launch=False)
    assert str(refused.value) == (
        "data.batch_size=1: DistributedGPipeStrategy(chunks=4, schedule='1f1b'): the training DataLoader's batch_size of "
        "1 cannot be split into equal micro-batches that '1f1b' runs on 2 stages (it needs at least 2); use a batch_size "
        "of at least 2, or schedule='gpipe'"
    )
