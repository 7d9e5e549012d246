"""Keeping the accelerator fed: wait measurement, loader-settings search, loader rebuild, device copy.

Pure mechanism (no Lightning import); the callbacks in ``lightning_accel.callbacks``
wire it into a ``Trainer``.
"""

from lightning_accel.prefetch.device_copy import CudaPrefetchIterable
from lightning_accel.prefetch.loader_rebuild import RebuildError, check_rebuildable, rebuild_loader, settings_of
from lightning_accel.prefetch.online import OnlineSearch
from lightning_accel.prefetch.options import TunerOptions
from lightning_accel.prefetch.probe import Probe, batch_nbytes, measure_loader
from lightning_accel.prefetch.search import Budget, PrefetchSearch, Trial, default_budget
from lightning_accel.prefetch.settings import LoaderSettings
from lightning_accel.prefetch.stream import PositionStream
from lightning_accel.prefetch.tunable_loader import TunableLoader
from lightning_accel.prefetch.wait_meter import WaitMeter, WaitStats

__all__ = [
    "Budget",
    "CudaPrefetchIterable",
    "LoaderSettings",
    "OnlineSearch",
    "PositionStream",
    "PrefetchSearch",
    "Probe",
    "RebuildError",
    "Trial",
    "TunerOptions",
    "TunableLoader",
    "WaitMeter",
    "WaitStats",
    "batch_nbytes",
    "check_rebuildable",
    "default_budget",
    "measure_loader",
    "rebuild_loader",
    "settings_of",
]
