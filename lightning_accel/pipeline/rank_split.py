"""A module split across a pipeline's ranks: this rank's stages, who holds each tensor, and the optimizer's part.

:func:`split_module` takes a module, its blocks and a balance, and on this rank builds the
:class:`lightning_accel.pipeline.RankPipeline` over its stages. The first split of a module
also gives this rank its starting weights: a module built on the ``meta`` device is
materialized in part, each rank its own tensors, nothing sent (the values of the user's own build run again where the
whole fits, :mod:`lightning_accel.pipeline.build_replay`; else per-module seeds,
:func:`lightning_accel.pipeline.deferred_init.materialize`), any other gets rank 0's
(:func:`lightning_accel.pipeline.placement.send_initial_weights`). The :class:`RankSplit` it
returns outlives the pipeline (a checkpoint saved after training still gathers the stages):
it knows which rank holds each tensor, keeps each optimizer to this rank's parameters and
maps their state to and from the whole model's. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_accel.models.block_policy import Block
from lightning_accel.pipeline.state_gather import gather_optimizer_state, local_optimizer_state
from lightning_accel.pipeline.deferred_init import agreed_seed, covers, has_meta_tensors, materialize, materialize_from
from lightning_accel.pipeline.distributed import RankPipeline
from lightning_accel.pipeline.placement import RankLayout, broadcast_shared, keep_own_parameters, owners, send_initial_weights
from lightning_accel.pipeline.schedule import stage_rank
from lightning_accel.pipeline.whole_module import fits_every_host, gather_whole_module, placeholder_bytes

__all__ = ["RankSplit", "split_module", "tensors_of"]


def tensors_of(module: nn.Module) -> list[Tensor]:
    """Every parameter and buffer of ``module``, in one order all ranks share."""
    return [*module.parameters(), *module.buffers()]


@dataclass
class RankSplit:
    """Per tensor of :func:`tensors_of` the module: the pipeline rank whose stage trains it (``owners``) and whether it is
    outside every block, so on every rank (``shared``); the ids of the parameters outside the blocks (``shared_params``);
    per optimizer, the whole model's optimizer's parameter indices per group and this rank's among them."""

    owners: list[int]
    shared: list[bool]
    shared_params: set[int]
    optimizer_index: list[tuple[list[list[int]], list[int]]] = field(default_factory=list)
    # parameter id -> the pipeline rank that uses it (RankPipeline.shared_owner, filled at the first step): a rank
    # that does not use a parameter outside the blocks never steps it, so its value and optimizer state come from here
    shared_owner: dict[int, int] = field(default_factory=dict)
    # the pipeline rank of the last stage: the last (-1), or rank 0 for a V-shaped schedule (zbv, dualpipev)
    last_rank: int = -1
    kept_ids: list[list[int]] = field(default_factory=list)  # per optimizer: its parameters' ids, in state_dict order
    # per optimizer, per param group: every parameter the whole model's optimizer holds there (other ranks' as their
    # placeholders), what a callback that records the groups (BaseFinetuning) must see
    whole_groups: list[list[list[Tensor]]] = field(default_factory=list)
    _owner: dict[int, tuple[int, bool]] = field(default_factory=dict)  # tensor id -> (owner, shared), at the split
    _kept_groups: list[list[list[int]]] = field(default_factory=list)  # per optimizer, per group: the ids left there

    def counted_here(self, t: Tensor, layout: RankLayout) -> bool:
        """Whether this rank counts ``t`` once for the whole model (a norm, a checkpoint's optimizer state): its own
        block tensors, and what is outside the blocks on a rank that uses it (before the first step: the last rank)."""
        return self._steps_here(id(t), layout)

    def keep_own_parameters(self, module: nn.Module, optimizers: Sequence[Optimizer], layout: RankLayout) -> None:
        """Leave in each optimizer only this rank's parameters (see :func:`lightning_accel.pipeline.placement.keep_own_parameters`);
        a parameter not in ``module`` counts as outside the blocks."""
        self._owner = {id(t): (o, sh) for t, o, sh in zip(tensors_of(module), self.owners, self.shared)}
        self.optimizer_index, self.whole_groups, self._kept_groups, self.kept_ids = [], [], [], []
        for optimizer in optimizers:
            self.whole_groups.append([list(g["params"]) for g in optimizer.param_groups])
            self.optimizer_index.append(keep_own_parameters(optimizer, self._owner, layout.pp_rank, self._default(layout)))
            self._note_kept(optimizer, None)

    def _default(self, layout: RankLayout) -> tuple[int, bool]:
        return (self.last_rank % layout.pp_size, True)

    def _note_kept(self, optimizer: Optimizer, index: int | None) -> None:
        groups = [[id(p) for p in g["params"]] for g in optimizer.param_groups]
        ids = [i for group in groups for i in group]
        if index is None:
            self._kept_groups.append(groups)
            self.kept_ids.append(ids)
        else:
            self._kept_groups[index], self.kept_ids[index] = groups, ids

    def follow_param_groups(self, optimizers: Sequence[Optimizer], layout: RankLayout) -> None:
        """Param groups added since the split or the last call (``BaseFinetuning`` unfreezing a module:
        ``optimizer.add_param_group`` with all its parameters, placeholders included) are recorded whole, under the
        whole model's optimizer indices, and left with this rank's parameters; groups replaced (``BaseFinetuning``
        restoring its groups from a checkpoint: every parameter again) are taken whole, as at the split. Cheap when
        nothing changed: call it before each step and before the optimizer state is read or loaded."""
        for index, optimizer in enumerate(optimizers[: len(self._kept_groups)]):
            known = self._kept_groups[index]
            current = [[id(p) for p in g["params"]] for g in optimizer.param_groups]
            if current == known:
                continue
            start = len(known) if current[: len(known)] == known else 0  # appended groups, or every group anew
            whole = self.whole_groups[index][:start] + [list(g["params"]) for g in optimizer.param_groups[start:]]
            full, kept = self.optimizer_index[index] if start else ([], [])
            offset = sum(len(g) for g in whole[:start])
            more_full, more_kept = keep_own_parameters(optimizer, self._owner, layout.pp_rank, self._default(layout), start, offset)
            self.whole_groups[index] = whole
            self.optimizer_index[index] = (full + more_full, kept + more_kept)
            self._note_kept(optimizer, index)

    def whole_param_groups(self, index: int, optimizer: Optimizer) -> list[dict[str, Any]]:
        """Optimizer ``index``'s param groups as the whole model's optimizer holds them (every parameter, other ranks' as
        placeholders), for a callback that records them by name (:meth:`follow_param_groups` first)."""
        return [{**group, "params": whole} for group, whole in zip(optimizer.param_groups, self.whole_groups[index])]

    def sync_shared(self, module: nn.Module, layout: RankLayout) -> None:
        """Every rank gets the current values of what lives outside the stages (every rank of the pipeline calls it)."""
        tensors = tensors_of(module)
        owners = [self.shared_owner.get(id(t), o) for t, o in zip(tensors, self.owners)]  # the users' values
        broadcast_shared(tensors, owners, self.shared, layout)

    def optimizer_state(self, index: int, state: dict[str, Any], layout: RankLayout) -> dict[str, Any]:
        """Optimizer ``index``'s state for the whole model (each rank's part under plain training's indices)."""
        if index >= len(self.optimizer_index):
            return state
        full, kept = self.optimizer_index[index]
        if index < len(self.kept_ids):  # what is outside the blocks: the state of a rank that steps it
            ids = self.kept_ids[index]
            state = {**state, "state": {i: s for i, s in state["state"].items() if self._steps_here(ids[i], layout)}}
        return gather_optimizer_state(state, full, kept, layout)

    def _steps_here(self, pid: int, layout: RankLayout) -> bool:
        return pid not in self.shared_params or self.shared_owner.get(pid, self.last_rank % layout.pp_size) == layout.pp_rank

    def gather_whole(
        self, module: nn.Module, layout: RankLayout, available: int | None, check: bool = True, copies: Sequence[nn.Module] = (),
    ) -> int | None:
        """Every rank's ``module`` whole, its placeholders filled on the CPU from the stages' ranks
        (:func:`~lightning_accel.pipeline.whole_module.gather_whole_module`), and each of ``copies`` (modules of the same
        structure made before the split and freed alike: SWA's averaged model), what is outside their blocks taken from
        a rank that steps it; with ``check``, only where every host's ranks fit what they need in the ``available`` bytes
        each sees (None: unknown, taken to fit). Returns the bytes this rank needed when they do not (nothing moved).
        Every rank calls it."""
        needed = sum(placeholder_bytes(tensors_of(m)) for m in (module, *copies))
        if check and not fits_every_host(needed, available):
            return needed
        users = [self.shared_owner.get(id(t), o) for t, o in zip(tensors_of(module), self.owners)]
        gather_whole_module(module, tensors_of(module), self.owners, self.shared, layout)
        for copy in copies:
            tensors = tensors_of(copy)
            if not any(t.is_meta for t in tensors):  # whole already (an evaluation after fit did not free it)
                continue
            broadcast_shared(tensors, users, self.shared, layout)
            gather_whole_module(copy, tensors, self.owners, self.shared, layout)
        return None

    def local_optimizer_state(self, index: int, whole: Mapping[str, Any]) -> Mapping[str, Any]:
        """This rank's part of optimizer ``index``'s whole-model state."""
        if index >= len(self.optimizer_index):
            return whole
        full, kept = self.optimizer_index[index]
        return local_optimizer_state(whole, full, kept)


def split_module(
    module: nn.Module, blocks: Sequence[Block], balance: Sequence[int], layout: RankLayout, first: bool,
    initial: Callable[[], Mapping[str, Tensor] | None] | None = None, **pipeline: Any,
) -> tuple[RankPipeline, RankSplit]:
    """This rank's :class:`RankPipeline` over ``module`` (``blocks`` split by ``balance``; ``pipeline``: its other
    arguments), and where each tensor lives. ``first``: the module's first split, so its starting weights are placed
    (a split module keeps its own). The other ranks' blocks go to the ``meta`` device (names, shapes, dtypes stay).
    A module built on ``meta`` takes its starting values from ``initial()`` (every tensor by name: the user's build run
    again, :mod:`lightning_accel.pipeline.build_replay`; every rank calls it and gets values, or None, alike), else each
    rank materializes its part from per-module seeds (:func:`~lightning_accel.pipeline.deferred_init.materialize`)."""
    tensors = tensors_of(module)
    schedule = pipeline.get("schedule", "gpipe")
    owned, shared = owners(tensors, [b.module for b in blocks], balance, layout.pp_size, schedule)
    if first and has_meta_tensors(module):  # built on meta: each rank initializes its own part, nothing is sent
        mine = {id(t) for t, o, sh in zip(tensors, owned, shared) if sh or o == layout.pp_rank}
        values = initial() if initial is not None else None  # the user's build run again whole, where it fits
        if values is not None and covers(module, values):
            materialize_from(module, values, keep=lambda t: id(t) in mine)
        else:
            materialize(module, agreed_seed(), keep=lambda t: id(t) in mine)
    elif first:
        send_initial_weights(tensors, owned, shared, layout)
    pipe = RankPipeline(
        module, balance, device=layout.device, group=layout.pp_group, blocks=[Block(b.name, b.module) for b in blocks],
        **pipeline,
    )
    last = stage_rank(len(balance) - 1, layout.pp_size, schedule)
    return pipe, RankSplit(owned, shared, {id(p) for p in pipe.shared_params}, shared_owner=pipe.shared_owner, last_rank=last)
