"""Accelerators: torch_xla on any PJRT device (TPU, CUDA GPU, or the CPU).

``register_accelerators()`` adds the name ``"xla_pjrt"`` to Lightning's
AcceleratorRegistry, idempotently; it imports nothing from torch_xla.
"""

from __future__ import annotations

from typing import Any

from lightning_accel.accelerators.runtime import XLAUnavailableError, xla_problem
from lightning_accel.accelerators.xla_pjrt import XLAPJRTAccelerator

__all__ = ["XLAPJRTAccelerator", "XLAUnavailableError", "register_accelerators", "xla_problem"]


def register_accelerators(registry: Any = None) -> list[str]:
    """Register ``"xla_pjrt"`` with Lightning's AcceleratorRegistry (a no-op if already there)."""
    if registry is None:
        from lightning.pytorch.accelerators import AcceleratorRegistry as registry
    name = XLAPJRTAccelerator.name()
    if name not in registry:
        XLAPJRTAccelerator.register_accelerators(registry)
    return [name]
