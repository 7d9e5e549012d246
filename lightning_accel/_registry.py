"""Registration of our strategy names with Lightning's StrategyRegistry, and Fabric's.

Lightning resolves ``Trainer(strategy="name")`` (and Fabric ``Fabric(strategy="name")``) through a process-wide
registry. We add
our names when ``lightning_accel`` is imported; importing twice (or reloading the module,
as pytest and notebooks do) must not raise, so a name already bound to the same class is
left alone, and only a *different* class under one of our names is an error.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_accel.fabric import FABRIC_STRATEGIES
from lightning_accel.strategies.gpipe import GPipeStrategy
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy
from lightning_accel.strategies.l2l_offload_ddp import L2LOffloadDDPStrategy
from lightning_accel.strategies.xla_pjrt import XLAPJRTStrategy

# (name, class, description) for each strategy this package provides.
STRATEGIES: list[tuple[str, type, str]] = [
    ("l2l_offload", L2LOffloadStrategy, "L2L CPU offload: blocks stream layer to layer from host memory"),
    ("l2l_offload_ddp", L2LOffloadDDPStrategy, "L2L CPU offload on N processes, data parallel, the host optimizer partitioned across ranks (ZeRO-Offload)"),
    ("gpipe", GPipeStrategy, "GPipe micro-batching: blocks split into stages over devices, batches into micro-batches"),
    ("gpipe_distributed", DistributedGPipeStrategy, "GPipe across processes: one stage per rank on torch.distributed.pipelining, launched like DDP"),
    ("xla_pjrt", XLAPJRTStrategy, "one torch_xla device, or SPMD data parallel over all of a host's, on PJRT_DEVICE (TPU, CUDA or CPU); stable step graphs"),
]


def register(registry: Any, name: str, strategy_cls: type, description: str, **init_params: Any) -> None:
    """Bind ``name`` to ``strategy_cls`` in ``registry``, idempotently."""
    if name in registry:
        existing = registry[name]["strategy"]
        if existing is strategy_cls or getattr(existing, "__qualname__", None) == strategy_cls.__qualname__:
            return
        raise ValueError(
            f"strategy name {name!r} is already registered to {existing.__module__}.{existing.__qualname__}; "
            f"lightning_accel wants it for {strategy_cls.__module__}.{strategy_cls.__qualname__}; "
            "remove the other registration or import lightning_accel first"
        )
    registry.register(name, strategy_cls, description=description, **init_params)


def register_all(registry: Any = StrategyRegistry, fabric_registry: Any = FABRIC_REGISTRY) -> list[str]:
    """Register every strategy in :data:`STRATEGIES` with the Trainer's registry, and the same names in Fabric's
    (:data:`lightning_accel.fabric.FABRIC_STRATEGIES`); returns the Trainer's names."""
    for name, strategy_cls, description in STRATEGIES:
        register(registry, name, strategy_cls, description)
    for name, strategy_cls, description in FABRIC_STRATEGIES:
        register(fabric_registry, name, strategy_cls, description)
    return [name for name, _, _ in STRATEGIES]
