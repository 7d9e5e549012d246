"""Checking torch_xla and the PJRT device before any work, with the fix in one line.

torch_xla fails late and far from the cause: a missing install is an ImportError deep in
Lightning, a torch/torch_xla mismatch an undefined symbol in a C extension, and an unset
``PJRT_DEVICE`` silently becomes the CPU (with a log warning). :func:`xla_problem` finds
each of these up front, without starting the PJRT runtime (which, once started on the
wrong device, cannot be restarted in the same process).
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

# torch_xla X.Y.* is built against torch X.Y.* exactly; the `xla` extra pins both.
XLA_PIN = "torch==2.9.0 torch_xla==2.9.0"
INSTALL_HINT = f"pip install \"lightning_accel[xla]\" (or: pip install {XLA_PIN}) in its own virtual environment"
PJRT_HINT = "PJRT_DEVICE=TPU on a TPU VM, PJRT_DEVICE=CUDA on NVIDIA GPUs, PJRT_DEVICE=CPU anywhere (slow, for tests)"


class XLAUnavailableError(RuntimeError):
    """torch_xla is missing, does not match torch, or has no PJRT device to run on."""


def _minor(v: str) -> str:
    return ".".join(v.split("+")[0].split(".")[:2])


def _installed(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def xla_problem(environ: dict[str, str] | None = None) -> str | None:
    """Why the ``xla_pjrt`` accelerator cannot start here, as one line with the fix; ``None`` if it can."""
    env = os.environ if environ is None else environ
    xla_version = _installed("torch_xla")
    if xla_version is None:
        return f"accelerator 'xla_pjrt' needs the package torch_xla, which is not installed; {INSTALL_HINT}"
    torch_version = _installed("torch") or "none"
    if _minor(xla_version) != _minor(torch_version):
        return (
            f"torch_xla {xla_version} needs torch {_minor(xla_version)}.*, but torch {torch_version} is installed; "
            f"pip install torch=={xla_version.split('+')[0]} (the xla extra pins both: {XLA_PIN})"
        )
    device = env.get("PJRT_DEVICE", "").strip().upper()
    if not device:
        return f"PJRT_DEVICE is not set, so torch_xla does not know which device to use; set it: {PJRT_HINT}"
    missing = _missing_device(device, env)
    if missing:
        return f"PJRT_DEVICE={device} but {missing}; run on a machine that has one, or set {PJRT_HINT}"
    return None


def _missing_device(device: str, env: dict[str, str]) -> str | None:
    """Why no ``device`` is visible (without starting the PJRT runtime), or ``None``."""
    if device == "CPU":
        count = env.get("CPU_NUM_DEVICES", "1")
        return None if count.isdigit() and int(count) > 0 else f"CPU_NUM_DEVICES={count!r} is not a positive integer"
    if device in ("CUDA", "GPU"):
        import torch

        return None if torch.cuda.device_count() > 0 else "torch sees no CUDA GPU on this machine"
    if device == "TPU":
        try:
            from torch_xla._internal import tpu

            chips = tpu.num_available_chips()  # reads PCI ids; no metadata-server call, no runtime start
        except Exception as err:
            return f"no TPU is usable here ({type(err).__name__}: {err})"
        return None if chips > 0 else "no TPU chip is attached to this machine (none on the PCI bus)"
    return None  # other PJRT plugins (e.g. NEURON): let the runtime decide


def require_xla() -> None:
    """Raise :class:`XLAUnavailableError` with the one-line fix if torch_xla cannot run here."""
    problem = xla_problem()
    if problem is not None:
        raise XLAUnavailableError(problem)
