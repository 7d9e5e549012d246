"""What the NVMe tier's plan chooses so that host memory keeps ``host_budget``: when the blocks step, where the resident
unit lives.

Two settings the user may leave to the plan change what the host keeps far more than any spill:

- **when the blocks step** (``overlap_step``): after the backward, every block's gradients wait for the step (4 B a
  parameter, the whole model's); during the backward, a few blocks' (:data:`~.tier_setup.BLOCKS_IN_FLIGHT`, the
  backward held back beyond them), whatever the depth. A CPU device steps after the backward by default (the host
  step would compete with the compute for the same cores); with the tier (``nvme_path``), whose point is host memory
  that does not grow with the model, the blocks step during the backward wherever nothing needs every gradient first;
- **the resident unit** (``offload_resident``: embeddings, head, final norm) on a CPU device is host memory too, with
  its gradients and optimizer state (16 B a parameter under AdamW: a 128k-vocabulary embedding's alone is GBs);
  streamed, its state and masters go to the tier's files like a block's.

:func:`choose_tier` tries what the user left open, the defaults first, and takes the first plan that keeps the
budget (:func:`~.tier_plan.plan_tier` spills the rest); the plan line says what it chose. A setting the user gave
that keeps the budget from being met, where leaving it to the plan would meet it, is refused in one line naming it
and the fix, never overridden. A pure function of sizes; nothing here imports torch or Lightning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from lightning_accel.offload.tier_plan import BudgetRefused, TierPlan, UnitBytes, human, plan_tier

BLOCKS_IN_FLIGHT = 4  # (tier_setup.BLOCKS_IN_FLIGHT: one block's gradients arriving, one stepping, two waiting)


@dataclass(frozen=True)
class TierOptions:
    """What the strategy was given, and what this fit allows."""

    overlap: bool | None  # overlap_step as given (None: the plan's)
    overlap_default: bool  # what overlap_step=None means without the tier (an accelerator: on; the CPU: off)
    # why the blocks cannot step during the backward this fit, and the fix (None: they can); e.g. ("gradient_clip_val=1.0
    # needs every gradient before any block steps", "drop gradient_clip_val")
    cannot_overlap: tuple[str, str | None] | None = None
    resident: bool | None = False  # offload_resident as given (None: the plan's)
    cpu: bool = False  # the device is the host: the resident unit kept on it is host memory
    # streamed, the resident unit computes as kept (a CPU device in fp32: on its masters either way; under bf16 streamed
    # it would compute on bf16 shadows, kept on its fp32 weights under autocast: not the same run)
    resident_alike: bool = True
    nvme: bool = False
    chunk: int | None = None  # strategy.nvme_chunk (None: the plan's)
    activations: bool = False  # offload_activations: the blocks' inputs wait on the host (the device side's, said on the line)
    # the device's memory where the strategy knows it (a CUDA device's total; None: unknown, or the device is the host)
    device_memory: int | None = None
    # what the resident unit kept on the device holds there (parameters, gradients, optimizer state), and what the blocks
    # in flight on it hold (prefetch_blocks + 1 blocks' weights as they cross): what the device-side choice compares
    resident_device: int = 0
    blocks_device: int = 0


@dataclass(frozen=True)
class TierChoice:
    in_backward: bool  # the blocks step during the backward
    stream_resident: bool  # the resident unit is a tier unit (streamed), not kept on the device


# the tier units' bytes (blocks, then a streamed resident unit) and a kept resident's host bytes, with or without the
# resident streamed
Sizes = Callable[[bool], tuple[list[UnitBytes], int]]


def choose_tier(options: TierOptions, sizes: Sizes, budget: int | None, *, fixed: int = 0, weight_buffers: int = 0,
                blocks_in_flight: int = BLOCKS_IN_FLIGHT, streamed: bool = False, staged: int = 0) -> tuple[TierPlan, TierChoice]:
    """The plan and what it chose (see the module doc); ``streamed``: the resident unit streams already (its only place);
    ``staged``: the largest parameter crossing the bus through the pinned rings (:attr:`~.tier_plan.TierPlan.staged`).
    Raises :class:`~.tier_plan.BudgetRefused` naming the figures and the fix; without a disk, where the disk alone would
    not meet the budget either, the fix names the budget the disk needs (the plan made again with ``nvme``: the one the
    user would get by following the advice)."""
    def choose(of: TierOptions, disk_floor: int | None = None) -> tuple[TierPlan, TierChoice]:
        return _choose(of, sizes, budget, fixed=fixed, weight_buffers=weight_buffers, blocks_in_flight=blocks_in_flight,
                       streamed=streamed, staged=staged, disk_floor=disk_floor)

    try:
        return choose(options)
    except BudgetRefused:
        if options.nvme or budget is None:
            raise
        floor = _least_with_disk(lambda: choose(dataclasses.replace(options, nvme=True)))
        if floor is None:
            raise
    return choose(options, disk_floor=floor)  # refused again, the advice naming the budget the disk needs


def _least_with_disk(choose: Callable[[], tuple[TierPlan, TierChoice]]) -> int | None:
    """The least host bytes the plan keeps with a disk, where that too is refused (None: the disk meets the budget)."""
    try:
        choose()
    except BudgetRefused as refused:
        return refused.least
    return None


def _choose(options: TierOptions, sizes: Sizes, budget: int | None, *, fixed: int, weight_buffers: int, blocks_in_flight: int,
            streamed: bool, staged: int, disk_floor: int | None = None) -> tuple[TierPlan, TierChoice]:
    overlap_open = options.overlap is None and options.cannot_overlap is None
    if options.overlap is not None:
        overlaps = [bool(options.overlap) and options.cannot_overlap is None]
    elif options.cannot_overlap is not None:
        overlaps = [False]
    elif options.nvme:
        overlaps = [True]
    else:
        overlaps = list(dict.fromkeys([options.overlap_default, True]))
    # (on an accelerator streaming it adds host bytes; without a disk it moves none)
    can_stream = options.cpu and options.nvme and options.resident_alike
    device_needs = _device_needs_streaming(options) and not streamed
    if device_needs and options.resident is False:
        raise BudgetRefused(
            f"offload_resident=False keeps the resident unit on the device ({human(options.resident_device)} with its gradients and "
            f"optimizer state, beside {human(options.blocks_device)} of blocks in flight), over the device's "
            f"{human(options.device_memory or 0)}; leave offload_resident unset (the plan streams it) or set it to True", 0)
    if streamed:
        residents = [True]
    elif device_needs:
        residents = [True]  # the device's need decides: streamed, whatever the host's plan would prefer
    else:
        residents = [bool(options.resident)] if options.resident is not None or not can_stream else [False, True]

    def plan(choice: TierChoice) -> TierPlan:
        units, kept = sizes(choice.stream_resident)
        found = plan_tier(units, budget, options.nvme, fixed=fixed, grads_in_flight=blocks_in_flight if choice.in_backward else None,
                          held=1 if choice.stream_resident else 0, weight_buffers=weight_buffers, chunk=options.chunk,
                          resident_kept=0 if choice.stream_resident else kept, staged=staged, disk_floor=disk_floor)
        return dataclasses.replace(found, chosen=_said(options, choice), device_side=_device_side(options, choice))

    refusals: list[BudgetRefused] = []
    for stream in residents:
        for overlap in overlaps:
            choice = TierChoice(overlap, stream)
            try:
                return plan(choice), choice
            except BudgetRefused as err:
                refusals.append(err)
    least = min(refusals, key=lambda r: r.least)
    # what leaving the user's settings to the plan would keep: name them, if that meets the budget
    blocked = []
    if not overlap_open and True not in overlaps:
        why, fix = options.cannot_overlap or ("overlap_step=False holds every block's gradients until the step", "leave overlap_step unset")
        if fix is not None:
            blocked.append((why, fix))
    if can_stream and True not in residents and not streamed:
        blocked.append(("offload_resident=False keeps the resident unit (its parameters, gradients and optimizer state) in host "
                        "memory on the CPU device", "leave offload_resident unset"))
    if not blocked:
        raise least
    try:
        freed = plan(TierChoice(True, can_stream))
    except BudgetRefused:
        raise least from None
    raise BudgetRefused(
        f"strategy.host_budget={human(budget or 0)} cannot be met as configured: " + "; ".join(why for why, _ in blocked)
        + f" (the least it keeps: {human(least.least)}); left to the plan it keeps {human(freed.host_bytes)}: "
        + ", ".join(fix for _, fix in blocked) + f", or raise host_budget to at least {human(least.least, up=True)}", least.least)


def _device_needs_streaming(options: TierOptions) -> bool:
    """Whether the resident unit kept on the device, beside the blocks in flight, would not fit the device's memory (known:
    ``device_memory``), so that the plan streams it where ``offload_resident`` is unset. Activations are not counted (the
    batch is not known at set-up): a unit this rule keeps may still not fit with them."""
    if options.device_memory is None or not options.resident_device:
        return False
    return options.resident_device + options.blocks_device > options.device_memory


def _device_side(options: TierOptions, choice: TierChoice) -> tuple[str, ...]:
    """What keeps the device's memory, said on the plan line where the strategy was given it: the resident unit streamed
    (not kept on the device with its gradients and fp32 optimizer state), activations offloaded to the host; or chosen by
    the plan, the device's memory known."""
    said = []
    if choice.stream_resident and options.resident is None and _device_needs_streaming(options):
        said.append(f"the plan streamed the resident unit ({human(options.resident_device)} with its gradients and optimizer state, "
                    f"beside {human(options.blocks_device)} of blocks in flight, over the device's {human(options.device_memory or 0)})")
    elif choice.stream_resident and options.resident is not None and not options.cpu:
        said.append("the resident unit streamed (offload_resident: not on the device with its optimizer state)")
    if options.activations:
        said.append("the blocks' inputs on the host (offload_activations)")
    return tuple(said)


def _said(options: TierOptions, choice: TierChoice) -> tuple[str, ...]:
    """What the plan line says the plan chose (where the user left it open and the choice is not the default)."""
    said = []
    if options.overlap is None and choice.in_backward and not options.overlap_default:
        said.append(f"the blocks step during the backward ({BLOCKS_IN_FLIGHT} blocks' gradients at once)")
    if options.resident is None and choice.stream_resident and not _device_needs_streaming(options):
        said.append("the resident unit streamed through the tier")
    return tuple(said)
