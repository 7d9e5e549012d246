"""Bad values by class, generated for every key of a kind rather than listed by example: every numeric and enumerated
key of the Trainer's schema (:func:`lightning_accel.config.schema.schema_for`, from ``Trainer``'s own signature), every
config group's option, and the run's own top-level settings. Each bad value is refused in one line naming the key and
the value, before any work; the example each line gives, applied, passes that check; and what our checks let through,
Lightning's ``Trainer`` takes too."""

from __future__ import annotations

import inspect
import math
import re

import lightning.pytorch as pl
import pytest
import yaml

from lightning_accel.config.compose import compose_recipe
from lightning_accel.config.errors import UserError
from lightning_accel.config.locate import conf_dir
from lightning_accel.config.loop_checks import LOOP_KEYS, check_loop, check_run_options, check_trainer
from lightning_accel.config.preflight import _compose
from lightning_accel.config.compose import resolve_recipe
from lightning_accel.config.schema import TRAINER_SUPPLIED

# what the Trainer's own signature says takes a number or a choice of words
_SIGNATURE = inspect.signature(pl.Trainer)
NUMERIC = sorted(name for name, p in _SIGNATURE.parameters.items()
                 if name not in TRAINER_SUPPLIED and re.search(r"\b(int|float)\b", str(p.annotation)))
ENUMERATED = sorted(name for name, p in _SIGNATURE.parameters.items()
                    if name not in TRAINER_SUPPLIED and "Literal" in str(p.annotation))
# numeric keys whose every value is checked elsewhere: the hardware (devices, by check_launchable too), and the precision
# (an enumerated choice that also reads as a number, 16 / 32 / 64)
ELSEWHERE = {"precision"}
VALUES = [-2, -1, 0, 1, 3, 0.5, 1.5, -0.5, math.nan, math.inf, "abc", True]


def test_every_numeric_and_enumerated_trainer_key_has_a_rule() -> None:
    missing = sorted(set(NUMERIC + ENUMERATED) - set(LOOP_KEYS) - ELSEWHERE)
    assert NUMERIC and not missing, f"Trainer keys taking numbers or choices with no rule in LOOP_KEYS: {missing}"


@pytest.mark.parametrize("key", sorted(set(NUMERIC + ENUMERATED) & set(LOOP_KEYS)))
def test_each_bad_value_is_one_line_its_example_passes_and_what_passes_lightning_takes(key: str) -> None:
    rule = LOOP_KEYS[key]
    base = {"max_steps": 10, "max_epochs": None} if key not in ("max_steps", "max_epochs") else {}
    for value in [*VALUES, "warn", "norm", "value"]:
        trainer = {**base, key: value}
        if rule.ok(value):
            if key not in ("devices", "min_steps", "min_epochs") and not (key == "val_check_interval" and isinstance(value, float)):
                check_trainer(trainer)  # what our rule takes, Lightning's Trainer takes too (the pairs have their own test)
            continue
        with pytest.raises(UserError) as raised:
            check_loop(trainer)
        line = str(raised.value)
        assert "\n" not in line and line.startswith(f"trainer.{key}=") and f"e.g. trainer.{key}={rule.example}" in line, line
    example = yaml.safe_load(rule.example)  # the fix every line of this key offers, as Hydra would read it
    check_trainer({**base, key: example})


@pytest.mark.parametrize("key", ["keep_failed", "interrupt_grace_s"])
def test_the_runs_own_settings_refuse_each_bad_value_and_the_example_passes(key: str) -> None:
    bad = {"keep_failed": ["yes", 1, 0.5], "interrupt_grace_s": [0, -1, math.nan, math.inf, "2m", True]}[key]
    for value in bad:
        with pytest.raises(UserError) as raised:
            check_run_options({key: value})
        line = str(raised.value)
        assert "\n" not in line and line.startswith(f"{key}=") and "; pass" in line, line
        example = re.search(rf"e\.g\. {key}=(\S+)|{key}=(true|false) or", line)
        assert example is not None, line
        check_run_options({key: yaml.safe_load(example.group(1) or example.group(2))})


GROUPS = sorted(d.name for d in conf_dir().iterdir() if d.is_dir() and not d.name.startswith("_") and any(d.glob("*.yaml")))


@pytest.mark.parametrize("group", GROUPS)
def test_every_config_group_refuses_an_unknown_option_and_its_example_composes(group: str) -> None:
    path = resolve_recipe("gpt-tiny_cpu")
    with pytest.raises(UserError) as raised:
        _compose(path, [f"{group}=no_such_option"])
    line = str(raised.value)
    assert "\n" not in line and f"'no_such_option'" in line and group in line, line
    example = re.search(rf"\(e\.g\. ({re.escape(group)}=[\w.-]+)\)", line)
    assert example is not None, line
    compose_recipe(path, [example.group(1)], with_hydra=True)  # the fix it offers composes
