"""Thin Lightning Strategy classes wiring the mechanisms into a ``Trainer``."""

from lightning_accel.strategies.ddp_comm import CommDDPStrategy
from lightning_accel.strategies.gpipe import GPipeStrategy
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy
from lightning_accel.strategies.l2l_offload_ddp import L2LOffloadDDPStrategy
from lightning_accel.strategies.xla_pjrt import XLAPJRTStrategy

__all__ = ["CommDDPStrategy", "DistributedGPipeStrategy", "GPipeStrategy", "L2LOffloadDDPStrategy", "L2LOffloadStrategy", "XLAPJRTStrategy"]
