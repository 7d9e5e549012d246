"""Which bytes of an offloaded model stay in host memory and which go to disk, decided from ``host_budget``.

A pure function of sizes (no tensors, no files), decided once before training, so ``estimate`` and a
test can call it as the strategy does. The order in which bytes leave host memory is the order in
which they are needed least often:

1. the optimizer state (AdamW: two fp32 moments, 8 B a parameter): read and written once per step,
   by the host step alone;
2. the fp32 masters (4 B): read and written once per step by the host step; where the device computes
   on them (fp32 on the host itself, CPU runs; a GPU under ``32-true`` copies them) the forward and the
   backward's recomputation read them too (``UnitBytes.compute_reads``), ahead of the compute, into
   ``weight_buffers`` buffers of their own (:mod:`.tier_weights`);
3. the weights the device computes on (low-precision shadows, frozen bases): read twice a step, by
   the forward and the backward's recomputation, ahead of it into the weight buffers (the shadows are
   also written by the host step, with their masters). Quantized frozen weights (tensor subclasses)
   stay in host memory: ``UnitBytes.disk_weights`` counts the weights that can go.

Gradient buffers stay in host memory (they are written as the backward produces them), and so do
the tier's own reusable buffers, which this plan counts. The host step streams each unit through
``slots`` buffers of one *chunk* each (one chunk stepping, one being read ahead, one being written
back; :mod:`.tier_chunks`), so what it keeps does not grow with the largest unit: the chunk is the
plan's choice (:func:`default_chunk`: from the budget; ``strategy.nvme_chunk`` sets it), capped at the
largest unit's span (a small model's unit is one chunk). The compute's reads need a whole block at
once: ``weight_buffers`` buffers of the largest block's span, and one of its own for each unit held for
the whole step (a streamed resident unit: ``held``). Spilling goes unit by unit, from the first block
on, so that a budget a little short of the whole model puts only a few units on disk.

On a GPU the copies to and from the device cross two rings of pinned buffers (:mod:`.staging`):
``GRAD_SLOTS`` for the gradients landing and ``COPY_SLOTS`` for the weights leaving, each slot one chunk, or
the largest parameter crossing the bus where that is less (``staged``). That is all the pinned memory besides
the I/O buffers: a few chunks, whatever the depth (``staging_bytes``, counted against the budget).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str, key: str = "strategy.host_budget") -> int:
    """``8GB``, ``512MiB``, ``1.5e9`` or a number of bytes; a value that is none of these is refused naming ``key``."""
    if isinstance(value, bool):
        raise TypeError(f"{key}={value!r} is not a size; give bytes or a string such as '8GB' or '512MiB'")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{key}={value!r} is not a size; give bytes or a string such as '8GB' or '512MiB'")
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise TypeError(f"{key}={value!r} is not a size; give bytes or a string such as '8GB' or '512MiB'")
    nbytes = int(number * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"{key}={value!r} must be more than 0 bytes; give the host memory the offload may keep, e.g. '8GB'")
    return nbytes


def human(nbytes: int, up: bool = False) -> str:
    """Bytes as the plan line and the errors print them (decimal units, as disks and budgets are quoted); ``up``: rounded
    up, for a figure the advice says to set "at least" (the printed value, given back, must be enough)."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= size:
            value = math.ceil(nbytes * 100 / size) / 100 if up else nbytes / size
            return f"{value:.2f} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True)
class UnitBytes:
    """One offloaded unit's host bytes by kind (state and masters counted as laid out on disk: each tensor
    rounded up to the disk's alignment)."""

    name: str
    state: int  # optimizer state of its trainable parameters, once it exists
    masters: int  # their fp32 masters
    weights: int  # low-precision shadows and frozen tensors as stored
    grads: int  # fp32 gradient buffers
    # how often a step's compute reads the fp32 masters it runs on (1: a block whose forward turns into its backward, a
    # streamed resident unit; 2: a checkpointed block, forward and recomputation), and their bytes as laid out (the
    # masters of parameters without a low-precision shadow: all of them in fp32, the vectors kept in fp32 under bf16)
    compute_reads: int = 0
    compute_masters: int = 0
    disk_weights: int = 0  # the weights that can live in a file (plain tensors: shadows, frozen weights not quantized)
    step_weights: int = 0  # of disk_weights, the shadows the host step rewrites with their masters (frozen: never read)
    # each trainable parameter's gradient bytes: a held unit in the tier steps parameter by parameter during the backward
    param_grads: tuple[int, ...] = ()


# the host step's buffers: one chunk stepping, one read ahead, one being written back
SLOTS = 3
MIN_CHUNK = 1 << 20  # the least chunk: below it the per-call overhead of the optimizer and the I/O dominates
DEFAULT_CHUNK = 64 << 20  # without a budget: 16 requests of 4 MiB in flight per chunk, a few optimizer calls per GB
MAX_CHUNK = 256 << 20
# the pinned rings the copies cross on a GPU (:mod:`.staging`): gradient pieces landing from the device while the oldest
# is summed, and weight pieces, one filled on the host while the one before crosses the bus
GRAD_SLOTS = 4
COPY_SLOTS = 2
BUDGET_SHARE = 64  # with a budget: each step buffer takes at most 1/64 of it (the three, under 5%)


def default_chunk(budget: int | None) -> int:
    """The chunk the plan takes when ``strategy.nvme_chunk`` is unset: :data:`DEFAULT_CHUNK` without a budget; with
    one, 1/:data:`BUDGET_SHARE` of it between :data:`MIN_CHUNK` and :data:`MAX_CHUNK` (a tight budget's buffers stay
    small, a large one's chunks need no more), in whole MiB."""
    if budget is None:
        return DEFAULT_CHUNK
    return max(MIN_CHUNK, min(MAX_CHUNK, budget // BUDGET_SHARE >> 20 << 20))


def parse_chunk(value: int | float | str | None) -> int | None:
    """``strategy.nvme_chunk``: a size of at least :data:`MIN_CHUNK`, or None (the plan chooses)."""
    if value is None:
        return None
    nbytes = parse_bytes(value, "strategy.nvme_chunk")
    if nbytes < MIN_CHUNK:
        raise ValueError(f"strategy.nvme_chunk={value!r} is less than the least chunk, {MIN_CHUNK >> 20} MiB (below it the "
                         "optimizer's call and the I/O requests cost more than the step); give at least '1MiB', or leave it "
                         "unset (the plan chooses from host_budget)")
    return nbytes


@dataclass(frozen=True)
class TierPlan:
    """Per unit, whether its optimizer state, masters and weights live on disk; and what that costs."""

    units: tuple[UnitBytes, ...]
    state_on_disk: tuple[bool, ...]
    masters_on_disk: tuple[bool, ...]
    budget: int | None
    slots: int = SLOTS
    fixed: int = 0  # host bytes outside the units that no plan moves (pinned staging)
    # gradients held at once: None, every unit's (the step runs after the backward); k, the k largest units' (blocks
    # step as their gradients land during the backward, at most k waiting: the executor holds the backward back)
    grads_in_flight: int | None = None
    held: int = 0  # the last ``held`` units keep their gradients to the step whatever grads_in_flight says (a resident unit)
    # buffers the compute's reads of a block's masters or weights on disk land in (:mod:`.tier_weights`): the blocks held
    # for compute at once; each held unit (a streamed resident) has one of its own besides
    weight_buffers: int = 0
    weights_on_disk: tuple[bool, ...] = ()  # per unit, its disk_weights on disk (empty: none)
    chunk: int | None = None  # the most bytes of one step buffer (:mod:`.tier_chunks`); None: a whole unit
    resident_kept: int = 0  # the resident unit kept on a CPU device: host memory too (parameters, gradients, state)
    chosen: tuple[str, ...] = ()  # what the plan chose to keep the budget (:mod:`.tier_choice`), said on the plan line
    staged: int = 0  # the largest parameter crossing the bus through the pinned rings, as it crosses (0: a CPU device)
    device_side: tuple[str, ...] = ()  # what keeps the device's memory (:mod:`.tier_choice`), said on the plan line

    @property
    def staging_slot(self) -> int:
        """Bytes of each slot of the pinned rings: the chunk, or the largest parameter crossing the bus where less."""
        return min(self.chunk if self.chunk is not None else DEFAULT_CHUNK, self.staged)

    @property
    def staging_bytes(self) -> int:
        """The pinned rings the copies cross on a GPU (:mod:`.staging`): ``GRAD_SLOTS + COPY_SLOTS`` slots."""
        return (GRAD_SLOTS + COPY_SLOTS) * self.staging_slot

    @property
    def spills(self) -> bool:
        return any(self.state_on_disk) or any(self.masters_on_disk) or any(self.weights_on_disk)

    def spilled_weights(self, index: int) -> bool:
        return bool(self.weights_on_disk) and self.weights_on_disk[index]

    def unit_disk_bytes(self, index: int) -> int:
        unit = self.units[index]
        return (unit.state * self.state_on_disk[index] + unit.masters * self.masters_on_disk[index]
                + unit.disk_weights * self.spilled_weights(index))

    def step_span(self, index: int) -> int:
        """Bytes of ``index``'s file its host step reads and writes: state, masters and shadows on disk."""
        unit = self.units[index]
        return (unit.state * self.state_on_disk[index] + unit.masters * self.masters_on_disk[index]
                + unit.step_weights * self.spilled_weights(index))

    def compute_span(self, index: int) -> int:
        """Bytes of ``index``'s file the compute reads each time it runs on the unit: its weights where they are on
        disk, and the masters it runs on (no shadow) where those are."""
        unit = self.units[index]
        if not unit.compute_reads:
            return 0
        return unit.compute_masters * self.masters_on_disk[index] + unit.disk_weights * self.spilled_weights(index)

    @property
    def step_buffer(self) -> int:
        """Bytes of each of the ``slots`` step buffers: a chunk, or the largest unit's span where that is less."""
        largest = max((self.step_span(i) for i in range(len(self.units))), default=0)
        return largest if self.chunk is None else min(self.chunk, largest)

    @property
    def weight_buffer(self) -> int:
        """Bytes of each of the ``weight_buffers`` buffers: the largest block's compute span (held units' aside)."""
        return max((self.compute_span(i) for i in range(len(self.units) - self.held)), default=0)

    @property
    def buffer_bytes(self) -> int:
        """The reusable host buffers the step streams through (one more for a held unit in the tier: its parameters step
        out of the blocks' order), and those the compute's weights are read into."""
        held = range(len(self.units) - self.held, len(self.units))
        steps = self.slots + (1 if any(self.unit_disk_bytes(i) for i in held) else 0)
        return steps * self.step_buffer + self.weight_buffers * self.weight_buffer + sum(self.compute_span(i) for i in held)

    @property
    def disk_bytes(self) -> int:
        return sum(self.unit_disk_bytes(i) for i in range(len(self.units)))

    @property
    def host_bytes(self) -> int:
        """Everything the offload keeps in host memory: what is not on disk, the gradient buffers, the I/O buffers."""
        kept = sum(u.state + u.masters + u.weights for u in self.units) - self.disk_bytes
        return (kept + self.grad_bytes + self.fixed + self.resident_kept + self.staging_bytes
                + (self.buffer_bytes if self.spills else 0))

    @property
    def grad_bytes(self) -> int:
        """The gradient buffers held at once (see ``grads_in_flight``): the largest ``grads_in_flight`` of the blocks'
        and, for a held unit in the tier (a streamed resident unit, each parameter stepping as its gradient lands: the
        head's at the start of the backward, the embedding's at its end), of its parameters'; a held unit in memory
        keeps all of its gradients to the step."""
        if self.grads_in_flight is None:
            return sum(u.grads for u in self.units)
        blocks = len(self.units) - self.held
        items = [u.grads for u in self.units[:blocks]]
        kept = 0
        for i in range(blocks, len(self.units)):
            unit = self.units[i]
            if self.unit_disk_bytes(i) and unit.param_grads:
                items += unit.param_grads
            else:
                kept += unit.grads
        return sum(sorted(items, reverse=True)[:self.grads_in_flight]) + kept

    @property
    def compute_read_bytes(self) -> int:
        """Bytes the forward and the recomputation read from disk per step (weights and masters it runs on, on disk)."""
        return sum(self.compute_span(i) * u.compute_reads for i, u in enumerate(self.units))

    @property
    def step_read_bytes(self) -> int:
        """Bytes read from disk per optimizer step: what is on disk, once, by the host step, and the compute's reads."""
        return self.disk_bytes + self.compute_read_bytes

    @property
    def step_write_bytes(self) -> int:
        return self.disk_bytes

    def describe(self) -> str:
        chosen = f"; the plan chose: {', '.join(self.chosen)}" if self.chosen else ""
        if self.device_side:
            chosen += f"; for the device: {', '.join(self.device_side)}"
        if not self.spills:
            budget = f" (host_budget {human(self.budget)})" if self.budget is not None else ""
            return f"host {human(self.host_bytes)}, disk 0 B{budget}{chosen}"
        # of the units with optimizer state here (data parallel, partitioned: this rank's own)
        stateful = [i for i, u in enumerate(self.units) if u.state]
        state = sum(self.state_on_disk[i] for i in stateful)
        masters = sum(self.masters_on_disk)
        n = len(self.units)
        weights = f", weights of {sum(self.weights_on_disk)}/{n}" if any(self.weights_on_disk) else ""
        compute = f" (of which {human(self.compute_read_bytes)} by the compute)" if self.compute_read_bytes else ""
        pinned = f", {human(self.staging_bytes)} pinned staging" if self.staging_bytes else ""
        return (f"host {human(self.host_bytes)} (of which {human(self.buffer_bytes)} I/O buffers{pinned}; the host step in chunks of "
                f"{human(self.step_buffer)}), disk {human(self.disk_bytes)} (optimizer state of {state}/{len(stateful)} units, "
                f"fp32 masters of {masters}/{n}{weights}), {human(self.step_read_bytes)} read{compute} and "
                f"{human(self.step_write_bytes)} written per step{chosen}")


class BudgetRefused(ValueError):
    """A budget the plan cannot meet; ``least``: the least host bytes it could keep (everything it may move on disk)."""

    def __init__(self, message: str, least: int) -> None:
        super().__init__(message)
        self.least = least


def plan_tier(units: list[UnitBytes], budget: int | None, nvme: bool, slots: int = SLOTS, fixed: int = 0,
              grads_in_flight: int | None = None, held: int = 0, weight_buffers: int = 0, chunk: int | None = None,
              resident_kept: int = 0, staged: int = 0, disk_floor: int | None = None) -> TierPlan:
    """The plan for ``units`` under ``budget`` bytes of host memory (None: no limit), spilling to disk only when
    ``nvme`` (a ``nvme_path`` was given). With ``nvme`` and no budget, everything that can go to disk does.
    ``weight_buffers``: the buffers the compute's reads of a block on disk need (units with ``compute_reads``).
    ``chunk``: the user's ``strategy.nvme_chunk`` (None: :func:`default_chunk`, made smaller, down to
    :data:`MIN_CHUNK`, where that is what keeps the budget). ``resident_kept``: host bytes of a resident unit kept on a
    CPU device. ``staged``: the largest parameter crossing the bus on a GPU (:attr:`TierPlan.staged`; 0: a CPU device).
    ``disk_floor``: without ``nvme``, the least host bytes the plan would keep with a disk, where that too is over the
    budget (:func:`~.tier_choice.choose_tier` finds it): the refusal's advice then names the budget the disk needs,
    not the disk alone.

    Raises :class:`BudgetRefused` (a ValueError) naming the figures and the fix when the budget cannot be met."""
    n = len(units)
    state, masters, weights = [False] * n, [False] * n, [False] * n
    size = chunk if chunk is not None else default_chunk(budget)

    def plan() -> TierPlan:
        return TierPlan(tuple(units), tuple(state), tuple(masters), budget, slots, fixed, grads_in_flight, held, weight_buffers,
                        tuple(weights), size, resident_kept, staged=staged)

    current = plan()
    if budget is None and not nvme:
        return current
    if budget is not None and current.host_bytes <= budget:
        return current
    need = current.host_bytes
    if not nvme:
        spillable = sum(u.state + u.masters + u.disk_weights for u in units)
        if disk_floor is not None and budget is not None and disk_floor > budget:  # the disk alone would not do
            advice = (f"raise host_budget to at least {human(need, up=True)}, or set strategy.nvme_path=DIR and host_budget to at least "
                      f"{human(disk_floor, up=True)} (what stays on the host with the disk: its I/O buffers too)")
        else:
            advice = (f"set strategy.nvme_path=DIR to put up to {human(spillable)} of optimizer state, fp32 masters and weights "
                      f"on disk, or raise host_budget to at least {human(need, up=True)}")
        raise BudgetRefused(f"strategy.host_budget={human(budget or 0)} is less than the {human(need)} the offload keeps on the "
                            f"host ({_breakdown(current)}); {advice}", need)

    def spill() -> TierPlan | None:
        nonlocal current
        for kind in (state, masters, weights):
            for i in range(n):
                if kind is weights and not units[i].disk_weights:
                    continue
                kind[i] = True
                current = plan()
                if budget is not None and current.host_bytes <= budget:
                    return current
        return current if budget is None else None

    found = spill()
    if found is not None:
        return found
    assert budget is not None
    # everything on disk and still over: the step buffers and the pinned rings are what a smaller chunk can still give back
    smallest = dataclasses.replace(current, chunk=MIN_CHUNK)
    shrinks = smallest.host_bytes < current.host_bytes
    if chunk is None and shrinks and smallest.host_bytes <= budget:
        size = _largest_chunk(current, budget)
        state, masters, weights = [False] * n, [False] * n, [False] * n
        found = spill()
        assert found is not None
        return found
    if chunk is not None and smallest.host_bytes <= budget and shrinks:
        most = _largest_chunk(current, budget)
        raise BudgetRefused(
            f"strategy.host_budget={human(budget)} is less than the {human(current.host_bytes)} that stays on the host with "
            f"every unit's optimizer state, fp32 masters and weights on disk and strategy.nvme_chunk={human(chunk)} "
            f"({current.slots} step buffers of {human(current.step_buffer)}); set nvme_chunk to at most {human(most)} (or "
            f"leave it unset: the plan chooses), or raise host_budget to at least {human(current.host_bytes, up=True)}", smallest.host_bytes)
    least = smallest if chunk is None else current  # (the user's chunk is theirs: its figures)
    raise BudgetRefused(
        f"strategy.host_budget={human(budget)} is less than the {human(least.host_bytes)} that stays on the host with "
        f"every unit's optimizer state, fp32 masters and weights on disk ({_breakdown(least, on_disk=True)}, I/O buffers "
        f"{human(least.buffer_bytes)}); raise host_budget to at least {human(least.host_bytes, up=True)}", least.host_bytes)


def _largest_chunk(plan: TierPlan, budget: int) -> int:
    """The largest chunk (a multiple of 4 KiB, at least :data:`MIN_CHUNK`) with which ``plan`` keeps ``budget``."""
    low, high = MIN_CHUNK, max(MIN_CHUNK, plan.chunk or MIN_CHUNK)
    while high - low > 4096:
        mid = (low + high) // 2 >> 12 << 12
        if mid <= low:
            break
        if dataclasses.replace(plan, chunk=mid).host_bytes <= budget:
            low = mid
        else:
            high = mid
    return low


def _breakdown(plan: TierPlan, on_disk: bool = False) -> str:
    units = plan.units
    weights = sum(u.weights for u in units)
    rest = f", other {human(plan.fixed)}" if plan.fixed else ""
    if plan.staging_bytes:
        rest += f", pinned staging {human(plan.staging_bytes)}"
    if plan.resident_kept:
        rest += f", the resident unit kept on the CPU device {human(plan.resident_kept)}"
    grads = f"gradient buffers {human(plan.grad_bytes)}"
    if plan.grads_in_flight is not None:
        grads += f" ({plan.grads_in_flight} units' at once)"
    if on_disk:
        kept = weights - sum(u.disk_weights for u in units)
        return f"weights that cannot go to disk {human(kept)}, {grads}{rest}"
    return (f"optimizer state {human(sum(u.state for u in units))}, fp32 masters {human(sum(u.masters for u in units))}, "
            f"weights {human(weights)}, {grads}{rest}")
