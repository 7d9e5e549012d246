"""DevicePrefetcher: copying the next batch to the GPU while this one computes.

Lightning moves each batch to the device just before its step, on the compute stream,
so the copy and the step take turns. On CUDA this callback wraps the train loader in a
:class:`~lightning_accel.prefetch.CudaPrefetchIterable`, which copies batch ``i + 1``
from pinned memory on a side stream while batch ``i`` computes; Lightning's own move
then finds the batch already there. On XLA it wraps the loader in torch_xla's
``MpDeviceLoader``, whose background threads copy the next batches to the XLA device
(unless the loader is one already, as under Lightning's multi-process XLAStrategy). On
CPU there is no copy to overlap; the callback leaves the loader alone and says so once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel.callbacks._train_loader import swap_train_loader
from lightning_accel.prefetch.device_copy import CudaPrefetchIterable


class DevicePrefetcher(Callback):
    """One-batch-ahead host-to-device copy of the train batches on a side CUDA stream (on XLA: MpDeviceLoader).

    Put it after :class:`PrefetchTuner` in ``callbacks`` so it wraps the tuned loader.
    """

    def __init__(self) -> None:
        self.active = False
        self.message = ""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        if device.type == "xla":
            self._use_xla_loader(trainer, device)
            return
        if device.type != "cuda":
            self.message = f"DevicePrefetcher: no CUDA device (training on {device.type}); batches are not copied ahead"
            rank_zero_info(self.message)
            return
        self._install(
            trainer,
            lambda loader: CudaPrefetchIterable(loader, device),
            f"DevicePrefetcher: copying batch i+1 to {device} on a side stream while batch i computes",
        )

    def _use_xla_loader(self, trainer: pl.Trainer, device: torch.device) -> None:
        from torch_xla.distributed.parallel_loader import MpDeviceLoader

        loaders = trainer.fit_loop._combined_loader.flattened if trainer.fit_loop._combined_loader else []
        if any(isinstance(loader, MpDeviceLoader) for loader in loaders):
            self.active = True
            self.message = "DevicePrefetcher: the train loader is already torch_xla's MpDeviceLoader; nothing to do"
            rank_zero_info(self.message)
            return
        self._install(
            trainer,
            lambda loader: MpDeviceLoader(loader, device),
            f"DevicePrefetcher: torch_xla's MpDeviceLoader copies the next batches to {device} in the background",
        )

    def _install(self, trainer: pl.Trainer, wrap: Callable[[Any], Any], done: str) -> None:
        """Wrap the train loader with ``wrap``, or keep it and say why not."""
        why_not = swap_train_loader(trainer, wrap)
        if why_not is not None:
            self.message = f"DevicePrefetcher: {why_not}; batches are copied by Lightning as usual"
            rank_zero_warn(self.message)
            return
        self.active = True
        self.message = done
        rank_zero_info(self.message)
