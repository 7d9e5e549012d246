"""DevicePrefetcher: copying the next batch to the GPU while this one computes.

Lightning moves each batch to the device just before its step, on the compute stream,
so the copy and the step take turns. On CUDA this callback wraps the train loader in a
:class:`~lightning_accel.prefetch.CudaPrefetchIterable`, which copies batch ``i + 1``
from pinned memory on a side stream while batch ``i`` computes; Lightning's own move
then finds the batch already there. On XLA it wraps the loader in torch_xla's
``MpDeviceLoader``, whose background threads copy the next batches to the XLA device
(unless the loader is one already, as under Lightning's multi-process XLAStrategy). On
CPU there is no copy to overlap; the callback leaves the loader alone and says so once.

The loader is wrapped as Lightning processes it, before the fit loop reads from it
(:mod:`~lightning_accel.callbacks._process_hook`, the mechanism PrefetchTuner uses too),
so a stream's first batch, which Lightning's fetcher reads ahead, comes through the copy
as well. What was done, or why not, is said at ``on_train_start``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel.callbacks._process_hook import TrainLoaderHook, resumed_mid_epoch
from lightning_accel.prefetch.device_copy import CudaPrefetchIterable
from lightning_accel.prefetch.loader_state import is_stateful_loader


class DevicePrefetcher(Callback):
    """One-batch-ahead host-to-device copy of the train batches on a side CUDA stream (on XLA: MpDeviceLoader).

    Put it after :class:`PrefetchTuner` in ``callbacks`` so it wraps the tuned loader.
    """

    def __init__(self) -> None:
        self.active = False
        self.message = ""
        self._hook: TrainLoaderHook | None = None  # installed for each fit (setup to teardown)
        self._say: Callable[[str], None] = rank_zero_info  # how on_train_start says self.message
        self._wrapper: Any = None  # the copy this fit's train loader was wrapped in

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.active, self._say, self._wrapper = False, rank_zero_warn, None
            self.message = "DevicePrefetcher: no train loader was set up; batches are copied by Lightning as usual"
            self._hook = TrainLoaderHook(trainer, lambda loader: self._wrap(trainer, loader))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hook()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_hook()  # Lightning calls no teardown when fit raises

    def _remove_hook(self) -> None:
        """Put the strategy's ``process_dataloader`` back (idempotent)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _wrap(self, trainer: pl.Trainer, loader: Any) -> Any:
        """The fit's train loader as Lightning processes it: wrapped in the device copy, or kept."""
        device = trainer.lightning_module.device
        if device.type not in ("cuda", "xla"):
            return self._keep(loader, f"no CUDA device (training on {device.type}); batches are not copied ahead", warn=False)
        if resumed_mid_epoch(trainer) and not is_stateful_loader(loader):
            return self._keep(loader, "fit resumed part-way through an epoch; batches are copied by Lightning as usual")
        if device.type == "cuda":  # the copy forwards state_dict/load_state_dict: a StatefulDataLoader resumes inside it
            return self._use(
                CudaPrefetchIterable(loader, device), f"copying batch i+1 to {device} on a side stream while batch i computes"
            )
        from torch_xla.distributed.parallel_loader import MpDeviceLoader

        if isinstance(loader, MpDeviceLoader):
            self._use(None, "the train loader is already torch_xla's MpDeviceLoader; nothing to do")
            return loader
        if resumed_mid_epoch(trainer):  # a StatefulDataLoader: MpDeviceLoader would not pass the checkpoint's state on
            return self._keep(
                loader, "fit resumed part-way through an epoch and MpDeviceLoader cannot carry the loader's position; "
                "batches are copied by Lightning as usual",
            )
        return self._use(
            MpDeviceLoader(loader, device), f"torch_xla's MpDeviceLoader copies the next batches to {device} in the background"
        )

    def _use(self, wrapper: Any, done: str) -> Any:
        self.active, self.message, self._say = True, f"DevicePrefetcher: {done}", rank_zero_info
        self._wrapper = wrapper
        return wrapper

    def _keep(self, loader: Any, why_not: str, warn: bool = True) -> Any:
        self.message, self._say = f"DevicePrefetcher: {why_not}", rank_zero_warn if warn else rank_zero_info
        return loader

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        combined = trainer.fit_loop._combined_loader
        count = len(combined.flattened) if combined is not None else 0
        if count > 1 and self._wrapper is not None:  # the first was wrapped as it was processed, before the others were known
            self.message, self._say = (
                f"DevicePrefetcher: {count} train loaders; the first one's batches are copied ahead, "
                "the others' by Lightning as usual"
            ), rank_zero_warn
        self._say(self.message)
