"""The ``xla_pjrt`` accelerator: Lightning on torch_xla for whatever PJRT device is set.

Lightning's own ``XLAAccelerator`` ("tpu") counts TPU chips on the PCI bus and the GCE
metadata server, so it starts only on a TPU VM. This one asks the PJRT runtime instead,
so the same code trains on a TPU, on CUDA GPUs, or on the CPU (``PJRT_DEVICE=CPU``),
which is how the XLA code paths are tested on machines without accelerators.

``devices=1`` or ``devices=[i]`` is one device (``xla:i``); ``devices=N`` or ``-1`` with N > 1
is data parallel over all N devices of the host by SPMD (the CPU has
``CPU_NUM_DEVICES``, default 1), see :mod:`lightning_accel.accelerators.spmd`.

Use it with its strategy: ``Trainer(accelerator="xla_pjrt", strategy="xla_pjrt")``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.accelerators.registry import _AcceleratorRegistry
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.accelerators import Accelerator
from typing_extensions import override

from lightning_accel.accelerators.runtime import require_xla, xla_problem
from lightning_accel.accelerators.spmd import plan_placement


class XLAPJRTAccelerator(Accelerator):
    """Accelerator for torch_xla on the PJRT device named by ``PJRT_DEVICE`` (TPU, CUDA or CPU)."""

    def __init__(self) -> None:
        require_xla()  # one line naming the package or variable to set, before Lightning gets further
        super().__init__()

    @override
    def setup_device(self, device: torch.device) -> None:
        if device.type != "xla":
            raise ValueError(
                f"accelerator 'xla_pjrt' was given a {device.type} device by strategy; "
                "pass strategy='xla_pjrt' together with accelerator='xla_pjrt'"
            )

    @override
    def teardown(self) -> None:
        pass

    @staticmethod
    @override
    def parse_devices(devices: int | str | list[int]) -> list[int]:
        """``1``, ``N``, ``-1``/``"auto"`` (all) or a list of indices -> the device indices.

        Several devices must be all of them: SPMD data parallelism spans the whole host.
        """
        count = XLAPJRTAccelerator.auto_device_count()
        if isinstance(devices, str):
            text = devices.strip()
            devices = -1 if text == "auto" else int(text) if text.lstrip("-").isdigit() else [int(d) for d in text.split(",") if d.strip()]
        if isinstance(devices, int):
            if devices == -1:
                devices = count
            if not 1 <= devices <= count:
                raise ValueError(f"devices={devices} but the PJRT runtime has {count} device(s); {_more_devices_hint(devices)}")
            indices = list(range(devices))
        else:
            indices = [int(d) for d in devices]
            bad = [i for i in indices if not 0 <= i < count]
            if bad or not indices:
                raise ValueError(f"devices={indices} names indices outside 0..{count - 1} of the PJRT runtime; {_more_devices_hint(max(indices, default=0) + 1)}")
        plan_placement(indices, count, _cpu_count_hint(len(indices)))  # several devices: all of them, or a clear refusal
        return indices

    @staticmethod
    @override
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        indices = devices if isinstance(devices, list) else XLAPJRTAccelerator.parse_devices(devices)
        return [torch.device("xla", i) for i in indices]

    @staticmethod
    @override
    def auto_device_count() -> int:
        """Devices this process's PJRT runtime can address (starts the runtime)."""
        require_xla()
        import torch_xla.runtime as xr

        return int(xr.addressable_runtime_device_count())

    @staticmethod
    @override
    def is_available() -> bool:
        return xla_problem() is None

    @override
    def get_device_stats(self, device: _DEVICE) -> dict[str, Any]:
        import torch_xla.core.xla_model as xm

        try:
            info = xm.get_memory_info(device)
        except Exception:  # the CPU PJRT client has no memory statistics
            return {}
        return {k: v for k, v in info.items() if isinstance(v, (int, float))}

    @staticmethod
    @override
    def name() -> str:
        return "xla_pjrt"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        accelerator_registry.register(cls.name(), cls, description="torch_xla on the PJRT device named by PJRT_DEVICE")


def _more_devices_hint(wanted: int) -> str:
    if _cpu_count_hint(wanted):
        return f"the CPU PJRT client has CPU_NUM_DEVICES devices (default 1); {_cpu_count_hint(wanted)}"
    return "ask for fewer devices, or devices=-1 for all of them"


def _cpu_count_hint(wanted: int) -> str:
    """How to get ``wanted`` devices on the CPU PJRT client ("" on other PJRT devices)."""
    if os.environ.get("PJRT_DEVICE", "").upper() != "CPU":
        return ""
    return f"start the process with CPU_NUM_DEVICES={max(wanted, 1)} (read once, when the PJRT runtime starts)"
