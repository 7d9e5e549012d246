"""From a recipe and its overrides to an :class:`~.report.Estimate`: compose, build, measure, add up.

The recipe goes through the pre-run check (:func:`~lightning_accel.config.preflight.preflight`,
as ``validate`` runs it) once; the LightningModule that check built on the meta device with
the runner's own builder is the one measured, the strategy is built from the config, the
blocks are found by the policy the strategies share, and the measurements run on fake
tensors: nothing is allocated, nothing downloaded. This module decides the
:class:`~.components.Plan` from the recipe; the arithmetic lives in :mod:`~.components`.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_accel.estimate.batch import batch_nbytes, fake_batch
from lightning_accel.estimate.components import DDP, FP32, GPIPE, GPIPE_DIST, L2L, L2L_DDP, PLAIN, XLA_SPMD, Plan, estimate_ranks
from lightning_accel.estimate.depth import measure_step_by_depth
from lightning_accel.estimate.fake import fake_attributes, fake_parameters
from lightning_accel.estimate.params import inventory, measure_optimizer, nf4_weights
from lightning_accel.estimate.report import Estimate, gb, named_device
from lightning_accel.estimate.tier import strategy_tier
from lightning_accel.models.block_policy import Block, find_blocks
from lightning_accel.pipeline.stack_carry import stack_ends

_MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_TRUE = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64, "64": torch.float64}


def _strategy(cfg: DictConfig) -> Any:
    """The recipe's strategy object (its constructor's checks and defaults), stages on the CPU
    where this machine lacks the recipe's devices, or None for ``strategy=auto``."""
    from lightning_accel.config.preflight import _strategy_node

    node = cfg.get("strategy")
    return instantiate(_strategy_node(cfg, launch=False)) if node is not None and "_target_" in node else None


def _kind(strategy: Any, world: int) -> str:
    from lightning_accel.strategies import GPipeStrategy, L2LOffloadDDPStrategy, L2LOffloadStrategy
    from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy

    from lightning_accel.strategies.xla_pjrt import XLAPJRTStrategy

    for cls, kind in ((L2LOffloadDDPStrategy, L2L_DDP), (L2LOffloadStrategy, L2L), (DistributedGPipeStrategy, GPIPE_DIST), (GPipeStrategy, GPIPE)):
        if isinstance(strategy, cls):
            return kind
    if isinstance(strategy, XLAPJRTStrategy) and world > 1:  # several devices: SPMD in one process
        return XLA_SPMD
    return DDP if world > 1 else PLAIN


def _precision(cfg: DictConfig) -> tuple[torch.dtype, torch.dtype | None]:
    """``(dtype of the trainable parameters or L2L's device copies, autocast dtype or None)``."""
    from lightning_accel.plugins.precision import OffloadPrecision

    for node in cfg.get("plugins") or []:
        plugin = instantiate(node)
        if isinstance(plugin, OffloadPrecision):
            low = plugin.compute_dtype
            return low, (low if low != torch.float32 else None)
    flag = str(cfg.trainer.get("precision") or "32-true")
    if flag in _MIXED:
        return _MIXED[flag], _MIXED[flag]
    return _TRUE.get(flag, torch.float32), None


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def stated_device(cfg: DictConfig) -> tuple[int, str] | None:
    """``(bytes, what)`` of the device a recipe's purpose states: a size (``one 24 GB GPU``) or an accelerator
    of :data:`~.report.DEVICES` (``one TPU v4 chip``: 32 GiB); None if it states neither."""
    purpose = str(OmegaConf.select(cfg, "recipe.purpose", default="") or "")
    match = re.search(r"(\d+)\s*GB", purpose)
    if match:
        return int(match.group(1)) * 10**9, f"the recipe's purpose: {match.group(0)}"
    named = named_device(purpose)
    return (named[1], f"the recipe's purpose: {named[0]}") if named else None


def stated_device_memory(cfg: DictConfig) -> int | None:
    """The device size a recipe states in its purpose, if any (:func:`stated_device`)."""
    stated = stated_device(cfg)
    return stated[0] if stated else None


def local_gpu() -> tuple[int, str] | None:
    """``(bytes, what)`` of this machine's first CUDA GPU, or None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.total_memory, f"this machine's {props.name}"


def _loader_bytes(cfg: DictConfig, datamodule: Any, batch_size: int) -> int:
    """Batches a rank's loader holds at once: ``prefetch_factor`` (2) per worker, or the one being
    made in the main process, plus the pinned copy with ``pin_memory``."""
    data = cfg.data
    workers = int(data.get("num_workers") or 0)
    held = 2 * workers if workers else 1
    return (held + (1 if data.get("pin_memory") else 0)) * batch_nbytes(datamodule, batch_size)


def _balance(strategy: Any, kind: str, blocks: list[Block], world: int, notes: list[str]) -> tuple[tuple[int, ...], int]:
    """Blocks per stage as the strategy would split them, and stages per rank."""
    from lightning_accel.pipeline import balance_by_cost, block_bytes
    from lightning_accel.pipeline.schedule import SCHEDULE_TABLE

    per_rank = SCHEDULE_TABLE[strategy.schedule].stages_per_rank if kind == GPIPE_DIST else 1
    if not isinstance(strategy.balance, str):
        return tuple(strategy.balance), per_rank
    if kind == GPIPE:
        stages = min(len(strategy.devices), len(blocks))
    else:
        stages = (strategy._pp_size or world) * per_rank
    if strategy.balance == "by_time":
        notes.append("balance='by_time' is decided by timing the blocks at the start of a run; estimated with by_size's split")
    return tuple(balance_by_cost(block_bytes([b.module for b in blocks]), stages)), per_rank


def plan_of(cfg: DictConfig, strategy: Any, blocks: list[Block], datamodule: Any, notes: list[str]) -> Plan:
    """The settings the estimate needs, read once from the composed recipe and its strategy."""
    from lightning_accel.config.validate import devices_needed

    world = devices_needed(cfg)
    if world < 1:  # trainer.devices=-1 on a machine without the recipe's GPUs
        notes.append("trainer.devices=-1 means every GPU of the node; estimated for one rank, pass trainer.devices=N for N")
        world = 1
    kind = _kind(strategy, world)
    if kind == GPIPE:  # one process, its stages on devices of their own
        world = 1
    low, _ = _precision(cfg)
    on_cpu = str(cfg.trainer.accelerator) == "cpu"
    settings: dict[str, Any] = {}
    if kind in (L2L, L2L_DDP):
        settings = dict(
            prefetch_blocks=strategy.prefetch_blocks, offload_resident=bool(strategy.offload_resident),
            checkpoint_blocks=strategy.checkpoint_blocks, offload_activations=strategy.offload_activations,
            delayed_update=bool(strategy.delayed_update), partitioned=getattr(strategy, "host_step", "replicated") == "partitioned",
        )
    if kind in (GPIPE, GPIPE_DIST):
        balance, per_rank = _balance(strategy, kind, blocks, world, notes)
        schedule = strategy.schedule if kind == GPIPE_DIST else "gpipe"
        if schedule == "interleaved_1f1b":
            notes.append("interleaved_1f1b: every micro-batch's activations counted as alive on each rank (GPipe's bound)")
        settings = dict(chunks=strategy.chunks, schedule=schedule, checkpoint=strategy.checkpoint, balance=balance, stages_per_rank=per_rank)
        if kind == GPIPE_DIST:  # an encoder's output travels beside the activations to every decoder stage
            settings["stack_ends"] = stack_ends([b.name for b in blocks])
    batch_size = int(cfg.data.batch_size)
    return Plan(
        strategy=kind, world=world, on_cpu=on_cpu,
        param_size=_size(low) if str(cfg.trainer.get("precision") or "") in _TRUE else FP32,
        compute_size=_size(low), pin=not on_cpu, loader_bytes=_loader_bytes(cfg, datamodule, batch_size), **settings,
    )


def _device_dtype(plan: Plan, blocks: list[Block], low: torch.dtype) -> Any:
    """What each parameter computes in on the device: L2L's copies (matrices in the compute dtype,
    vectors fp32; the resident unit fp32 unless streamed), else the trainable parameters' dtype."""
    prefixes = tuple(f"{b.name}." for b in blocks)

    def dtype_of(name: str, param: nn.Parameter) -> torch.dtype:
        if not param.requires_grad:
            return param.dtype
        if plan.strategy in (L2L, L2L_DDP):
            streamed = name.startswith(prefixes) or plan.offload_resident
            return low if streamed and param.ndim >= 2 else torch.float32
        return low if plan.param_size != FP32 else torch.float32

    return dtype_of


def estimate_recipe(recipe: str, overrides: list[str], device_memory: int | None = None, host_memory: int | None = None,
                    built: tuple[DictConfig, Any] | None = None) -> Estimate:
    """The recipe's estimate (see the module doc); ``device_memory`` defaults to the device the
    recipe states (a size or an accelerator), else, for a GPU recipe, this machine's first GPU;
    ``host_memory`` to this machine's available memory. ``built``: what ``preflight_built(recipe,
    overrides, launch=False)`` returned, where the caller already ran it (``validate``); the
    estimate takes the module over (it fakes its parameters)."""
    from lightning_accel.config.preflight import _quiet, preflight_built
    from lightning_accel.host_memory import available_host_bytes

    # the module the check built on meta from this very config (built again, it cost a 70B LoRA seconds)
    cfg, module = built if built is not None else preflight_built(recipe, overrides, launch=False)
    notes: list[str] = []
    with _quiet():
        strategy = _strategy(cfg)
    datamodule = instantiate(cfg.data)
    net = module.net if isinstance(getattr(module, "net", None), nn.Module) else module
    try:
        # L2L streams every stack (an encoder-decoder's both) and both pipelines pipeline them in turn
        every = _kind(strategy, 1) in (L2L, L2L_DDP, GPIPE, GPIPE_DIST)
        blocks = find_blocks(net, getattr(strategy, "blocks", "auto"), stacks="all" if every else "one")
    except ValueError:
        blocks = []  # plain training needs no blocks; the strategies that do refused the recipe in preflight
    plan = plan_of(cfg, strategy, blocks, datamodule, notes)
    low, autocast = _precision(cfg)

    mode = FakeTensorMode()
    stored = nf4_weights(net, getattr(getattr(module, "frozen_base", None), "adapter", None))
    masters = plan.strategy in (L2L, L2L_DDP)  # the host optimizer steps fp32 masters
    fake_parameters(net, mode, lambda _n, p: (torch.float32 if masters or plan.param_size == FP32 else low) if p.requires_grad else p.dtype)
    fake_attributes(module, mode)  # metric states the step updates
    # the step of plain / DDP / GPipe runs on the device (foreach there, torch's default on CUDA);
    # L2L's host step takes the fused CPU kernels and only the resident unit steps on the device
    optimizer = measure_optimizer(module, net, mode, foreach=not plan.on_cpu and not masters, scratch=not masters)
    inv = inventory(net, blocks, stored, optimizer.state)
    # the NVMe tier's plan, from the fp32 masters as the strategy's host store holds them (refused as it would be)
    device = (device_memory, "--device-memory") if device_memory is not None else stated_device(cfg)
    if device is None and str(cfg.trainer.accelerator) in ("gpu", "cuda"):
        device = local_gpu()
    tier = strategy_tier(strategy, module, net, low, cuda=not plan.on_cpu, stored=stored, trainer=cfg.get("trainer") or {},
                         world=plan.world, device_memory=device[0] if device else None) if plan.strategy in (L2L, L2L_DDP) else None
    if tier is not None and plan.strategy == L2L_DDP:
        notes.append("the NVMe tier: each rank its own files under nvme_path; the plan and the disk column are one rank's"
                     + (" (the one stepping the most; partitioned, a rank's files hold its own blocks' optimizer state)"
                        if plan.partitioned and plan.world > 1 else ""))
    if tier is not None and tier.held and not plan.offload_resident:  # the plan streams the resident unit (CPU, host_budget)
        plan = replace(plan, offload_resident=True)
    if tier is not None and tier.budget is not None:
        per_rank = " on each rank" if plan.strategy == L2L_DDP else ""
        unmoved = "activations on a CPU device, the loader's batches" if plan.on_cpu else "the loader's batches"
        notes.append(f"host_budget {gb(tier.budget)} bounds what the offload keeps{per_rank} (the plan: {gb(tier.host_bytes)}); the host "
                     f"column also counts what no plan moves ({unmoved})")

    fake_parameters(net, mode, _device_dtype(plan, blocks, low))
    micro = max(int(cfg.data.batch_size) // (plan.chunks * (plan.world if plan.strategy == XLA_SPMD else 1)), 1)
    batch = fake_batch(datamodule, micro, mode)
    trainable = [p for p in net.parameters() if p.requires_grad]
    checkpoint = plan.strategy in (L2L, L2L_DDP) and plan.checkpoint_blocks
    with mode:  # tensors the step makes from Python values are fake too
        acts = measure_step_by_depth(lambda: module.training_step(batch, 0), net, [(b.name, b.module) for b in blocks], trainable, autocast, checkpoint)
    ranks = estimate_ranks(inv, acts, replace(plan, step_scratch=optimizer.scratch, tier=tier))
    if plan.on_cpu:
        notes.append("these are tensor bytes; by default glibc keeps much of what a CPU step frees, and a run's peak RSS was "
                     "1.2x-2.5x them on the CPU recipes; MALLOC_MMAP_THRESHOLD_=32768 gives it back (docs/estimate.md)")
    return Estimate(
        recipe=str(recipe), strategy=plan.strategy, ranks=ranks,
        device_memory=device[0] if device and not plan.on_cpu else None,
        host_memory=host_memory if host_memory is not None else available_host_bytes(),
        on_cpu=plan.on_cpu, notes=notes, device_memory_from=device[1] if device and not plan.on_cpu else None, tier=tier,
    )
