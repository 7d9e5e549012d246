"""lightning_accel: Lightning plugins and Hydra recipes for models too large, too deep or too data-hungry for one accelerator.

Importing the package registers our strategy names with Lightning's StrategyRegistry and
the ``xla_pjrt`` accelerator with its AcceleratorRegistry (idempotently), so ``Trainer(strategy="l2l_offload")``, ``"l2l_offload_ddp"``, ``"gpipe"`` or ``"gpipe_distributed"`` works after ``import lightning_accel``, as do the DDP communication variants ``"ddp_fp16"``, ``"ddp_bf16"`` and ``"ddp_powersgd"``. The same names go to
Lightning Fabric's ``STRATEGY_REGISTRY`` (:mod:`lightning_accel.fabric`): ``Fabric(strategy="l2l_offload")`` and
``"gpipe"`` for a hand-written loop; ``"gpipe_distributed"`` and ``"l2l_offload_ddp"`` refuse there in one line.
"""

from lightning_accel._registry import register_all as _register_all
from lightning_accel.accelerators import XLAPJRTAccelerator
from lightning_accel.accelerators import register_accelerators as _register_accelerators
from lightning_accel.callbacks import DataWaitMonitor, DevicePrefetcher, OffloadMonitor, PrefetchTuner
from lightning_accel.plugins.precision import OffloadPrecision
from lightning_accel.strategies.ddp_comm import register_comm_variants as _register_comm_variants
from lightning_accel.strategies.gpipe import GPipeStrategy
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy
from lightning_accel.strategies.l2l_offload_ddp import L2LOffloadDDPStrategy
from lightning_accel.strategies.xla_pjrt import XLAPJRTStrategy

__version__ = "0.1.0"

__all__ = [
    "DataWaitMonitor",
    "DevicePrefetcher",
    "DistributedGPipeStrategy",
    "GPipeStrategy",
    "L2LOffloadDDPStrategy",
    "L2LOffloadStrategy",
    "OffloadMonitor",
    "OffloadPrecision",
    "PrefetchTuner",
    "XLAPJRTAccelerator",
    "XLAPJRTStrategy",
    "__version__",
]

_register_all()
_register_comm_variants()
_register_accelerators()
