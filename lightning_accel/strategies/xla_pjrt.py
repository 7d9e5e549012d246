"""XLAPJRTStrategy: training on one torch_xla device, or data parallel over all of a host's, with stable step graphs.

Lightning's SingleDeviceXLAStrategy works only with its own ``XLAPrecision`` (fp32 or the
deprecated ``XLA_USE_BF16``) and ``XLACheckpointIO``; this one takes any checkpoint IO
(it moves the checkpoint to the host first), our :class:`XLAPJRTPrecision` (bf16 the XLA
way), and ends a graph at every step boundary: after each optimizer step (in the
precision plugin) and after each validation/test/predict step, so each kind of step is
one graph, compiled once. It counts the compilations, logs them as
``xla/compilations`` and says at the end of training whether they stopped after warm-up.

``devices=[i]`` trains on the PJRT device ``xla:i``. ``devices=N`` with N > 1 (all the
devices of the host) trains data parallel by SPMD in this one process: each batch is
split along its first dimension over the devices and the compiler all-reduces the
gradients (see :mod:`lightning_accel.accelerators.spmd` for why not one process per
device). The batch size is then the global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH, Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_accel.accelerators import register_accelerators, spmd
from lightning_accel.accelerators.compilations import CompileLog
from lightning_accel.patching import Patch, patch, remove_all
from lightning_accel.plugins.precision.xla_pjrt import XLAPJRTPrecision


class XLAPJRTStrategy(SingleDeviceStrategy):
    """Train on one XLA device of the ``xla_pjrt`` accelerator, or data parallel (SPMD) on all of them.

    Args:
        device: index of the PJRT device (``xla:<index>``); by default the Trainer's ``devices``
            decide (``devices=[1]``: ``xla:1``; ``devices=4``: SPMD over 4 devices).
    """

    strategy_name = "xla_pjrt"

    def __init__(
        self,
        device: int | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        index = 0 if device is None else int(device)
        super().__init__(device=torch.device("xla", index), accelerator=accelerator, checkpoint_io=checkpoint_io)
        # Lightning's accelerator connector fills in the Trainer's devices when this is empty,
        # and takes these over the Trainer's when it is not.
        self.parallel_devices: list[torch.device] | None = None if device is None else [torch.device("xla", index)]
        self.placement = spmd.Placement(index=index)
        self.mesh: Any = None  # the SPMD data mesh while training on several devices
        self.compilations = CompileLog()
        self._patches: list[Patch] = []  # Lightning's attributes set for one run, removed at teardown
        if precision_plugin is not None:
            self.precision_plugin = precision_plugin

    @property
    @override
    def precision_plugin(self) -> XLAPJRTPrecision:
        return self._precision_plugin if self._precision_plugin is not None else XLAPJRTPrecision()  # type: ignore[return-value]

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # The Trainer builds its precision plugin from `precision=` before it sees this
        # strategy (Precision, MixedPrecision, HalfPrecision); keep the flag, do it the XLA way.
        if plugin is None or isinstance(plugin, XLAPJRTPrecision):
            self._precision_plugin = plugin
            return
        if type(plugin).__module__.startswith("lightning.") and hasattr(plugin, "precision"):
            self._precision_plugin = XLAPJRTPrecision(str(plugin.precision))
            return
        raise TypeError(
            f"strategy 'xla_pjrt' cannot use the precision plugin {type(plugin).__name__}; "
            "set Trainer(precision='bf16-mixed' | 'bf16-true' | '32-true') instead of a plugin"
        )

    @override
    def setup_environment(self) -> None:
        from lightning_accel.accelerators.xla_pjrt import XLAPJRTAccelerator, _cpu_count_hint

        if not isinstance(self.accelerator, XLAPJRTAccelerator):
            name = type(self.accelerator).__name__ if self.accelerator is not None else "none"
            raise ValueError(
                f"strategy 'xla_pjrt' needs accelerator 'xla_pjrt', got {name}; "
                "use Trainer(accelerator='xla_pjrt', strategy='xla_pjrt')"
            )
        import torch_xla
        import torch_xla.runtime as xr

        available = self.accelerator.auto_device_count()
        indices = [d.index or 0 for d in self.parallel_devices or [self._root_device]]
        self.placement = spmd.plan_placement(indices, available, _cpu_count_hint(len(indices)))
        if xr.is_spmd() and not self.placement.spmd and available > 1:
            raise ValueError(
                f"devices={indices} asks for one device, but an earlier multi-device fit switched this process to SPMD "
                "over all devices, which torch_xla cannot undo; run the single-device fit in a new process"
            )
        if self.placement.spmd:
            self.mesh = spmd.enable(self.placement.count)
            rank_zero_info(
                f"xla_pjrt: data parallel over {self.placement.count} PJRT devices by SPMD in one process; "
                f"each batch is split along dim 0 ({self.placement.count} shards), gradients all-reduced by XLA"
            )
        self._root_device = torch_xla.device() if self.placement.spmd else torch_xla.device(self.placement.index)
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # torch_xla's tensors do not support inference mode; Lightning switches its
        # evaluation loops to no_grad only for its own XLAAccelerator, so do it here,
        # until teardown: the Trainer's own setting comes back after this strategy's run.
        self._unpatch()
        loops = (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop)
        self._patches = [patch(loop, "inference_mode", False) for loop in loops]
        super().setup(trainer)

    @override
    def teardown(self) -> None:
        self._unpatch()  # Lightning calls teardown also when a fit raises
        super().teardown()

    def _unpatch(self) -> None:
        remove_all(self._patches)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.compilations.begin()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizable,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)  # ends with torch_xla.sync()
        count = self.compilations.record()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.loggers and len(self.compilations.counts) % max(trainer.log_every_n_steps, 1) == 0:
            for logger in trainer.loggers:
                logger.log_metrics({"xla/compilations": float(count)}, step=trainer.global_step)
        return result

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        rank_zero_info(self.compilations.summary())

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return spmd.shard_batch(batch, self.mesh) if self.mesh is not None else batch

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return _step_then_sync(super().validation_step(*args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return _step_then_sync(super().test_step(*args, **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return _step_then_sync(super().predict_step(*args, **kwargs))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # Any CheckpointIO (ours writes atomically) can save host tensors; XLA tensors go to the host first.
        host = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.cpu() if t.device.type == "xla" else t)
        super().save_checkpoint(host, filepath, storage_options=storage_options)


def _step_then_sync(output: Any) -> Any:
    import torch_xla

    torch_xla.sync()  # one eval graph per step; without it the graph grows over the whole loop
    return output


# A recipe names this class by _target_; importing it makes accelerator="xla_pjrt" resolvable.
register_accelerators()
