"""The NVMe tier's plan for a model before it runs: what ``estimate`` and ``bench offload --nvme`` read.

The strategy decides its tier at set-up (:meth:`L2LOffloadHooks._setup_tier`) from the host store it
built (fp32 masters, low-precision shadows, frozen weights as stored) and the optimizer's
per-element state. Rather than a second copy of that arithmetic, the same store is built here over
a copy of the model on fake tensors (nothing allocated) and planned by the same functions with the same
options (:func:`~lightning_accel.offload.tier_setup.tier_options`,
:func:`~lightning_accel.offload.tier_setup.overlap_blocker`,
:func:`~lightning_accel.offload.tier_setup.plan_tier_for`): the figures, the plan line and a budget's
refusal are the strategy's own (tests/estimate/test_tier_equal.py holds them equal). :func:`module_tier` is
the one door the preflight, ``estimate`` and ``bench offload --nvme`` go through. Only :func:`strategy_tier`
imports Lightning (to read the module's gradient hooks, as the strategy does).
"""

from __future__ import annotations

import dataclasses

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_accel.config.errors import UserError
from lightning_accel.models.block_policy import BlockPolicy
from lightning_accel.offload.host_store import HostStore
from lightning_accel.offload.partition import partition_units
from lightning_accel.offload.plan import Unit, make_plan
from lightning_accel.offload.disk_io import align_up
from lightning_accel.offload.tier_plan import TierPlan, UnitBytes
from lightning_accel.offload.tier_setup import check_tier_optimizers, compute_reads, overlap_blocker, plan_tier_for, tier_options
from lightning_accel.offload.tier_weights import in_a_file
from lightning_accel.stored import stored_nbytes


class TierRefused(UserError, ValueError):
    """The strategy would refuse this budget at set-up: its own one-line message (a ValueError too, as the
    strategy raises it, so callers that report an estimate's ValueError as a line report this one)."""


def tier_plan(net: nn.Module, optimizers: Sequence[Optimizer], *, blocks: BlockPolicy = "auto", offload_resident: bool | None = False,
              compute_dtype: torch.dtype = torch.float32, host_budget: int | None = None, nvme_path: str | None = None,
              cuda: bool = False, stored: Mapping[str, int] | None = None, owner: str = "L2LOffloadStrategy",
              overlap_step: bool | None = None, cannot_overlap: tuple[str, str | None] | None = None,
              checkpoint_blocks: bool = True, offload_activations: bool = False, prefetch_blocks: int = 1, world: int = 1,
              nvme_chunk: int | None = None, data_parallel: bool = False, device_memory: int | None = None) -> TierPlan:
    """The plan ``owner`` would make for ``net`` stepped by ``optimizers`` (the tier steps the first) under ``host_budget`` (bytes; None: no limit),
    spilling only with ``nvme_path``; ``cuda``: the device is a GPU (the pinned rings the copies cross count against the
    budget; on the CPU the resident unit kept on the device does); ``overlap_step``, ``offload_resident``,
    ``nvme_chunk``: the strategy's options (None: the plan chooses, :mod:`~lightning_accel.offload.tier_choice`);
    ``cannot_overlap``: why the blocks cannot step during the backward in this fit, and the fix (clipping,
    accumulation: :func:`~lightning_accel.offload.tier_setup.overlap_blocker`); ``data_parallel``: ``L2LOffloadDDPStrategy``
    (the plan does not stream the resident unit by itself); ``device_memory``: the GPU's (the strategy reads the CUDA
    device's total at set-up): the plan streams the resident unit where it would not fit; ``stored``: stored bytes of frozen weights that differ from their tensors (a QLoRA base left
    unquantized on meta: :func:`~lightning_accel.estimate.params.nf4_weights`), by name in ``net``; ``world`` (>1: data
    parallel, the host step partitioned over that many ranks): the plan of the rank stepping the most, whose files hold
    the optimizer state of its own units only (:func:`~lightning_accel.offload.partition.partition_units`).

    Builds a :class:`~lightning_accel.offload.host_store.HostStore` over ``net``'s blocks, which points each
    trainable parameter's ``data`` at its fp32 master (the tensor itself where it already is one). The plan's
    ``held`` says whether it streams the resident unit. Raises :class:`TierRefused` with the strategy's message where
    it would refuse the budget or the optimizer."""
    if nvme_path is not None:
        try:
            check_tier_optimizers(list(optimizers), owner)
        except ValueError as err:
            raise TierRefused(str(err)) from None
    optimizer = optimizers[0]
    plan = make_plan(net, blocks, offload_resident=bool(offload_resident))
    units = plan.blocks + ([plan.resident] if plan.offload_resident else [])  # the executor's tier_units
    store = HostStore(units, compute_dtype, pin=False)  # pinned: same bytes
    stepped = None
    if world > 1:  # as L2LOffloadDDPStrategy gives the units out (UnitOwners), and as estimate's l2l() picks the rank
        numels = [sum(p.numel() for _, p in u.params if p.requires_grad) for u in units]
        owners = partition_units(numels, world)
        rank = max(range(world), key=lambda r: sum(numels[i] for i in owners.owned(r)))
        stepped = {p for i in owners.owned(rank) for _, p in units[i].params}
    options = tier_options(overlap_step=overlap_step, offload_resident=offload_resident,
                           may_stream_resident=world == 1 and not data_parallel, cpu=not cuda, compute_dtype=compute_dtype,
                           nvme_path=nvme_path, nvme_chunk=nvme_chunk, offload_activations=offload_activations,
                           cannot_overlap=cannot_overlap, device_memory=device_memory if cuda else None)

    def reads_of(streamed: bool) -> list[int]:
        return compute_reads(len(plan.blocks), streamed, checkpoint_blocks, offload_activations)

    def as_stored(size: UnitBytes, unit: Unit) -> UnitBytes:
        return _as_stored(size, unit.params, store, stored or {})

    try:  # what the strategy's _setup_tier plans from
        chosen, _, _ = plan_tier_for(plan, store, optimizer, host_budget, options, reads_of, pin=cuda,
                                     prefetch_blocks=prefetch_blocks, stepped=stepped, adjust=as_stored)
    except ValueError as err:
        raise TierRefused(f"{owner}: {err}") from None
    return chosen


def _as_stored(unit: UnitBytes, params: list[tuple[str, nn.Parameter]], store: HostStore, stored: Mapping[str, int]) -> UnitBytes:
    """``unit`` with its frozen weights at the bytes they are stored in (``stored``: quantized in the run, a plain
    tensor here), where that differs from the tensor the store holds; a quantized weight stays in memory (it is no
    region of a file), so its bytes leave ``disk_weights``."""
    quantized = [(name, p) for name, p in params if name in stored and p in store.frozen]
    change = sum(stored[name] - stored_nbytes(store.master[p]) for name, p in quantized)
    in_files = sum(align_up(stored_nbytes(store.shadow[p])) for _, p in quantized if in_a_file(store.shadow[p]))
    if not change and not in_files:
        return unit
    return dataclasses.replace(unit, weights=unit.weights + change, disk_weights=unit.disk_weights - in_files)


def strategy_tier(strategy: Any, module: Any, net: nn.Module, compute_dtype: torch.dtype, cuda: bool,
                  stored: Mapping[str, int], trainer: Mapping[str, Any] | None = None, world: int = 1,
                  device_memory: int | None = None) -> TierPlan | None:
    """The plan an ``L2LOffloadStrategy`` with ``host_budget`` or ``nvme_path`` makes for ``module`` at set-up, ``net``'s
    parameters standing for the fp32 masters (fake tensors: nothing allocated); None without either option, or
    without an optimizer (nothing steps: the strategy makes no tier either). ``L2LOffloadDDPStrategy`` on ``world``
    ranks: one rank's plan (partitioned: the rank stepping the most)."""
    from lightning_accel.estimate.params import _optimizers

    nvme_path, budget = getattr(strategy, "nvme_path", None), getattr(strategy, "host_budget", None)
    if nvme_path is None and budget is None:
        return None
    optimizers = _optimizers(module.configure_optimizers())
    if not optimizers:
        return None
    # as the strategy decides it at set-up (L2LTierSetup._overlap_blocker): what needs every gradient before any block steps
    from lightning.pytorch import LightningModule

    from lightning_accel.strategies.user_hooks import overrides

    trainer = trainer or {}
    data_parallel = type(strategy).__name__ == "L2LOffloadDDPStrategy"
    blocker = overlap_blocker(optimizers[0], accumulate=int(trainer.get("accumulate_grad_batches") or 1),
                              clip=trainer.get("gradient_clip_val"), fp16_scaling=compute_dtype == torch.float16,
                              reads_gradients=isinstance(module, LightningModule)
                              and overrides(module, "on_after_backward", "on_before_optimizer_step"), data_parallel=data_parallel)
    return tier_plan(net, optimizers, blocks=strategy.blocks, offload_resident=strategy.offload_resident,
                     compute_dtype=compute_dtype, host_budget=budget, nvme_path=nvme_path, cuda=cuda, stored=stored,
                     owner=type(strategy).__name__, overlap_step=getattr(strategy, "overlap_step", None), cannot_overlap=blocker,
                     checkpoint_blocks=getattr(strategy, "checkpoint_blocks", True),
                     offload_activations=getattr(strategy, "offload_activations", False),
                     prefetch_blocks=getattr(strategy, "prefetch_blocks", 1), nvme_chunk=getattr(strategy, "nvme_chunk", None),
                     world=world if getattr(strategy, "host_step", None) == "partitioned" else 1, data_parallel=data_parallel,
                     device_memory=device_memory)


def module_tier(strategy: Any, module: Any, compute_dtype: torch.dtype, cuda: bool, trainer: Mapping[str, Any] | None = None,
                world: int = 1, device_memory: int | None = None) -> TierPlan | None:
    """:func:`strategy_tier` for a LightningModule as the user hands it to the Trainer (on meta, or with real weights:
    a copy is planned, on fake tensors standing for the fp32 masters, so nothing is allocated and ``module`` stays as it
    is): the plan the strategy makes at set-up, for the preflight, ``estimate`` and ``bench offload --nvme`` alike."""
    import copy

    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_accel.estimate.fake import fake_parameters
    from lightning_accel.estimate.params import nf4_weights

    if getattr(strategy, "nvme_path", None) is None and getattr(strategy, "host_budget", None) is None:
        return None
    module = copy.deepcopy(module)
    net = module.net if isinstance(getattr(module, "net", None), nn.Module) else module
    stored = nf4_weights(net, getattr(getattr(module, "frozen_base", None), "adapter", None))
    fake_parameters(net, FakeTensorMode(), lambda _n, p: torch.float32 if p.requires_grad else p.dtype)
    return strategy_tier(strategy, module, net, compute_dtype, cuda=cuda, stored=stored, trainer=trainer, world=world,
                         device_memory=device_memory)
