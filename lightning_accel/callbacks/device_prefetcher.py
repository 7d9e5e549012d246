"""DevicePrefetcher: copying the next batch to the GPU while this one computes.

Lightning moves each batch to the device just before its step, on the compute stream,
so the copy and the step take turns. On CUDA this callback wraps the train loader in a
:class:`~lightning_accel.prefetch.CudaPrefetchIterable`, which copies batch ``i + 1``
from pinned memory on a side stream while batch ``i`` computes; Lightning's own move
then finds the batch already there. On XLA, Lightning's XLA strategy already wraps the
loader in torch_xla's ``MpDeviceLoader``, which does this; on CPU there is no copy to
overlap. In both cases the callback leaves the loader alone and says so once.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel.callbacks._train_loader import swap_train_loader
from lightning_accel.prefetch.device_copy import CudaPrefetchIterable


class DevicePrefetcher(Callback):
    """One-batch-ahead host-to-device copy of the train batches on a side CUDA stream.

    Put it after :class:`PrefetchTuner` in ``callbacks`` so it wraps the tuned loader.
    """

    def __init__(self) -> None:
        self.active = False
        self.message = ""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        if device.type != "cuda":
            if device.type == "xla":
                self.message = "DevicePrefetcher: on XLA, Lightning's MpDeviceLoader already copies ahead; nothing to do"
            else:
                self.message = f"DevicePrefetcher: no CUDA device (training on {device.type}); batches are not copied ahead"
            rank_zero_info(self.message)
            return
        why_not = swap_train_loader(trainer, lambda loader: CudaPrefetchIterable(loader, device))
        if why_not is not None:
            self.message = f"DevicePrefetcher: {why_not}; batches are copied by Lightning as usual"
            rank_zero_warn(self.message)
            return
        self.active = True
        self.message = f"DevicePrefetcher: copying batch i+1 to {device} on a side stream while batch i computes"
        rank_zero_info(self.message)
