"""A strategy's set-up checks, asked before any work: :func:`check_strategy_setup`.

Each strategy validates at set-up what only its set-up sees: the blocks its policy names, the micro-batches a batch
splits into, the world size its pipeline layout divides, the optimizers it can host, the precision it pairs with. Those
checks live beside the mechanism they protect, as functions of plain data (``find_blocks``,
``pipeline.microbatch.check_chunks``, ``PipelineOptions.check_batch_size``, ``DistributedGPipeStrategy.check_layout``,
``offload.host_optimizer``); the strategy calls them at set-up, and preflight calls the same ones here, on the strategy
built from the composed config, the network built on the meta device, the configured batch size and world size, so bad
input is refused in one line, exit 2, before a run directory exists. Checked here in words of their own: what the
strategies take without a check at set-up (``prefetch_blocks`` beyond the blocks, more stages than blocks: they clamp it and
train with devices idle), and :func:`check_offload_precision`, whose input (a Trainer flag beside a plugin option) no
strategy sees.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_accel.config.errors import UserError, one_line

__all__ = ["check_load_by_block", "check_offload_precision", "check_strategy_setup", "check_tier"]


def _line(err: BaseException) -> str:
    return one_line(str(err)) or type(err).__name__


def check_strategy_setup(strategy: Any, module: Any, cfg: DictConfig, optimizers: Sequence[Any] | None = None) -> None:
    """Ask ``strategy`` (built from ``cfg.strategy``) its set-up questions about ``module`` (built on the meta device),
    the configured ``data.batch_size``, accelerator and world size ``trainer.devices x trainer.num_nodes``; under any
    strategy, the optimizers ``configure_optimizers`` builds (their own argument checks; ``optimizers``: those already
    built by :func:`lightning_accel.config.optim_checks.check_optimization`)."""
    import torch

    from lightning_accel.config.optim_checks import configured
    from lightning_accel.pipeline.microbatch import check_chunks
    from lightning_accel.strategies.gpipe import GPipeStrategy
    from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
    from lightning_accel.strategies.l2l_offload_hooks import L2LOffloadHooks

    optimizers = list(optimizers) if optimizers is not None else configured(module, cfg).optimizers  # under every strategy
    _as_user_error("model.net.load_by_block=true", check_load_by_block, module, strategy)
    if not isinstance(strategy, (GPipeStrategy, DistributedGPipeStrategy, L2LOffloadHooks)):
        return
    net = getattr(module, "net", None)
    net = net if isinstance(net, torch.nn.Module) else module
    # L2L streams the LightningModule's blocks (its model), the pipelines split the network's
    blocks = _check_blocks(strategy, module if isinstance(strategy, L2LOffloadHooks) else net)
    batch_size = (cfg.get("data") or {}).get("batch_size")
    batch_size = batch_size if isinstance(batch_size, int) and not isinstance(batch_size, bool) else None
    if isinstance(strategy, GPipeStrategy):
        _check_balance(strategy, len(blocks))
        if batch_size is not None:
            _as_user_error(f"data.batch_size={batch_size}", check_chunks, strategy.chunks, batch_size)
    if isinstance(strategy, DistributedGPipeStrategy):
        _check_pipeline(strategy, cfg, batch_size, len(blocks))
    if isinstance(strategy, L2LOffloadHooks):
        _check_prefetch(strategy, blocks)
        _check_host_optimizers(strategy, optimizers)
    _check_placement(strategy, cfg)
    _check_fit(strategy, module, cfg)
    if isinstance(strategy, L2LOffloadHooks):
        check_tier(strategy, module, cfg)


def _check_prefetch(strategy: Any, blocks: Sequence[Any]) -> None:
    """At most every block but the one computing can be on its way: more asks for blocks the model does not have."""
    ahead = strategy.prefetch_blocks
    if ahead >= len(blocks) and ahead > 0:
        raise UserError(f"strategy.prefetch_blocks={ahead}: the model has {len(blocks)} blocks ({type(blocks[0].module).__name__}), "
                        f"so at most {len(blocks) - 1} can be copied ahead of the one computing; set strategy.prefetch_blocks="
                        f"{min(1, len(blocks) - 1)} (hides the copy) to {len(blocks) - 1}")


def _check_placement(strategy: Any, cfg: DictConfig) -> None:
    """What the Trainer asks of where a strategy runs, asked as the Trainer will: a one-process strategy against more
    devices or nodes (its ``_configure_launcher``), a ``device=`` against the accelerator."""
    import torch

    from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy
    from lightning_accel.strategies.options_check import check_device_accelerator

    if not isinstance(strategy, L2LOffloadStrategy):
        return
    trainer = cfg.get("trainer") or {}
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    count = len(devices) if isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices) else devices if isinstance(devices, int) else 1
    where = f"trainer.devices={devices}" + (f" x num_nodes={nodes}" if nodes not in (None, 1) else "")
    if (isinstance(count, int) and count > 1) or (isinstance(nodes, int) and nodes > 1):
        probe = L2LOffloadStrategy()
        probe.parallel_devices = [torch.device("cpu")] * max(count, 1)
        probe.num_nodes = nodes if isinstance(nodes, int) else 1
        _as_user_error(where, probe._configure_launcher)
    device = strategy._root_device if strategy._device_given else None
    try:
        check_device_accelerator(type(strategy).__name__, device, str(trainer.get("accelerator")))
    except ValueError as err:
        keyed = getattr(err, "keyed", None)
        raise UserError(keyed("strategy") if callable(keyed) else _line(err)) from None


def _check_fit(strategy: Any, module: Any, cfg: DictConfig) -> None:
    """What a fit of the module needs that the strategy cannot honour, asked as its set-up asks: the strategies that wire
    DDP without its wrapper (manual optimization, ``trainer.sync_batchnorm``), L2L's delayed update (manual
    optimization)."""
    from lightning_accel.offload.host_optimizer import check_delayed_update
    from lightning_accel.strategies.ddp_without_wrapper import DDPWithoutWrapper
    from lightning_accel.strategies.l2l_offload_hooks import L2LOffloadHooks

    trainer = cfg.get("trainer") or {}
    if isinstance(strategy, DDPWithoutWrapper):
        _as_user_error(f"strategy={strategy.strategy_name}", strategy.check_fit, module, False)
        if trainer.get("sync_batchnorm") is True:
            _as_user_error("trainer.sync_batchnorm=true", strategy.check_fit, module, True)
    if isinstance(strategy, L2LOffloadHooks) and strategy.delayed_update:  # fp16: check_offload_precision
        _as_user_error("strategy.delayed_update=true", lambda: check_delayed_update(
            automatic_optimization=getattr(module, "automatic_optimization", True), module_name=type(module).__name__))


def _as_user_error(where: str, check: Any, *args: Any) -> Any:
    try:
        return check(*args)
    except ValueError as err:
        raise UserError(f"{where}: {_line(err)}") from None


def _check_blocks(strategy: Any, model: Any) -> list[Any]:
    """The blocks the strategy's policy finds (every repeated stack, as each strategy asks for them; L2L streams each
    child with parameters of a model without blocks, and gpipe cuts such a model at those children where its forward
    runs them as a chain)."""
    from lightning_accel.models.block_policy import find_blocks
    from lightning_accel.strategies.l2l_offload_hooks import L2LOffloadHooks

    policy = strategy.blocks
    shown = [str(p) for p in policy] if isinstance(policy, Iterable) and not isinstance(policy, str) else policy
    where = f"strategy.blocks={shown}" if isinstance(shown, (str, list)) else "strategy.blocks"
    from lightning_accel.strategies.gpipe import GPipeStrategy

    try:
        if isinstance(strategy, GPipeStrategy):  # its own search: a model without blocks is cut at its chained layers
            return strategy._find_blocks(model)
        return find_blocks(model, policy, stacks="all", children=isinstance(strategy, L2LOffloadHooks))
    except (ValueError, ImportError, AttributeError, TypeError) as err:
        raise UserError(f"{where}: {_line(err)}; pass the repeated block's class, e.g. strategy.blocks=[GPTBlock], or "
                        "strategy.blocks=auto" if isinstance(err, TypeError) else f"{where}: {_line(err)}") from None


def _check_balance(strategy: Any, blocks: int) -> None:
    """An explicit GPipe balance must cover the network's blocks (the strategy's own check); without one, each device
    is a stage, and a device without a block would sit idle."""
    from lightning_accel.pipeline.partition import check_balance

    if isinstance(strategy.balance, (list, tuple)):
        _as_user_error(f"strategy.balance={list(strategy.balance)}", check_balance, strategy.balance, blocks, len(strategy.devices))
    elif len(strategy.devices) > blocks:
        shown = [str(d) for d in strategy.devices]
        raise UserError(f"strategy.devices={shown}: {len(shown)} stages (one per device) for the model's {blocks} blocks would leave "
                        f"{len(shown) - blocks} device(s) idle; list at most {blocks} devices (strategy.devices=[...])")


def _world_size(cfg: DictConfig) -> int | None:
    trainer = cfg.get("trainer") or {}
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        return None  # "auto", a list of ids: the launcher counts them
    return devices * (nodes if isinstance(nodes, int) and nodes > 0 else 1)


def _check_pipeline(strategy: Any, cfg: DictConfig, batch_size: int | None, blocks: int) -> None:
    """A multi-process pipeline: a balance that covers the blocks, at most one stage per block, the world size its layout
    divides, and a batch size that some micro-batch count its schedule runs divides; refused now with the strategy's own
    checks, instead of after the processes start."""
    from lightning_accel.pipeline.distributed import stage_indices
    from lightning_accel.pipeline.partition import check_balance

    if isinstance(strategy.balance, (list, tuple)):
        _as_user_error(f"strategy.balance={list(strategy.balance)}", check_balance, strategy.balance, blocks, len(strategy.balance))
    world = _world_size(cfg)
    if world is None:
        return
    nodes = (cfg.get("trainer") or {}).get("num_nodes", 1)
    where = f"trainer.devices={cfg.trainer.devices}" + (f" x num_nodes={nodes}" if nodes not in (None, 1) else "")
    ranks = _as_user_error(where, strategy.check_layout, world)
    stages = len(stage_indices(0, ranks, strategy.schedule)) * ranks
    if stages > blocks:
        raise UserError(f"{where}: {ranks} ranks per pipeline run {stages} stages with schedule {strategy.schedule!r}, more than the "
                        f"model's {blocks} blocks (a stage holds at least one); run at most {blocks} ranks per pipeline "
                        "(trainer.devices, or strategy.pipeline_parallel_size for data parallel replicas)")
    if batch_size is not None:
        _as_user_error(f"data.batch_size={batch_size}", strategy.options.check_batch_size, batch_size, strategy.schedule, stages)


def _check_host_optimizers(strategy: Any, optimizers: Sequence[Any]) -> None:
    """The optimizers, asked what the L2L strategy asks at set-up."""
    from lightning_accel.offload.host_optimizer import check_delayed_optimizer, check_host_optimizer

    for optimizer in optimizers:
        where = f"strategy={strategy.strategy_name}"
        _as_user_error(where, check_host_optimizer, optimizer)
        if strategy.delayed_update:
            _as_user_error(where, check_delayed_optimizer, optimizer)


def check_offload_precision(strategy: Any, plugins: Sequence[Any], flag: Any) -> None:
    """L2L offload computes on device copies of fp32 host masters. ``trainer.precision=bf16-mixed``
    or ``16-mixed`` is paired by the strategy itself with the offload plugin of that flag (as
    ``precision=offload-*`` would set it); a flag that changes the masters' dtype (``bf16-true``,
    ``64-true``) the strategy refuses when the Trainer is built, so it is refused here first, in
    the same words. An offload plugin beside a flag, or without the strategy, means nothing."""
    from lightning_accel.offload.host_optimizer import check_delayed_update
    from lightning_accel.plugins.precision import OffloadPrecision
    from lightning_accel.plugins.precision.offload import KEEPS_FP32_MASTERS, OFFLOAD_PAIRS
    from lightning_accel.strategies.l2l_offload_hooks import L2LOffloadHooks  # l2l_offload and l2l_offload_ddp

    offload = next((p for p in plugins if isinstance(p, OffloadPrecision)), None)
    flag = None if flag is None else str(flag)
    if isinstance(strategy, L2LOffloadHooks):
        if offload is not None and flag is not None:
            raise UserError(
                f"trainer.precision={flag} and precision=offload-{offload.precision} are both set; "
                f"keep one: precision=offload-{OFFLOAD_PAIRS.get(flag) or offload.precision} (it sets trainer.precision=null)"
            )
        if offload is None and flag is not None and flag not in OFFLOAD_PAIRS:
            raise UserError(
                f"trainer.precision={flag}: strategy={strategy.strategy_name} {KEEPS_FP32_MASTERS}; "
                f"use precision=bf16-mixed, 16-mixed or 32-true"
            )
        paired = offload.precision if offload is not None else OFFLOAD_PAIRS.get(flag) if flag is not None else None
        if strategy.delayed_update and paired == "16-mixed":
            _as_user_error("strategy.delayed_update=true", lambda: check_delayed_update(fp16_scaling=True))
    elif offload is not None:
        raise UserError(
            f"precision=offload-{offload.precision} is for strategy=l2l_offload or l2l_offload_ddp, but the strategy is "
            f"{type(strategy).__name__ if strategy is not None else 'auto'}; use precision={offload.precision} or strategy=l2l_offload"
        )


def check_tier(strategy: Any, module: Any, cfg: DictConfig) -> None:
    """With ``host_budget`` or ``nvme_path``: the NVMe tier's plan, made as the strategy makes it at set-up (the same
    functions, :func:`lightning_accel.estimate.tier.module_tier`) on a copy of the meta network whose parameters stand
    for the fp32 masters (fake tensors: nothing allocated), so a budget that cannot be met is refused here in the
    strategy's own line (its advice included), before ``l2l_offload_ddp``'s ranks start."""
    from lightning_accel.estimate.recipe import _precision, stated_device_memory
    from lightning_accel.estimate.tier import TierRefused, module_tier

    if getattr(strategy, "nvme_path", None) is None and getattr(strategy, "host_budget", None) is None:
        return
    low, _ = _precision(cfg)
    cuda = str((cfg.get("trainer") or {}).get("accelerator")) in ("gpu", "cuda")
    key = "strategy.host_budget" if getattr(strategy, "host_budget", None) is not None else "strategy.nvme_path"
    try:
        module_tier(strategy, module, low, cuda=cuda, trainer=cfg.get("trainer") or {}, world=_world_size(cfg) or 1,
                    device_memory=stated_device_memory(cfg))
    except TierRefused as err:  # the strategy's own line, which names the key and the value
        line = _line(err)
        raise UserError(line if key in line else f"{key}={(cfg.get('strategy') or {}).get(key.split('.', 1)[1])}: {line}") from None
    except ValueError as err:
        raise UserError(f"{key}: {_line(err)}") from None


def check_load_by_block(module: Any, strategy: Any) -> None:
    """A model marked to be filled block by block (``hf_causal_lm(load_by_block=True)``, on the meta device) needs the L2L
    strategies, which materialize it unit by unit; under any other its weights would still be on meta at the first copy
    (torch's "Cannot copy out of meta tensor"). A ``ValueError`` naming the strategy and the fix: preflight and
    ``LanguageModelTask.setup`` (the Python API) ask it."""
    from torch import nn

    from lightning_accel.offload.materialize import loads_by_block
    from lightning_accel.strategies.l2l_offload_hooks import L2LOffloadHooks

    if isinstance(strategy, L2LOffloadHooks) or not loads_by_block(module):
        return
    if isinstance(module, nn.Module):
        # the fit ends here, and Lightning's teardown moves the module to the CPU, which a meta module cannot do: torch's
        # "Cannot copy out of meta tensor" would replace this line. Moves of this module (it holds no weight) do nothing.
        object.__setattr__(module, "_apply", lambda fn, recurse=True: module)
    name = getattr(strategy, "strategy_name", None) or (type(strategy).__name__ if strategy is not None and not isinstance(strategy, str) else strategy or "auto")
    raise ValueError(f"the model is on the meta device, to be filled block by block from its pretrained_path by strategy=l2l_offload "
                     f"or l2l_offload_ddp, but the strategy is {name}; use strategy=l2l_offload (or l2l_offload_ddp), or set "
                     "model.net.load_by_block=false to load it whole")
