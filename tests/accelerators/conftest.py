"""XLA tests run on the CPU PJRT device and compare against plain CPU training.

:func:`tests.support.xla_regression.fit` trains a small regression the same way on the CPU and on an XLA device.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from tests.support.xla_regression import Regression, fit, loader, losses, register


def xla_skip_reason() -> str | None:
    """Why the ``xla`` tests cannot run here, or ``None``."""
    try:
        import torch_xla  # noqa: F401
    except ImportError as err:
        return f"torch_xla is not importable ({err}); run these in the xla environment (.ci/xla-lane)"
    if os.environ.get("PJRT_DEVICE", "").upper() != "CPU":
        return "the xla tests compare against the CPU and need PJRT_DEVICE=CPU (set it before starting pytest)"
    return None


@pytest.fixture
def xla_cpu_available() -> None:
    """Skip unless torch_xla is importable and PJRT_DEVICE=CPU (for tests that run it in a subprocess)."""
    reason = xla_skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def xla() -> SimpleNamespace:
    """Skip unless torch_xla runs on the CPU PJRT device; register our names; the fit helpers."""
    reason = xla_skip_reason()
    if reason:
        pytest.skip(reason)
    import torch_xla

    # Start the runtime before any backward pass: autograd sizes its per-device queues
    # at the first backward, and an XLA backward after a CPU-only one trips its assert.
    torch_xla.device()
    register()
    return SimpleNamespace(fit=fit, losses=losses, loader=loader, Regression=Regression)
