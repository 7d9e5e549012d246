"""Which rank owns which offloaded unit: the host optimizer partitioned across data-parallel ranks.

ZeRO-Offload's point for several devices: each rank keeps fp32 optimizer state (Adam's two
moments) and steps only its share of the parameters, so a node holds one copy of that state,
not one per rank. The share here is block-granular: a whole unit (one transformer block, or
the streamed resident unit) belongs to one rank, which receives that unit's averaged
gradients, steps it and sends its updated weights to the others. Units are not split, so the
shares are as even as the units' sizes allow (equal blocks over a rank count that divides
their number: exactly 1/N each); a rank may own nothing when there are fewer units than ranks.

Decided as plain data by :func:`partition_units`; every rank computes the same answer. What
trains can change during a fit (a backbone unfrozen at an epoch's start): :class:`UnitOwners`
keeps the owners of the units that have trained and gives out the others anew.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class HostPartition:
    """``owners[i]``: the rank that keeps unit ``i``'s optimizer state and steps it."""

    owners: tuple[int, ...]
    world: int

    def owned(self, rank: int) -> list[int]:
        """The units ``rank`` steps, in unit order."""
        return [i for i, owner in enumerate(self.owners) if owner == rank]

    def shares(self, numels: Sequence[int]) -> list[int]:
        """Elements each rank steps."""
        out = [0] * self.world
        for owner, numel in zip(self.owners, numels):
            out[owner] += numel
        return out

    def describe(self, numels: Sequence[int]) -> str:
        shares = self.shares(numels)
        total = sum(shares) or 1
        parts = ", ".join(f"rank {r}: {len(self.owned(r))} units ({s / total:.0%})" for r, s in enumerate(shares))
        return f"host optimizer partitioned by unit over {self.world} ranks ({parts})"


def partition_units(numels: Sequence[int], world: int, fixed: Mapping[int, int] | None = None) -> HostPartition:
    """Give each unit to a rank so the ranks' element counts are as even as whole units allow.

    Largest unit first, each to the rank holding the fewest elements so far (ties: the lower
    rank; equal units: the earlier one first), so equal blocks go round-robin: on a backward
    pass, consecutive blocks' reductions then go to different ranks.

    ``fixed`` (unit -> rank): units that keep their owner, counted first. What trains can change
    during a fit (a backbone unfrozen at an epoch's start): a unit that has trained keeps the rank
    holding its optimizer state, and the units that start training are given out around them.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    fixed = fixed or {}
    load = [0] * world
    owners = [0] * len(numels)
    for index, rank in fixed.items():
        owners[index] = rank
        load[rank] += numels[index]
    for index in sorted((i for i in range(len(numels)) if i not in fixed), key=lambda i: (-numels[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += numels[index]
    return HostPartition(tuple(owners), world)


class UnitOwners:
    """Each unit's host parameters, those of them that train now, and (partitioned) the rank stepping each unit,
    kept up to date as what trains changes during a fit.

    A unit that has had parameters to train keeps its owner from then on: the owner holds the unit's optimizer state
    (a parameter frozen again keeps its state, as in plain training, for when it is unfrozen again). The units that
    have not trained yet are given out anew around them at each change; no rank holds state for them, except what a
    checkpoint held, which every rank keeps until the owner is known (:meth:`state_ids`).
    """

    def __init__(self, world: int, partitioned: bool) -> None:
        self.world = world
        self.partitioned = partitioned
        self.held: list[list[nn.Parameter]] = []  # every host parameter of each unit
        self.units: list[list[nn.Parameter]] = []  # of those, the ones requiring grad now
        self.partition: HostPartition | None = None  # None: replicated, every rank steps every unit
        self.trained: set[int] = set()  # units that have had parameters to train

    def update(self, held: Sequence[Sequence[nn.Parameter]]) -> bool:
        """Take each unit's host parameters as they are now (which require grad); returns whether the owners changed."""
        self.held = [list(unit) for unit in held]
        self.units = [[p for p in unit if p.requires_grad] for unit in self.held]
        if not self.partitioned:
            return False
        before, numels = self.partition, self.numels()
        fixed = {} if before is None else {i: before.owners[i] for i in self.trained}
        self.partition = partition_units(numels, self.world, fixed)
        self.trained |= {i for i, n in enumerate(numels) if n}
        return self.partition != before

    @property
    def owners(self) -> tuple[int, ...] | None:
        return None if self.partition is None else self.partition.owners

    def numels(self) -> list[int]:
        """Elements each unit trains now."""
        return [sum(p.numel() for p in unit) for unit in self.units]

    def stepped_by(self, rank: int) -> list[nn.Parameter]:
        """The host parameters ``rank`` steps now (all of them when replicated)."""
        owned = range(len(self.units)) if self.partition is None else self.partition.owned(rank)
        return [p for i in owned for p in self.units[i]]

    def state_ids(self, rank: int) -> tuple[set[int], set[int]]:
        """``id``s of the host parameters whose optimizer state one rank alone holds (the units that have trained),
        and of those, ``rank``'s. Replicated: none."""
        if self.partition is None:
            return set(), set()
        owners = self.partition.owners
        decided = {id(p) for i in self.trained for p in self.held[i]}
        return decided, {id(p) for i in self.trained if owners[i] == rank for p in self.held[i]}

    def others(self, rank: int) -> list[nn.Parameter]:
        """The host parameters whose optimizer state another rank holds."""
        owners = self.owners
        return [] if owners is None else [p for i in self.trained if owners[i] != rank for p in self.held[i]]

    def describe(self) -> str:
        if self.partition is None:
            return "host optimizer replicated on every rank"
        return self.partition.describe(self.numels())
