"""Which optimizer state tensors a parameter will have, found by stepping a stand-in of its group.

The NVMe tier lays out each parameter's state on disk before the optimizer has made any (torch
creates it at a parameter's first step), and the plan counts those bytes against ``host_budget``
before any work. Rather than a table of every optimizer's keys (AdamW's ``exp_avg`` and
``exp_avg_sq``, ``max_exp_avg_sq`` under ``amsgrad``, SGD's ``momentum_buffer`` only with momentum,
RMSprop's ``grad_avg`` only when centered, ...), each distinct param group is asked once: the same
class with the same hyper-parameters steps a 4-element tensor, and the state tensors shaped like
it are the per-element ones. Scalars (``step``) stay in host memory and are not laid out.
Nothing here imports Lightning.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

StateKeys = tuple[tuple[str, torch.dtype], ...]


def per_element_state(optimizer: Optimizer, params: list[nn.Parameter], dtype_of: dict[nn.Parameter, torch.dtype]) -> dict[nn.Parameter, StateKeys]:
    """``param -> ((key, dtype), ...)`` of the per-element state ``optimizer`` will keep for each of ``params``
    (stepped in ``dtype_of[param]``, its master's dtype). A parameter in no group of ``optimizer`` gets ``()``."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    seen: dict[Any, StateKeys] = {}
    out: dict[nn.Parameter, StateKeys] = {}
    for param in params:
        group = group_of.get(id(param))
        if group is None:
            out[param] = ()
            continue
        dtype = dtype_of[param]
        hyper = _constructor_args(type(optimizer), group)
        key = (type(optimizer), dtype, repr(sorted(hyper.items())))
        if key not in seen:
            seen[key] = _probe(type(optimizer), hyper, dtype)
        out[param] = seen[key]
    return out


def state_nbytes(keys: StateKeys, numel: int) -> int:
    return sum(numel * torch.tensor([], dtype=dtype).element_size() for _, dtype in keys)


def _constructor_args(cls: type[Optimizer], group: dict[str, Any]) -> dict[str, Any]:
    accepted = inspect.signature(cls.__init__).parameters
    # the fused/foreach choice does not change the state; the stand-in steps with torch's default
    skip = {"params", "fused", "foreach", "capturable", "differentiable"}
    return {k: v for k, v in group.items() if k in accepted and k not in skip}


def _probe(cls: type[Optimizer], hyper: dict[str, Any], dtype: torch.dtype) -> StateKeys:
    stand_in = torch.zeros(4, dtype=dtype, requires_grad=True)
    stand_in.grad = torch.full((4,), 0.5, dtype=dtype)
    optimizer = cls([stand_in], **{k: (v.clone() if isinstance(v, Tensor) else v) for k, v in hyper.items()})
    optimizer.step()
    return tuple((k, v.dtype) for k, v in optimizer.state[stand_in].items() if isinstance(v, Tensor) and v.shape == stand_in.shape)
