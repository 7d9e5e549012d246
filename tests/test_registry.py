"""Importing lightning_accel registers strategy names, idempotently."""

from __future__ import annotations

import importlib

import pytest
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.fabric.strategies.registry import _StrategyRegistry

import lightning_accel
from lightning_accel import _registry
from lightning_accel.strategies.ddp_comm import COMM_VARIANTS, CommDDPStrategy, register_comm_variants


def test_import_twice_does_not_raise() -> None:
    importlib.reload(_registry)
    importlib.reload(lightning_accel)
    for name, cls, _ in _registry.STRATEGIES:
        assert StrategyRegistry[name]["strategy"] is cls
    for name, (_, arguments) in COMM_VARIANTS.items():
        assert StrategyRegistry[name]["strategy"] is CommDDPStrategy and StrategyRegistry[name]["init_params"] == arguments


def test_comm_variants_register_idempotently_with_their_arguments() -> None:
    registry = _StrategyRegistry()
    assert register_comm_variants(registry) == register_comm_variants(registry) == ["ddp_fp16", "ddp_bf16", "ddp_powersgd"]
    assert registry["ddp_powersgd"]["init_params"]["comm_hook"] == "powersgd"


def test_register_is_idempotent_and_refuses_a_clash() -> None:
    registry = _StrategyRegistry()

    class Mine(SingleDeviceStrategy):
        pass

    class Other(SingleDeviceStrategy):
        pass

    _registry.register(registry, "mine", Mine, "test")
    _registry.register(registry, "mine", Mine, "test")  # second import: no error
    assert registry["mine"]["strategy"] is Mine
    with pytest.raises(ValueError, match=r"strategy name 'mine' is already registered to .*Mine.*; remove the other registration"):
        _registry.register(registry, "mine", Other, "test")
