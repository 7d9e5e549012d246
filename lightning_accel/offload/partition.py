"""Which rank owns which offloaded unit: the host optimizer partitioned across data-parallel ranks.

ZeRO-Offload's point for several devices: each rank keeps fp32 optimizer state (Adam's two
moments) and steps only its share of the parameters, so a node holds one copy of that state,
not one per rank. The share here is block-granular: a whole unit (one transformer block, or
the streamed resident unit) belongs to one rank, which receives that unit's averaged
gradients, steps it and sends its updated weights to the others. Units are not split, so the
shares are as even as the units' sizes allow (equal blocks over a rank count that divides
their number: exactly 1/N each); a rank may own nothing when there are fewer units than ranks.

Decided once, as plain data, by :func:`partition_units`; every rank computes the same answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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


def partition_units(numels: Sequence[int], world: int) -> HostPartition:
    """Give each unit to a rank so the ranks' element counts are as even as whole units allow.

    Largest unit first, each to the rank holding the fewest elements so far (ties: the lower
    rank; equal units: the earlier one first), so equal blocks go round-robin: on a backward
    pass, consecutive blocks' reductions then go to different ranks.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    load = [0] * world
    owners = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += numels[index]
    return HostPartition(tuple(owners), world)
