"""CommDDPStrategy: Lightning's DDP with a communication hook that works on every device.

Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers the hook only when the root
device is CUDA; on the CPU (gloo) the hook is silently dropped and every gradient still
goes out in fp32. This strategy takes the hook as plain data (``comm_hook="fp16"``, see
:class:`lightning_accel.comm.CommHookSpec`), builds it after the process group exists and
registers it on the ``DistributedDataParallel`` model on any device. Everything else
(bucket size, ``static_graph``, ``no_sync`` during gradient accumulation) is Lightning's
DDP unchanged: extra keyword arguments go to ``DistributedDataParallel``.

:func:`lightning_accel.config.preflight.check_comm_strategy` refuses, before any work, a
hook the chosen strategy would ignore or the device cannot run.

The recipes' options ``strategy=ddp_fp16|ddp_bf16|ddp_powersgd`` are also names a plain
``Trainer(strategy="ddp_powersgd")`` takes (:data:`COMM_VARIANTS`, registered with
Lightning's ``StrategyRegistry`` at ``import lightning_accel``), with the same arguments.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from typing_extensions import override

from lightning_accel.comm.hooks import CommHookSpec, register_comm_hook
from lightning_accel.config.errors import UserError

_LIGHTNING_HOOK_ARGS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper")


class CommDDPStrategy(DDPStrategy):
    """DDP whose gradient all-reduce goes through ``comm_hook`` (fp16, bf16, powersgd, ...)."""

    strategy_name = "ddp_comm"

    def __init__(
        self,
        comm_hook: str = "none",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 2,
        powersgd_fp16: bool = False,
        **kwargs: Any,
    ) -> None:
        given = [k for k in _LIGHTNING_HOOK_ARGS if kwargs.get(k) is not None]
        if given:
            raise UserError(
                f"CommDDPStrategy takes the hook by name, not {given[0]}=...; use comm_hook=fp16|bf16|powersgd "
                "(or Lightning's DDPStrategy, which registers hooks on CUDA only)"
            )
        self.comm_hook = CommHookSpec(comm_hook, powersgd_rank, powersgd_start_iter, powersgd_fp16)
        self.comm_state: Any = None
        super().__init__(**kwargs)

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        self.comm_state = register_comm_hook(self.model, self.comm_hook)  # type: ignore[arg-type]


# conf/strategy/ddp.yaml's keys, which every ddp_* option inherits (a test holds the two equal)
_DDP_DEFAULTS: dict[str, Any] = {
    "find_unused_parameters": False, "gradient_as_bucket_view": True, "bucket_cap_mb": 25, "static_graph": False,
}

# name -> (description, CommDDPStrategy's arguments): conf/strategy/<name>.yaml as a Trainer(strategy=...) name
COMM_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp_fp16": ("DDP whose gradients are all-reduced in fp16 (any device)", {**_DDP_DEFAULTS, "comm_hook": "fp16"}),
    "ddp_bf16": ("DDP whose gradients are all-reduced in bf16 (CUDA with NCCL >= 2.10)", {**_DDP_DEFAULTS, "comm_hook": "bf16"}),
    "ddp_powersgd": (
        "DDP with PowerSGD gradient compression, rank 1 (torch's powerSGD_hook)",
        {**_DDP_DEFAULTS, "comm_hook": "powersgd", "powersgd_rank": 1, "powersgd_start_iter": 2, "powersgd_fp16": False},
    ),
}


def register_comm_variants(registry: Any = StrategyRegistry) -> list[str]:
    """Register :data:`COMM_VARIANTS` with ``registry``, idempotently; returns the names."""
    from lightning_accel._registry import register

    for name, (description, arguments) in COMM_VARIANTS.items():
        register(registry, name, CommDDPStrategy, description, **arguments)
    return list(COMM_VARIANTS)
