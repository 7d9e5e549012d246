"""The NVMe tier decided and made for one offloaded model and its optimizer (what the strategy calls at set-up).

Sizes come from the host store (masters, shadows, frozen tensors as stored) and from the optimizer
(its per-element state, :mod:`.state_keys`), are planned against the budget (:mod:`.tier_plan`), and
only a plan that puts something on disk makes files (:class:`.tier.NVMeTier`). Nothing here imports
Lightning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_accel.offload.device_memory import DeviceMemory, for_device
from lightning_accel.offload.disk_io import align_up
from lightning_accel.offload.host_optimizer import PER_PARAMETER
from lightning_accel.offload.host_store import HostStore
from lightning_accel.offload.plan import OffloadPlan, Unit
from lightning_accel.offload.state_keys import StateKeys, per_element_state, state_nbytes
from lightning_accel.offload.tier import NVMeTier
from lightning_accel.offload.tier_choice import BLOCKS_IN_FLIGHT, Sizes, TierChoice, TierOptions, choose_tier
from lightning_accel.offload.tier_plan import TierPlan, UnitBytes, plan_tier
from lightning_accel.offload.tier_weights import in_a_file
from lightning_accel.stored import is_plain, stored_nbytes

__all__ = ["BLOCKS_IN_FLIGHT", "DATA_PARALLEL_STEP", "TierChoice", "TierOptions", "check_tier_optimizers", "compute_reads", "make_tier",
           "overlap_blocker", "plan_tier_for", "tier_inputs", "tier_options", "unit_bytes"]

# why l2l_offload_ddp's blocks cannot step during the backward (nothing the user can change)
DATA_PARALLEL_STEP = ("l2l_offload_ddp steps a block once its gradients are averaged over the ranks, after the backward", None)


def overlap_blocker(optimizer: Optimizer | None, *, accumulate: int = 1, clip: float | None = None, fp16_scaling: bool = False,
                    reads_gradients: bool = False, data_parallel: bool = False) -> tuple[str, str | None] | None:
    """Why the blocks cannot step during the backward in this fit, and the fix (None: nothing stops it): what needs every
    gradient before any block steps. The strategy asks it at set-up from its Trainer; ``estimate`` from the recipe."""
    if data_parallel:
        return DATA_PARALLEL_STEP
    if accumulate != 1:
        return (f"accumulate_grad_batches={accumulate} sums every block's gradients over the micro-batches before any block "
                "steps", "set accumulate_grad_batches=1")
    if clip:
        return f"gradient_clip_val={clip} needs every gradient before any block steps", "drop gradient_clip_val"
    if fp16_scaling:
        return "fp16 loss scaling checks every gradient before any block steps", "use precision='bf16-mixed'"
    if reads_gradients:
        return ("on_after_backward / on_before_optimizer_step read every gradient before any block steps",
                "drop those overrides")
    if optimizer is not None and not isinstance(optimizer, PER_PARAMETER):
        return f"{type(optimizer).__name__} is not a per-parameter optimizer", f"use one of {', '.join(c.__name__ for c in PER_PARAMETER)}"
    return None


def tier_options(*, overlap_step: bool | None, offload_resident: bool | None, may_stream_resident: bool, cpu: bool,
                 compute_dtype: torch.dtype, nvme_path: str | None, nvme_chunk: int | None, offload_activations: bool,
                 cannot_overlap: tuple[str, str | None] | None, device_memory: int | None = None) -> TierOptions:
    """The plan's options from the strategy's settings and this fit's facts, for the strategy at set-up and ``estimate``
    alike (one construction, so both make the same plan). ``may_stream_resident``: the plan may stream the resident unit
    where ``offload_resident`` is unset (not under data parallel: the units' owners are given out before the plan), and
    (``device_memory``: the device's, where known) streams it where it would not fit the device (:mod:`.tier_choice`)."""
    return TierOptions(overlap=overlap_step, overlap_default=not cpu, cannot_overlap=cannot_overlap,
                       resident=offload_resident if may_stream_resident else bool(offload_resident), cpu=cpu,
                       resident_alike=compute_dtype == torch.float32, nvme=nvme_path is not None, chunk=nvme_chunk,
                       activations=offload_activations, device_memory=device_memory if may_stream_resident else None)


def _master_dtype(param: nn.Parameter, store: HostStore) -> torch.dtype:
    """The dtype of ``param``'s master in ``store``, or the one the store would give it (HostStore._keep_trainable)."""
    if param in store.master:
        return store.master[param].dtype
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def unit_bytes(unit: Unit, store: HostStore, keys: dict[nn.Parameter, StateKeys], reads: int = 0) -> UnitBytes:
    """``unit``'s host bytes by kind; state and masters as laid out on disk (each tensor aligned). ``reads``: how often a
    step's compute runs on this unit's weights; it reads the fp32 masters only where they are what it runs on (no
    low-precision shadow). A unit the store does not hold (a resident unit kept on the device) is sized as the store
    would hold it streamed: a trainable matrix gets a shadow where the compute dtype is a low precision."""
    state = masters = weights = grads = on_masters = on_disk = shadows = 0
    param_grads = []
    for _, param in unit.params:
        held = param in store.master
        if (param in store.frozen) if held else not param.requires_grad:
            stored = store.shadow[param] if held else param.data
            weights += stored_nbytes(stored)
            on_disk += align_up(stored_nbytes(stored)) if in_a_file(stored) else 0
            continue
        dtype = _master_dtype(param, store)
        nbytes = param.numel() * dtype.itemsize
        masters += align_up(nbytes)
        grads += nbytes
        param_grads.append(nbytes)
        state += sum(align_up(state_nbytes(((k, d),), param.numel())) for k, d in keys.get(param, ()))
        if held:
            shadow = None if store.shadow[param] is store.master[param] else stored_nbytes(store.shadow[param])
        else:
            low = store.compute_dtype != torch.float32 and dtype != torch.float64 and param.ndim >= 2
            shadow = param.numel() * store.compute_dtype.itemsize if low else None
        if shadow is not None:
            weights += shadow
            on_disk += align_up(shadow)
            shadows += align_up(shadow)
        else:
            on_masters += align_up(nbytes)
    return UnitBytes(unit.name, state, masters, weights, grads, reads if reads and (on_masters or on_disk) else 0, on_masters,
                     on_disk, shadows, tuple(param_grads))


def kept_bytes(unit: Unit, keys: dict[nn.Parameter, StateKeys]) -> int:
    """Host bytes of a unit kept on a CPU device (the resident unit): its parameters as they are, a gradient for each
    trainable one, and its optimizer state."""
    total = 0
    for _, param in unit.params:
        total += stored_nbytes(param.data)
        if param.requires_grad:
            total += param.numel() * param.element_size() + state_nbytes(keys.get(param, ()), param.numel())
    return total


def check_tier_optimizers(optimizers: list[Optimizer], owner: str) -> None:
    """The tier steps one unit at a time through its buffers: one optimizer, with a per-parameter rule."""
    if len(optimizers) != 1:
        raise ValueError(f"{owner}(nvme_path=...) steps the host parameters of one optimizer through its buffers, but "
                         f"configure_optimizers returned {len(optimizers)}; return one optimizer, or drop nvme_path")
    optimizer = optimizers[0]
    if type(optimizer) not in PER_PARAMETER:
        raise ValueError(
            f"{owner}(nvme_path=...) steps one unit at a time, which is one step only for a per-parameter optimizer, not "
            f"{type(optimizer).__name__}; use one of {', '.join(c.__name__ for c in PER_PARAMETER)}, or drop nvme_path")


def compute_reads(blocks: int, offload_resident: bool, checkpoint_blocks: bool = True, offload_activations: bool = False) -> list[int]:
    """How often a step's compute runs on each tier unit's weights (:meth:`~.executor.L2LExecutor.tier_units`' order):
    a checkpointed block twice (its forward, its recomputation in the backward), the last block once where its
    forward turns into its backward (checkpointing without ``offload_activations``: :mod:`.executor`), every block
    once without checkpointing, a streamed resident unit once (held from the forward to the end of the backward)."""
    turn = blocks - 1 if checkpoint_blocks and not offload_activations else None
    reads = [2 if checkpoint_blocks and i != turn else 1 for i in range(blocks)]
    return reads + ([1] if offload_resident else [])


# Buffers for the compute's reads of a block's masters or weights on disk beyond the prefetch depth: the block
# computing, and the block whose forward turned into its backward, held while the blocks before it are recomputed
# (:mod:`.executor`); a streamed resident unit (held for the whole step) reads into one of its own (:mod:`.tier_weights`)
WEIGHT_BUFFERS_BEYOND_PREFETCH = 2


def tier_inputs(units: list[Unit], store: HostStore, optimizer: Optimizer | None, cuda: bool,
                reads: list[int] | None = None, stepped: set[nn.Parameter] | None = None, kept: Unit | None = None,
                ) -> tuple[list[UnitBytes], int, dict[nn.Parameter, StateKeys]]:
    """What the plan is made from, for the strategy and ``estimate`` alike: each unit's bytes, the largest parameter
    crossing the bus on CUDA as it crosses (a shadow, an fp32 master without one, a frozen weight as stored: what sizes
    the slots of the pinned rings, :attr:`~.tier_plan.TierPlan.staged`; 0 on the CPU device), and the per-element state
    keys (of ``kept``'s parameters too: a resident unit
    kept on the device). ``reads``: :func:`compute_reads`. ``stepped``: the parameters this process steps, the only ones
    it keeps optimizer state for (data parallel with the host step partitioned: its own units'); None: every one."""
    trainable = [p for u in units for _, p in u.params if p.requires_grad and p not in store.frozen]
    extra = [p for _, p in kept.params if p.requires_grad and p not in store.master] if kept is not None else []
    # (a resident unit kept on the device steps on every rank: its state is each rank's)
    owned = [p for p in trainable if stepped is None or p in stepped] + extra
    keys = per_element_state(optimizer, owned, {p: _master_dtype(p, store) for p in owned}) if optimizer else {}
    crossing = [store.shadow[p] for u in units for _, p in u.params if p in store.shadow and is_plain(store.shadow[p])]
    staged = max((stored_nbytes(t) for t in crossing), default=0) if cuda else 0
    reads = reads if reads is not None else [0] * len(units)
    return [unit_bytes(u, store, keys, r) for u, r in zip(units, reads, strict=True)], staged, keys


def plan_tier_for(plan: OffloadPlan, store: HostStore, optimizer: Optimizer | None, budget: int | None, options: TierOptions,
                  reads_of: Callable[[bool], list[int]], pin: bool, prefetch_blocks: int = 1,
                  stepped: set[nn.Parameter] | None = None, adjust: Callable[[UnitBytes, Unit], UnitBytes] | None = None,
                  ) -> tuple[TierPlan, TierChoice, dict[nn.Parameter, StateKeys]]:
    """The tier's plan for an executor's ``plan`` and ``store`` under ``budget``, with what it chose
    (:func:`~.tier_choice.choose_tier`): when the blocks step, and (a CPU device with ``nvme_path``, ``offload_resident``
    left open) whether the resident unit streams. ``reads_of(streamed)``: :func:`compute_reads` with the resident unit
    streamed or not; ``adjust``: a unit's bytes as ``estimate`` knows them better (a quantized base left unquantized on
    meta). The strategy streams the resident unit (a new executor) where the plan chose it, then plans again.
    Raises :class:`~.tier_plan.BudgetRefused` (a ValueError) with the figures and the fix."""
    streams = plan.offload_resident
    units = plan.blocks + ([plan.resident] if streams else [])
    _, staged, keys = tier_inputs(units, store, optimizer, cuda=pin, stepped=stepped, kept=None if streams else plan.resident)

    def sizes(stream: bool) -> tuple[list[UnitBytes], int]:
        tier_units = plan.blocks + ([plan.resident] if stream else [])
        sized = [unit_bytes(u, store, keys, r) for u, r in zip(tier_units, reads_of(stream), strict=True)]
        if adjust is not None:
            sized = [adjust(size, unit) for size, unit in zip(sized, tier_units)]
        return sized, kept_bytes(plan.resident, keys) if options.cpu and not stream else 0

    if options.device_memory is not None:  # what the resident unit kept would hold on the device (streamed: why it is)
        blocks, _ = sizes(False)
        crossing = max((u.weights + u.compute_masters for u in blocks), default=0)
        options = dataclasses.replace(options, resident_device=kept_bytes(plan.resident, keys),
                                      blocks_device=(prefetch_blocks + 1) * crossing)
    tier_plan, choice = choose_tier(options, sizes, budget, staged=staged, streamed=streams,
                                    weight_buffers=prefetch_blocks + WEIGHT_BUFFERS_BEYOND_PREFETCH)
    return tier_plan, choice, keys


def make_tier(units: list[Unit], store: HostStore, optimizer: Optimizer | None, budget: int | None, nvme_path: str | None,
              pin: bool | DeviceMemory, steps_in_backward: bool = False, held: int = 0, reads: list[int] | None = None,
              prefetch_blocks: int = 1, stepped: set[nn.Parameter] | None = None, chunk: int | None = None,
              tier_plan: TierPlan | None = None) -> tuple[TierPlan, NVMeTier | None]:
    """The tier plan for ``units`` (the executor's :meth:`~.executor.L2LExecutor.tier_units`) under ``budget``, and the
    tier itself when the plan spills (else None). ``steps_in_backward``: every step runs block by block during the
    backward (gradients held at once: :data:`BLOCKS_IN_FLIGHT` blocks'); ``held``: the last units keep theirs;
    ``reads``: :func:`compute_reads` (None: the compute never reads masters); ``prefetch_blocks``: the executor's
    prefetch depth (blocks whose weights are read ahead of their compute); ``stepped``: as for :func:`tier_inputs` (the
    other units' files hold their masters and weights only); ``chunk``: ``strategy.nvme_chunk``; ``tier_plan``: a plan
    already made for these units (:func:`plan_tier_for`), laid out as it is."""
    # the tier's buffers come from the device's layer (pinned and counted on CUDA; its stand-in on the CPU device)
    memory = pin if isinstance(pin, DeviceMemory) else for_device(torch.device("cuda" if pin else "cpu"))
    sizes, staged, keys = tier_inputs(units, store, optimizer, cuda=memory.staged, reads=reads, stepped=stepped)
    if tier_plan is None:
        tier_plan = plan_tier(sizes, budget, nvme=nvme_path is not None, staged=staged,
                              grads_in_flight=BLOCKS_IN_FLIGHT if steps_in_backward else None, held=held,
                              weight_buffers=prefetch_blocks + WEIGHT_BUFFERS_BEYOND_PREFETCH, chunk=chunk)
    if not tier_plan.spills:
        return tier_plan, None
    assert optimizer is not None and nvme_path is not None
    return tier_plan, NVMeTier(store, units, tier_plan, optimizer, keys, nvme_path, pin=memory)
