"""Which optimizers can step parameters that live in host memory: the checks L2L offload makes at set-up.

Plain data in, a ``ValueError`` naming the fix out, and no Lightning: the L2L strategies call
:func:`check_host_optimizer` (and :func:`check_delayed_optimizer` under ``delayed_update=True``) on the optimizers
``configure_optimizers`` returned, and ``lightning_accel.config.preflight`` calls the same functions on the optimizers
of the network built on the meta device, so a run is refused before any work instead of after its run directory exists.
"""

from __future__ import annotations

import torch
from torch.optim import LBFGS, Optimizer

__all__ = ["PER_PARAMETER", "check_delayed_optimizer", "check_delayed_update", "check_host_optimizer"]

# Optimizers whose step is one independent rule per parameter: stepping blocks one at a time (the overlap) or the host
# parameters apart from the device ones (the delayed update) equals one full step.
PER_PARAMETER: tuple[type[Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta,
)


def check_host_optimizer(optimizer: Optimizer, owner: str = "L2LOffloadStrategy") -> None:
    """Refuse an optimizer that cannot step parameters living in host memory: a closure-based one (LBFGS
    re-evaluates the whole model inside ``step()``), or one built for CUDA-graph capture (``capturable=True``)."""
    name = type(optimizer).__name__
    if isinstance(optimizer, LBFGS):
        raise ValueError(
            f"{owner} cannot run LBFGS on the host: it re-evaluates the whole model inside step(); "
            "use a per-parameter optimizer such as AdamW or SGD"
        )
    # fused=True is fine: SGD, Adam, AdamW and Adagrad have fused CPU kernels (torch >= 2.4)
    for group in optimizer.param_groups:
        if group.get("capturable"):
            raise ValueError(
                f"{owner} steps block parameters on the host, but {name}(capturable=True) is for CUDA-graph "
                "capture on an accelerator, which host parameters cannot take part in; set capturable=False "
                "in configure_optimizers (fused=True stays fast on the host)"
            )


def check_delayed_optimizer(optimizer: Optimizer, owner: str = "L2LOffloadStrategy") -> None:
    """Refuse an optimizer the one-step delayed update cannot split: the host parameters step apart from the device
    ones, which is one step only for a per-parameter rule (the exact class: a subclass may override ``step()``)."""
    if type(optimizer) not in PER_PARAMETER:
        raise ValueError(
            f"{owner}(delayed_update=True) updates the host parameters apart from the device ones, "
            f"which is one step only for a per-parameter optimizer, not {type(optimizer).__name__}; use one of "
            f"{', '.join(c.__name__ for c in PER_PARAMETER)}, or delayed_update=False"
        )


def check_delayed_update(*, fp16_scaling: bool = False, automatic_optimization: bool = True,
                         module_name: str = "the LightningModule", owner: str = "L2LOffloadStrategy") -> None:
    """Refuse what the one-step delayed update cannot do: fp16 loss scaling (an overflow found at step t+1 cannot cancel
    update t, already applied) and manual optimization (the update is split around the next step's forward)."""
    if fp16_scaling:
        raise ValueError(
            f"{owner}(delayed_update=True) cannot run with fp16 loss scaling (OffloadPrecision('16-mixed')): "
            "an overflow found at step t+1 cannot cancel update t, already applied; "
            "use OffloadPrecision('bf16-mixed') or delayed_update=False"
        )
    if not automatic_optimization:
        raise ValueError(
            f"{owner}(delayed_update=True) needs automatic optimization, but {module_name} "
            "sets automatic_optimization=False; use delayed_update=False with manual optimization"
        )
