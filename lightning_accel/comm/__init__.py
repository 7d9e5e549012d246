"""Data-parallel communication options (seed 002): hooks, traffic metering, a probe, gradients split across ranks.

No Lightning here: :mod:`lightning_accel.strategies.ddp_comm` wires these into a
Lightning DDP strategy; ``lightning-accel bench ddp`` and the tests use the probe.
:mod:`~lightning_accel.comm.gradients` (the whole norm, clipping by it, one found-inf verdict
when ranks hold parts of a gradient) serves the strategies without DDP's wrapper.
"""

from lightning_accel.comm.hooks import COMM_HOOKS, CommHookSpec, check_comm_hook, register_comm_hook
from lightning_accel.comm.probe import DDPOption, ProbeResult, probe
from lightning_accel.comm.traffic import Traffic, metered_all_reduce

__all__ = [
    "COMM_HOOKS",
    "CommHookSpec",
    "DDPOption",
    "ProbeResult",
    "Traffic",
    "check_comm_hook",
    "metered_all_reduce",
    "probe",
    "register_comm_hook",
]
