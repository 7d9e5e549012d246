"""Our strategies for Lightning Fabric, for people who write their own training loop: ``Fabric(strategy="l2l_offload")``,
``Fabric(strategy="l2l_offload_ddp", devices=N)``, ``Fabric(strategy="gpipe")``.

The second front door beside the Trainer's (:mod:`lightning_accel.strategies`): the same names, options and
errors, each a thin adapter over the same mechanism, driving the Trainer strategy as its engine from Fabric's
strategy methods. Importing :mod:`lightning_accel` registers the names with Fabric's ``STRATEGY_REGISTRY``.
"""

from lightning_accel.fabric.gpipe import GPipeStrategy
from lightning_accel.fabric.l2l_offload import L2LOffloadStrategy
from lightning_accel.fabric.l2l_offload_ddp import L2LOffloadDDPStrategy
from lightning_accel.fabric.refused import TRAINER_ONLY

__all__ = ["FABRIC_STRATEGIES", "GPipeStrategy", "L2LOffloadDDPStrategy", "L2LOffloadStrategy"]

# (name, class, description) for each name Fabric resolves; the Trainer-only one refuses in one line when built.
FABRIC_STRATEGIES: list[tuple[str, type, str]] = [
    ("l2l_offload", L2LOffloadStrategy, "L2L CPU offload in a Fabric loop: blocks stream layer to layer from host memory"),
    ("l2l_offload_ddp", L2LOffloadDDPStrategy, "L2L CPU offload in a Fabric loop on N processes, data parallel, the host "
                                                "optimizer partitioned across ranks (ZeRO-Offload)"),
    ("gpipe", GPipeStrategy, "GPipe micro-batching in a Fabric loop: the model's call split into micro-batches and joined"),
    *TRAINER_ONLY,
]
