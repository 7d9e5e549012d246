"""Checkpoint IO plugins."""

from lightning_accel.plugins.io.atomic import AtomicCheckpointIO

__all__ = ["AtomicCheckpointIO"]
