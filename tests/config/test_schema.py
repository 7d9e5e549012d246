"""Schemas generated from signatures: same defaults as the callable, typos and types fail."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from lightning_accel.config.schema import TRAINER_SUPPLIED, schema_for


@pytest.mark.parametrize("target", [Trainer, ModelCheckpoint])
def test_schema_defaults_equal_signature_defaults(target) -> None:
    schema = schema_for(target, exclude=TRAINER_SUPPLIED)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    params = inspect.signature(target).parameters
    assert fields.pop("_target_").default == f"{target.__module__}.{target.__qualname__}"
    for name, field in fields.items():
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        expected = params[name].default
        assert default == (expected.value if hasattr(expected, "value") else expected), name


def test_trainer_schema_leaves_out_what_other_groups_supply() -> None:
    names = {f.name for f in dataclasses.fields(schema_for(Trainer, exclude=TRAINER_SUPPLIED))}
    assert not names & set(TRAINER_SUPPLIED)
    assert {"max_steps", "precision", "accumulate_grad_batches"} <= names


def test_unknown_key_and_wrong_type_fail() -> None:
    cfg = OmegaConf.structured(schema_for(Trainer, exclude=TRAINER_SUPPLIED))
    with pytest.raises(ConfigKeyError, match="max_stepz"):
        OmegaConf.merge(cfg, {"max_stepz": 3})
    with pytest.raises(ValidationError, match="could not be converted to Integer"):
        OmegaConf.merge(cfg, {"max_steps": "many"})


def test_types_follow_annotations() -> None:
    def f(a: int, b: Optional[float] = None, c: "int | str" = 1, d: bool = True) -> None: ...

    types = {f.name: f.type for f in dataclasses.fields(schema_for(f))}
    assert types["a"] is int and types["d"] is bool
    assert types["b"] == Optional[float]
    assert types["c"] is not int  # a union OmegaConf cannot check becomes Any
    assert dataclasses.fields(schema_for(f))[1].default == "???"  # required stays required


def test_callable_with_var_kwargs_is_refused() -> None:
    def g(x: int = 1, **kwargs: int) -> None: ...

    with pytest.raises(TypeError, match=r"takes \*\*kwargs"):
        schema_for(g)
