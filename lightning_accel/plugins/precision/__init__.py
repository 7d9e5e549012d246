"""Precision plugins."""

from lightning_accel.plugins.precision.offload import OffloadPrecision

__all__ = ["OffloadPrecision"]
