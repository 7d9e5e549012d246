"""Lightning callbacks: thin adapters over the mechanism packages (prefetch, offload)."""

from lightning_accel.callbacks.data_wait_monitor import DataWaitMonitor
from lightning_accel.callbacks.device_prefetcher import DevicePrefetcher
from lightning_accel.callbacks.offload_monitor import OffloadMonitor
from lightning_accel.callbacks.prefetch_tuner import PrefetchTuner

__all__ = ["DataWaitMonitor", "DevicePrefetcher", "OffloadMonitor", "PrefetchTuner"]
