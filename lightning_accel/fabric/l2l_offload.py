"""L2L CPU offload for a loop the user writes: ``Fabric(strategy="l2l_offload")``.

The Trainer's :class:`~lightning_accel.strategies.L2LOffloadStrategy` is this strategy's engine: built from the
same arguments (so the same options, checks and errors), it places the model (``model_to_device``: the units
planned, a model built on meta materialized unit by unit, the blocks' parameters to the host store), chooses each
optimizer's host kernel and the NVMe tier, says the plan in one line, and runs the host update
(``_host_step``). What a Trainer learns from its hooks, a Fabric loop tells through Fabric's strategy methods, and
this class maps one onto the other:

- ``module_to_device`` / ``setup_module``: the engine's placement; the module's ``forward`` starts each step
  (the executor follows what the loop changed in the parameters since the last one) and, without grad, releases
  the blocks after it (evaluation, and inference after the loop);
- ``setup_optimizer(s)``: the host kernels, the tier, the plan line;
- ``backward``: brackets the pass (the executor prefetches backwards and lands the block gradients on the host,
  where accumulation sums them: ``fabric.no_backward_sync`` is a no-op on one device, as under Fabric's own);
- ``clip_gradients`` / ``optimizer_step``: the host gradients shown as ``param.grad``, then the engine's host step;
- ``load_checkpoint``: the device copies (and the tier's files) follow the loaded weights and state.

Refused in one line, when the ``Fabric`` is built: ``delayed_update`` (its landing points are the Trainer's hooks:
validation, checkpoints, the end of fit); more than one device, node or process (``l2l_offload_ddp``); a precision
that would change the host masters' dtype. ``overlap_step`` is off unless set: a Fabric loop may clip or
accumulate after ``fabric.backward``, which need every gradient before any block steps; with ``overlap_step=True``
a ``fabric.clip_gradients`` or a second ``fabric.backward`` before ``optimizer.step()`` is refused at its call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.plugins.io import TorchCheckpointIO
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.strategies import SingleDeviceStrategy
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.models.block_policy import BlockPolicy
from lightning_accel.offload import OffloadStats
from lightning_accel.offload.host_optimizer import PER_PARAMETER
from lightning_accel.offload.host_step import step_params
from lightning_accel.patching import Patch, patch
from lightning_accel.plugins.io.atomic import AtomicCheckpointIO
from lightning_accel.plugins.precision.offload import OffloadPrecision, refused_precision
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy as TrainerL2LOffloadStrategy, beyond_one_device

__all__ = ["L2LOffloadStrategy"]

# Why the blocks do not step during ``fabric.backward`` unless ``overlap_step=True`` says they may, and the fix.
OVERLAP_UNKNOWN = ("a Fabric loop may clip (fabric.clip_gradients) or accumulate (a second fabric.backward) after "
                   "fabric.backward, which need every gradient before any block steps",
                   "pass overlap_step=True if the loop does neither")


class _Engine(TrainerL2LOffloadStrategy):
    """The Trainer strategy driven by the Fabric one: what only a Trainer knows (its clipping and accumulation
    settings, the LightningModule's gradient hooks) answered for a Fabric loop."""

    @override
    def _overlap_blocker(self, optimizer: Optimizer) -> tuple[str, str | None] | None:
        blocker = super()._overlap_blocker(optimizer)  # (no Trainer: fp16 loss scaling, the optimizer's kind)
        return blocker if blocker is not None or self.overlap_step else OVERLAP_UNKNOWN

    @override
    def _overlap_wanted(self) -> bool:
        return bool(self.overlap_step)

    @override
    def _reads_gradients(self, *hooks: str) -> bool:
        return False


# The engine's errors and plan lines name the strategy as the user wrote it, at either front door.
_Engine.__name__ = _Engine.__qualname__ = "L2LOffloadStrategy"


def _for_engine(plugin: FabricPrecision) -> tuple[FabricPrecision, Precision]:
    """Fabric's precision plugin as this strategy runs it, and its Trainer twin for the engine (which pairs it with
    :class:`OffloadPrecision` and says so, or refuses it in one line, as under the Trainer)."""
    if isinstance(plugin, OffloadPrecision):  # plugins=[OffloadPrecision(...)], the hint of the refusal below
        flag = plugin.precision
        plugin = FabricPrecision() if flag == "32-true" else FabricMixedPrecision(flag, plugin.device, plugin.scaler)  # type: ignore[arg-type]
    if type(plugin) is FabricPrecision:
        return plugin, Precision()
    if type(plugin) is FabricMixedPrecision:
        return plugin, MixedPrecision(plugin.precision, plugin.device, plugin.scaler)  # type: ignore[arg-type]
    raise refused_precision(getattr(plugin, "precision", None), type(plugin).__name__, "l2l_offload")


class L2LOffloadStrategy(SingleDeviceStrategy):
    """``Fabric(strategy="l2l_offload")``: train on one device with the model's blocks offloaded to host memory.

    The arguments are the Trainer strategy's (:class:`lightning_accel.strategies.L2LOffloadStrategy`), with the
    same meaning and checks; ``delayed_update`` is refused (see the module docstring) and ``overlap_step`` is off
    unless set.
    """

    strategy_name = "l2l_offload"

    def __init__(
        self,
        blocks: BlockPolicy = "auto",
        prefetch_blocks: int = 1,
        offload_resident: bool | None = None,
        checkpoint_blocks: bool = True,
        overlap_step: bool | None = None,
        delayed_update: bool = False,
        delayed_update_warmup: int | None = None,
        offload_activations: bool = False,
        nvme_path: str | None = None,
        host_budget: int | str | None = None,
        nvme_chunk: int | str | None = None,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        self.offload = _Engine(blocks, prefetch_blocks, offload_resident, checkpoint_blocks, overlap_step, delayed_update,
                               delayed_update_warmup, offload_activations, nvme_path, host_budget, nvme_chunk, device)
        if delayed_update:
            raise ValueError(
                "Fabric(strategy='l2l_offload'): delayed_update=True lands a pending update at the Trainer's hooks "
                "(validation, checkpoints, the end of fit), which a Fabric loop does not call; use "
                "Trainer(strategy=L2LOffloadStrategy(delayed_update=True)), or drop delayed_update"
            )
        super().__init__(device=device if device is not None else "cpu", **kwargs)
        self._device_given = device is not None
        self._devices: list[torch.device] = []  # what Fabric(devices=...) asked for (see parallel_devices)
        self._num_nodes = 1
        self._forward: Patch | None = None  # the module's forward, which starts each step (see _stepped_forward)
        self._stepped_in_backward = False  # overlap_step=True: the blocks stepped during the last fabric.backward

    @property
    def offload_stats(self) -> OffloadStats:
        """Bytes moved, copy time, overlap, peak device bytes and resident blocks (the engine's)."""
        return self.offload.offload_stats

    # Fabric hands the strategy its precision here when it is built: paired or refused before any work.
    @property  # type: ignore[override]
    @override
    def precision(self) -> FabricPrecision:
        return self._precision if self._precision is not None else FabricPrecision()

    @precision.setter
    def precision(self, plugin: FabricPrecision | None) -> None:
        if plugin is None:
            self._precision = None
            return
        self._precision, self.offload.precision_plugin = _for_engine(plugin)

    @property
    @override
    def root_device(self) -> torch.device:
        if not self._device_given and self._devices:  # Fabric(accelerator="cuda"): the device it chose
            return self._devices[0]
        return self._root_device

    # Fabric's connector hands a strategy with these attributes the devices and nodes it was asked for; taking them
    # lets _configure_launcher refuse more than one, which a single-device strategy would silently drop.
    @property
    def parallel_devices(self) -> list[torch.device]:
        return self._devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[Any] | None) -> None:
        self._devices = [torch.device(d) for d in devices or []]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @override
    def _configure_launcher(self) -> None:
        asked = beyond_one_device(len(self._devices), self._num_nodes)
        if asked:
            raise ValueError(
                f"Fabric(strategy='l2l_offload') trains on one device in one process, but {' and '.join(asked)} asks for "
                "more; use devices=1, or Trainer(strategy='l2l_offload_ddp') for data parallel offload"
            )
        # the engine computes where Fabric does
        self.offload._root_device, self.offload._device_given = self.root_device, True

    @override
    def module_init_context(self, empty_init: bool | None = None) -> Any:
        # fabric.init_module(empty_init=True) builds on meta: placement materializes it unit by unit
        # (lightning_accel.strategies.l2l_materialize), so a model bigger than host memory is never built whole
        if not empty_init:
            return super().module_init_context(empty_init)
        return _on_meta(self.precision)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        self.offload.model = module
        self.offload.model_to_device()

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if self.offload.model is not module or self.offload._executor is None:  # setup(..., move_to_device=False)
            self.module_to_device(module)
        if self._forward is None:  # an instance attribute, put back at teardown
            self._forward = patch(module, "forward", self._stepped_forward(module.forward))
        return module

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None) -> Any:
        module = self.setup_module(module)
        self.offload.optimizers = list(optimizers)
        self.offload._setup_offload()
        return module, optimizers, scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        # fabric.setup_optimizers after fabric.setup(model), as litgpt writes it
        if self.offload._executor is None:
            raise ValueError("Fabric(strategy='l2l_offload'): set up the model first; call fabric.setup(model) "
                             "before fabric.setup_optimizers(optimizer)")
        self.offload.optimizers = [*self.offload.optimizers, optimizer]
        self.offload._setup_offload()
        return optimizer

    def _stepped_forward(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """The module's forward, as a step: the executor first follows what the loop changed in the parameters; a
        forward without grad (evaluation, inference) releases the blocks after it."""

        def run(*args: Any, **kwargs: Any) -> Any:
            executor = self.offload._executor
            if executor is None:  # torn down: the module computes normally
                return forward(*args, **kwargs)
            self.offload._begin_step()
            if torch.is_grad_enabled():
                return forward(*args, **kwargs)  # released by the backward
            try:
                return forward(*args, **kwargs)
            finally:
                executor.end_eval()

        return run

    def _executor(self) -> Any:
        executor = self.offload._executor
        if executor is None:
            raise RuntimeError("Fabric(strategy='l2l_offload'): the model is not set up; call fabric.setup(model) first")
        return executor

    def _overlapped(self) -> Optimizer | None:
        """The optimizer whose step the blocks take during this backward (``overlap_step=True``), or None."""
        optimizers = self.offload.optimizers
        if not self.offload._overlap_wanted() or len(optimizers) != 1:
            return None
        scaling = getattr(self.precision, "scaler", None) is not None
        return optimizers[0] if isinstance(optimizers[0], PER_PARAMETER) and not scaling else None

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        executor = self._executor()
        if self._stepped_in_backward:
            raise ValueError(
                "Fabric(strategy='l2l_offload', overlap_step=True) stepped every block during the last fabric.backward; "
                "a second fabric.backward before optimizer.step() (gradient accumulation) would step them again; "
                "pass overlap_step=False to accumulate"
            )
        optimizer = self._overlapped()
        fuse = optimizer is not None and self.offload._fuse(optimizer)
        executor.step_blocks_during_backward(functools.partial(step_params, optimizer, fuse=fuse) if optimizer is not None else None)
        self._stepped_in_backward = optimizer is not None
        fused = any(self.offload._fuse(o) for o in self.offload.optimizers)
        executor.keep_low_grads(self.offload._reads_low_grads(fused))
        executor.begin_backward()
        try:
            super().backward(tensor, module, *args, **kwargs)
        finally:
            executor.end_backward()

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float | int, norm_type: float | int = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        self._gradients_for(optimizer, "fabric.clip_gradients")
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self._gradients_for(optimizer, "fabric.clip_gradients")
        return super().clip_gradients_value(module, optimizer, clip_val)

    def _gradients_for(self, optimizer: Optimizer, what: str) -> None:
        """The host gradients shown as ``param.grad`` (host tensors), for clipping or the step."""
        if self._stepped_in_backward:
            raise ValueError(
                f"Fabric(strategy='l2l_offload', overlap_step=True) stepped every block during fabric.backward, before "
                f"{what} could see every gradient; pass overlap_step=False to clip"
            )
        self._executor().install_grads()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        executor = self._executor()
        self._stepped_in_backward = False
        executor.install_grads()
        optimizer = getattr(optimizer, "optimizer", optimizer)  # (a _FabricOptimizer)
        return self.offload._host_step(optimizer, self.offload._fuse(optimizer),
                                       lambda: self.precision.optimizer_step(optimizer, **kwargs))

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        # with the tier a checkpoint is as large as the state kept out of memory: written through our cache-bounded
        # atomic writer, not the page cache (as under the Trainer); a CheckpointIO the user chose is kept
        if self.offload.nvme_path is not None and type(self.checkpoint_io) is TorchCheckpointIO and storage_options is None:
            AtomicCheckpointIO().save_checkpoint(self._convert_stateful_objects_in_state(state, filter=filter or {}), path)
            return
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        super().load_module_state_dict(module, state_dict, strict=strict)
        executor = self.offload._executor
        if executor is not None:
            executor.store.refresh_shadows()  # the device copies follow the loaded masters
            if executor.tier is not None:
                executor.tier.sync()  # the weights were written through the tier's maps

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        # Optimizer.load_state_dict puts each state tensor on its parameter's device: the host for the blocks
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        executor = self.offload._executor
        if executor is not None and executor.tier is not None and state:
            executor.tier.adopt_state()  # the loaded optimizer state goes to the tier's files
        return remainder

    @override
    def teardown(self) -> None:
        if self._forward is not None:
            self._forward.remove()
            self._forward = None
        self.offload.accelerator = self.accelerator
        self.offload.teardown()  # the executor detached (the module computes normally again), the tier's files gone
        super().teardown()


@contextmanager
def _on_meta(precision: FabricPrecision) -> Generator[None, None, None]:
    with torch.device("meta"), precision.module_init_context():
        yield
