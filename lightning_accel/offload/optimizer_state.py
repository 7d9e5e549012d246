"""A plain optimizer state from the ranks' partitioned shards, and a rank's shard from a plain one.

With the host optimizer partitioned (:mod:`.partition`) each rank's optimizer holds state only
for the parameters it steps (torch optimizers create state for a parameter the first time it
has a gradient, and only the owner's parameters get one). A checkpoint must still hold what
plain training would write, ``optimizer.state_dict()`` of one optimizer over every parameter, so
that it loads into a one-device run or into DDP: :func:`gather_state` merges the shards under
the same indices (every rank's optimizer has the same param groups, so indices agree), and
:func:`keep_state` cuts a plain state dict down to one rank's shard when loading. Nothing here
imports Lightning.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer


def param_indices(optimizer: Optimizer) -> dict[int, int]:
    """``id(param)`` -> its index in ``optimizer.state_dict()["state"]`` (params of all groups, in order)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(p): i for i, p in enumerate(params)}


def state_bytes(optimizer: Optimizer, params: Iterable[nn.Parameter] | None = None) -> int:
    """Bytes of the optimizer's state tensors (of ``params`` only, when given): what a rank holds."""
    per = state_bytes_by_parameter(optimizer)
    return sum(per.values()) if params is None else sum(per.get(id(p), 0) for p in {id(p): p for p in params}.values())


def state_bytes_by_parameter(optimizer: Optimizer) -> dict[int, int]:
    """``id(parameter) -> bytes of its state tensors``, every parameter in one pass (``estimate`` reads them per name)."""
    return {
        id(p): sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, Tensor))
        for p, state in optimizer.state.items()
    }


def gather_state(state_dict: dict[str, Any], send: Collection[int], group: dist.ProcessGroup | None, dst: int = 0) -> dict[str, Any]:
    """On rank ``dst`` of ``group``: ``state_dict`` with the state of every rank's ``send`` indices
    added (the shards it steps, moved to the CPU), keys in index order; on the other ranks their
    own ``state_dict`` unchanged. Every rank of ``group`` calls it. A state dict without per-parameter state (Lightning's
    stand-in optimizer when ``configure_optimizers`` returns None: ``{}`` on every rank) has nothing to gather."""
    if "state" not in state_dict:
        return state_dict
    mine = {i: {k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in s.items()} for i, s in state_dict["state"].items() if i in send}
    rank = dist.get_rank(group)
    shards: list[Any] | None = [None] * dist.get_world_size(group) if rank == dst else None
    dist.gather_object(mine, shards, dst=dist.get_global_rank(group, dst), group=group)
    if shards is None:
        return state_dict
    state = dict(state_dict["state"])
    for shard in shards:
        state.update(shard)
    return {**state_dict, "state": {i: state[i] for i in sorted(state)}}


def keep_state(state_dict: dict[str, Any], keep: Collection[int]) -> dict[str, Any]:
    """``state_dict`` with the state of the ``keep`` indices only (param groups unchanged)."""
    if "state" not in state_dict:  # no per-parameter state (Lightning's stand-in optimizer)
        return state_dict
    return {**state_dict, "state": {i: s for i, s in state_dict["state"].items() if i in keep}}

