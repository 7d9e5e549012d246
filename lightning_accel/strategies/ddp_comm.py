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
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy
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
