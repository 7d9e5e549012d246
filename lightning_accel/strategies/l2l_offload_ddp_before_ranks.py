"""What ``Trainer(strategy="l2l_offload_ddp")`` refuses in the process that starts the ranks, before any starts.

A host budget the NVMe tier's plan cannot keep is refused by every rank at set-up; with Lightning's own launcher (its
subprocess or multiprocessing launcher, the Python API's ``trainer.fit``) the ranks would start first, import, meet,
and each print the refusal. The plan is made here once, as ``lightning-accel run``'s preflight makes it
(:func:`lightning_accel.estimate.tier.strategy_tier`, the strategy's own functions), on a copy of the model whose
tensors are fake (nothing allocated, the user's model untouched): the same one-line ``ValueError`` naming the value,
before any process starts. What the estimate cannot see as the ranks will (a quantized weight, a
``configure_optimizers`` that needs its Trainer) is left to the ranks' own check at set-up.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["check_tier_before_ranks"]


def check_tier_before_ranks(strategy: Any, module: nn.Module, trainer: Any) -> None:
    """Refuse, with the strategy's own line, a ``host_budget`` / ``nvme_path`` plan that ``strategy``'s ranks would
    refuse at set-up for ``module`` fitted by ``trainer``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_accel.estimate.fake import fake_parameters
    from lightning_accel.estimate.tier import TierRefused, strategy_tier

    if strategy.nvme_path is None and strategy.host_budget is None:
        return
    tensors = [*module.parameters(), *module.buffers()]
    if any(type(t.data) is not torch.Tensor for t in tensors):
        return  # a quantized (or otherwise subclassed) weight: its stored size is the ranks' to count
    try:
        meta = copy.deepcopy(module, {id(t): _on_meta(t) for t in tensors})  # the structure, none of the values
        net = meta.net if isinstance(getattr(meta, "net", None), nn.Module) else meta
        fake_parameters(net, FakeTensorMode(), lambda _n, p: torch.float32 if p.requires_grad else p.dtype)
        compute_dtype = strategy._compute_dtype()
        loop = {"accumulate_grad_batches": trainer.accumulate_grad_batches, "gradient_clip_val": trainer.gradient_clip_val}
        world = strategy.num_nodes * strategy.num_processes
        cuda = strategy.root_device.type == "cuda"
    except Exception:  # noqa: BLE001  (what the estimate cannot build, the ranks check)
        return
    try:
        strategy_tier(strategy, meta, net, compute_dtype, cuda=cuda, stored={}, trainer=loop, world=world)
    except TierRefused as err:
        raise ValueError(str(err).splitlines()[0]) from None
    except Exception:  # noqa: BLE001  (a configure_optimizers that needs its Trainer: the ranks check at set-up)
        return


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    meta = tensor.detach().to("meta")
    return nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
