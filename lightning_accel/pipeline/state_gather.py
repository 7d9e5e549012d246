"""State dicts across a pipeline's ranks: the whole model's gathered for a checkpoint, and each rank's part of a whole one.

Saving: global rank 0 gathers every stage's tensors under the user's names from its own
pipeline (the replicas hold the same values), so the checkpoint loads into the plain
model; the optimizer state of every rank goes under the indices plain training would give
each parameter. Loading: each rank takes its own part (:func:`load_own_state`,
:func:`local_optimizer_state`). No Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from lightning_accel.pipeline.placement import RankLayout

__all__ = ["gather_model_state", "gather_optimizer_state", "load_own_state", "local_optimizer_state"]


def _cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value


def gather_model_state(state: Mapping[str, Tensor], layout: RankLayout, global_rank: int) -> dict[str, Any]:
    """On global rank 0: the whole model's ``state`` (names and order of the full module's), from its pipeline's ranks;
    elsewhere this rank's part (its tensors that are not on ``meta``). Every rank of the pipeline calls it."""
    mine = {n: t.detach().cpu() for n, t in state.items() if not t.is_meta}
    if layout.dp_rank != 0:  # another replica: the same values as replica 0's, which rank 0 saves
        return mine
    every: list[Any] | None = [None] * layout.pp_size if global_rank == 0 else None
    dist.gather_object(mine, every, dst=0, group=layout.pp_group)
    if global_rank != 0 or every is None:
        return mine
    merged: dict[str, Any] = {}
    for part in every:
        merged.update(part)  # what all ranks hold (outside the stages) is equal
    missing = [n for n in state if n not in merged]
    if missing:
        raise RuntimeError(f"no rank holds {missing[:3]}: the stages do not cover the model")
    return {n: merged[n] for n in state}


def gather_optimizer_state(state: Mapping[str, Any], full: Sequence[Sequence[int]], kept: Sequence[int], layout: RankLayout) -> dict[str, Any]:
    """The whole model's optimizer state from this rank's ``state``, on the first rank of each pipeline (global rank 0's
    is the one saved): each rank's part under the whole model's indices (``full`` per group, ``kept`` this rank's; see
    :func:`lightning_accel.pipeline.placement.keep_own_parameters`). The other ranks get their own part only, so no
    rank but that one ever holds the whole model's optimizer state. Every rank of the pipeline calls it."""
    mine = {kept[i]: _cpu(s) for i, s in state["state"].items()}
    groups = [{**g, "params": list(ids)} for g, ids in zip(state["param_groups"], full)]
    first = layout.pp_rank == 0
    every: list[Any] | None = [None] * layout.pp_size if first else None
    dist.gather_object(mine, every, dst=layout.pp_global(0), group=layout.pp_group)  # each pipeline its own
    parts = every if every is not None else [mine]
    return {"state": {i: s for part in parts for i, s in sorted(part.items())}, "param_groups": groups}


def local_optimizer_state(whole: Mapping[str, Any], full: Sequence[Sequence[int]], kept: Sequence[int]) -> dict[str, Any]:
    """This rank's optimizer state dict out of the whole model's (the inverse of :func:`gather_optimizer_state`)."""
    local = {g: i for i, g in enumerate(kept)}
    groups, offset = [], 0
    for group, ids in zip(whole["param_groups"], full):
        count = sum(g in local for g in ids)
        groups.append({**group, "params": list(range(offset, offset + count))})
        offset += count
    return {"state": {local[g]: s for g, s in whole["state"].items() if g in local}, "param_groups": groups}


def load_own_state(module: nn.Module, state: Mapping[str, Tensor], strict: bool = True) -> bool:
    """Load into ``module`` the entries of the whole model's ``state`` that this rank holds (not on ``meta``); False,
    loading nothing, when the module holds everything (load it as usual). ``strict``: the rest must match by name."""
    freed = {n for n, t in module.state_dict().items() if t.is_meta}
    if not freed:
        return False
    result = module.load_state_dict({n: t for n, t in state.items() if n not in freed}, strict=False)
    missing = [n for n in result.missing_keys if n not in freed]
    if strict and (missing or result.unexpected_keys):
        raise RuntimeError(
            f"the checkpoint does not match this rank's part of the model: missing {missing[:5]}, unexpected "
            f"{result.unexpected_keys[:5]}; load_model_state_dict(..., strict=False) to ignore them"
        )
    return True
