"""Strategy names Fabric resolves to a one-line refusal: the strategies that exist for the Trainer only.

Registering it keeps ``Fabric(strategy="gpipe_distributed")`` from failing with Fabric's list of valid names,
which would hide that the strategy exists and where: the refusal says why it does not carry over and what to use.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import SingleDeviceStrategy, Strategy

__all__ = ["TRAINER_ONLY"]


def _trainer_only(name: str, why: str, fix: str) -> type:
    """A Fabric strategy class that refuses, when ``Fabric(strategy=name)`` builds it, with ``why`` and ``fix``."""

    def __init__(self: Strategy, *args: Any, **kwargs: Any) -> None:
        raise ValueError(f"Fabric(strategy={name!r}) is not available: {why}; {fix}")

    cls_name = "".join(part.capitalize() for part in name.split("_")) + "TrainerOnly"
    return type(cls_name, (SingleDeviceStrategy,), {"__init__": __init__, "strategy_name": name, "__module__": __name__})


TRAINER_ONLY: list[tuple[str, type, str]] = [
    ("gpipe_distributed", _trainer_only(
        "gpipe_distributed",
        "its whole-step pipeline runs the LightningModule's training_step (loss and backward) on the stage ranks, "
        "and a Fabric loop computes its loss and calls fabric.backward outside any strategy hook",
        "use Trainer(strategy='gpipe_distributed'), or Fabric(strategy='gpipe') for micro-batching in one process"),
     "refused under Fabric: use Trainer(strategy='gpipe_distributed') or Fabric(strategy='gpipe')"),
]
