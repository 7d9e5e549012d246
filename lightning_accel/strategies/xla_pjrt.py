"""XLAPJRTStrategy: training on one torch_xla device, with stable step graphs.

Lightning's SingleDeviceXLAStrategy works only with its own ``XLAPrecision`` (fp32 or the
deprecated ``XLA_USE_BF16``) and ``XLACheckpointIO``; this one takes any checkpoint IO
(it moves the checkpoint to the host first), our :class:`XLAPJRTPrecision` (bf16 the XLA
way), and ends a graph at every step boundary: after each optimizer step (in the
precision plugin) and after each validation/test/predict step, so each kind of step is
one graph, compiled once. It counts the compilations, logs them as
``xla/compilations`` and says at the end of training whether they stopped after warm-up.
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

from lightning_accel.accelerators import register_accelerators
from lightning_accel.accelerators.compilations import CompileLog
from lightning_accel.plugins.precision.xla_pjrt import XLAPJRTPrecision


class XLAPJRTStrategy(SingleDeviceStrategy):
    """Train on one XLA device of the ``xla_pjrt`` accelerator.

    Args:
        device: index of the PJRT device (``xla:<index>``).
    """

    strategy_name = "xla_pjrt"

    def __init__(
        self,
        device: int = 0,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(device=torch.device("xla", int(device)), accelerator=accelerator, checkpoint_io=checkpoint_io)
        self.compilations = CompileLog()
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
            "HINT: set Trainer(precision='bf16-mixed' | 'bf16-true' | '32-true') instead of a plugin"
        )

    @override
    def setup_environment(self) -> None:
        from lightning_accel.accelerators.xla_pjrt import XLAPJRTAccelerator

        if not isinstance(self.accelerator, XLAPJRTAccelerator):
            name = type(self.accelerator).__name__ if self.accelerator is not None else "none"
            raise ValueError(
                f"strategy 'xla_pjrt' needs accelerator 'xla_pjrt', got {name}; "
                "HINT: Trainer(accelerator='xla_pjrt', strategy='xla_pjrt')"
            )
        import torch_xla

        self._root_device = torch_xla.device(self._root_device.index or 0)
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        devices = trainer._accelerator_connector._parallel_devices
        if len(devices) > 1:
            raise ValueError(
                f"strategy 'xla_pjrt' trains on one device, but devices={len(devices)} were asked for; "
                "HINT: set trainer.devices=1 (multi-device XLA needs one process per device: strategy='xla' on a TPU VM)"
            )
        # torch_xla's tensors do not support inference mode; Lightning switches its
        # evaluation loops to no_grad only for its own XLAAccelerator, so do it here.
        for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            loop.inference_mode = False
        super().setup(trainer)

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
