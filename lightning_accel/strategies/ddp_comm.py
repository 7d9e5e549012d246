"""CommDDPStrategy: Lightning's DDP with a communication hook that works on every device.

Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers the hook only when the root
device is CUDA; on the CPU (gloo) the hook is silently dropped and every gradient still
goes out in fp32. This strategy takes the hook as plain data (``comm_hook="fp16"``, see
:class:`lightning_accel.comm.CommHookSpec`), builds it after the process group exists and
registers it on the ``DistributedDataParallel`` model on any device. Everything else
(bucket size, ``static_graph``, ``no_sync`` during gradient accumulation) is Lightning's
DDP unchanged: extra keyword arguments go to ``DistributedDataParallel``.

:func:`check_comm_strategy` refuses, before any work, a hook the chosen strategy would
ignore or the device cannot run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_accel.comm.hooks import CommHookSpec, check_comm_hook, register_comm_hook
from lightning_accel.config.errors import UserError

_LIGHTNING_HOOK_ARGS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper")
_TARGET = f"{__name__}.CommDDPStrategy"


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


def check_comm_strategy(strategy: Mapping[str, Any] | None, accelerator: str) -> None:
    """Refuse a comm hook the strategy would ignore or the accelerator cannot run.

    ``strategy`` is the composed ``cfg.strategy`` node (a mapping), ``accelerator`` is
    ``cfg.trainer.accelerator``.
    """
    if not strategy:
        return
    target = str(strategy.get("_target_") or "")
    lightning_hook = strategy.get("ddp_comm_hook")
    if lightning_hook is not None and target != _TARGET and accelerator == "cpu":
        raise UserError(
            f"strategy.ddp_comm_hook is set but {target or 'the strategy'} registers DDP comm hooks only on CUDA, and "
            "trainer.accelerator=cpu: gradients would silently go out uncompressed; use strategy=ddp_fp16 or "
            "strategy=ddp_powersgd (CommDDPStrategy registers them on every device)"
        )
    if "comm_hook" not in strategy:
        return
    if target != _TARGET:
        raise UserError(
            f"strategy.comm_hook={strategy['comm_hook']} needs a DDP strategy, but strategy._target_ is "
            f"{target or '(a strategy name)'}; choose strategy=ddp_fp16, ddp_bf16 or ddp_powersgd"
        )
    spec = CommHookSpec(
        str(strategy["comm_hook"]),
        int(strategy.get("powersgd_rank", 1)),
        int(strategy.get("powersgd_start_iter", 2)),
        bool(strategy.get("powersgd_fp16", False)),
    )
    check_comm_hook(spec, device_type=accelerator)
