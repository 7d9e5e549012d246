"""DDP communication hooks, chosen by name and built from plain data.

torch ships the hooks that cut data-parallel traffic (seed 002):
``fp16_compress_hook`` / ``bf16_compress_hook`` halve the bytes of every all-reduce, and
PowerSGD sends two thin low-rank factors per gradient matrix instead of the matrix. A
hook is a callable plus a state object (PowerSGD's holds its error-feedback buffers and
the process group), and the state can only be built once the process group exists. So
a recipe names the hook and its knobs (:class:`CommHookSpec`, plain data that Hydra can
hold and a test can compare), and :func:`register_comm_hook` builds and registers the
hook on the ``DistributedDataParallel`` model at setup time, on any device.

``"allreduce"`` is what DDP does without a hook, made explicit (torch's ``allreduce_hook``
has the same numerics), so its traffic can be metered next to the others.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from lightning_accel.config.errors import UserError, close_matches

COMM_HOOKS = ("none", "allreduce", "fp16", "bf16", "powersgd")


@dataclasses.dataclass(frozen=True)
class CommHookSpec:
    """Which hook DDP runs on each gradient bucket, and its knobs."""

    name: str = "none"
    # PowerSGD: rank of the P/Q factors. Traffic per (n x m) gradient ~ rank * (n + m)
    # numbers instead of n * m; a higher rank is closer to exact all-reduce.
    powersgd_rank: int = 1
    # PowerSGD: plain all-reduce for this many iterations first (torch needs > 1 with
    # error feedback): compressing from step 0 hurts accuracy.
    powersgd_start_iter: int = 2
    # PowerSGD: also send the P/Q factors in fp16 (torch's fp16_compress_wrapper).
    powersgd_fp16: bool = False

    def __post_init__(self) -> None:
        if self.name not in COMM_HOOKS:
            raise UserError(
                f"comm_hook={self.name!r} is not a DDP communication hook{close_matches(self.name, COMM_HOOKS)}; "
                f"choose one of: {', '.join(COMM_HOOKS)} (e.g. strategy=ddp_fp16)"
            )
        if self.powersgd_rank < 1:
            raise UserError(f"powersgd_rank={self.powersgd_rank} must be >= 1; e.g. powersgd_rank=1 (smallest traffic)")
        if self.powersgd_start_iter < 2:
            raise UserError(
                f"powersgd_start_iter={self.powersgd_start_iter} must be >= 2 (torch's PowerSGD error feedback needs "
                "plain all-reduce first); e.g. powersgd_start_iter=2"
            )
        if self.powersgd_fp16 and self.name != "powersgd":
            raise UserError(f"powersgd_fp16=true only applies to comm_hook=powersgd, not {self.name!r}; drop it or use comm_hook=powersgd")


def check_comm_hook(spec: CommHookSpec, *, device_type: str) -> None:
    """Refuse a hook the device's collective backend cannot run, with the alternative."""
    if spec.name == "bf16" and device_type not in ("cuda", "gpu", "xpu"):
        raise UserError(
            f"comm_hook=bf16 needs CUDA with NCCL >= 2.10 (or XPU), but the accelerator is {device_type} (gloo "
            "backend); use strategy=ddp_fp16 on the CPU, or run on GPUs"
        )


def register_comm_hook(model: DistributedDataParallel, spec: CommHookSpec, process_group: Any = None) -> Any:
    """Build ``spec``'s hook and register it on ``model``; returns the hook's state (or None).

    Must run before the first backward, and at most once per model (DDP's own rule).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if spec.name == "none":
        return None
    check_comm_hook(spec, device_type=_device_type(model))
    if spec.name == "powersgd":
        state: Any = powerSGD_hook.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=spec.powersgd_rank,
            start_powerSGD_iter=spec.powersgd_start_iter,
        )
        hook = powerSGD_hook.powerSGD_hook
        if spec.powersgd_fp16:
            hook = default_hooks.fp16_compress_wrapper(hook)
    else:
        state = process_group  # the default hooks take the process group as their state
        hook = {
            "allreduce": default_hooks.allreduce_hook,
            "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook,
        }[spec.name]
    model.register_comm_hook(state, hook)
    return state


def _device_type(model: DistributedDataParallel) -> str:
    param = next(model.module.parameters(), None)
    return param.device.type if param is not None else "cpu"
