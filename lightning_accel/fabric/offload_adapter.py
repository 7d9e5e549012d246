"""What both Fabric L2L strategies (one device, and data parallel) do with the Trainer strategy that is their engine.

``Fabric(strategy="l2l_offload")`` and ``Fabric(strategy="l2l_offload_ddp")`` each hold the Trainer strategy of the
same name (``self.offload``), built from the same arguments, and map Fabric's strategy methods onto what the Trainer
learns from its hooks. :class:`FabricOffload` is that map, written once:

- ``module_to_device`` / ``setup_module``: the engine's placement; the module's ``forward`` starts each step (the
  executor follows what the loop changed in the parameters since the last one) and, without grad, releases the
  blocks after it (evaluation, and inference after the loop);
- ``setup_module_and_optimizers`` / ``setup_optimizer``: the host kernels, the tier, the plan line;
- ``backward``: brackets the pass (the executor prefetches backwards and lands the block gradients on the host,
  where accumulation sums them);
- ``clip_gradients`` / ``optimizer_step``: the host gradients shown as ``param.grad``, then the engine's host step;
- ``save_checkpoint`` / ``load_checkpoint``: through the cache-bounded writer with the tier; the device copies (and
  the tier's files) follow the loaded weights and state.

The strategy class says what differs between one device and several ranks through the ``_begin_backward``,
``_end_backward``, ``_land_gradients``, ``_placed`` and ``_optimizers_added`` hooks. Also here: the precision
pairing (:func:`for_engine`), the refusal of ``delayed_update`` (:func:`refuse_delayed_update`) and the meta-device
context of ``fabric.init_module(empty_init=True)``.
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
from lightning.fabric.strategies import Strategy
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.offload import OffloadStats
from lightning_accel.offload.host_optimizer import PER_PARAMETER
from lightning_accel.offload.host_step import step_params
from lightning_accel.patching import Patch, patch
from lightning_accel.plugins.io.atomic import AtomicCheckpointIO
from lightning_accel.plugins.precision.offload import OffloadPrecision, refused_precision
from lightning_accel.strategies.l2l_offload_hooks import L2LOffloadHooks

__all__ = ["FabricOffload", "for_engine", "refuse_delayed_update"]


def for_engine(plugin: FabricPrecision, name: str) -> tuple[FabricPrecision, Precision]:
    """Fabric's precision plugin as strategy ``name`` runs it, and its Trainer twin for the engine (which pairs it with
    :class:`OffloadPrecision` and says so, or refuses it in one line, as under the Trainer)."""
    if isinstance(plugin, OffloadPrecision):  # plugins=[OffloadPrecision(...)], the hint of the refusal below
        flag = plugin.precision
        plugin = FabricPrecision() if flag == "32-true" else FabricMixedPrecision(flag, plugin.device, plugin.scaler)  # type: ignore[arg-type]
    if type(plugin) is FabricPrecision:
        return plugin, Precision()
    if type(plugin) is FabricMixedPrecision:
        return plugin, MixedPrecision(plugin.precision, plugin.device, plugin.scaler)  # type: ignore[arg-type]
    raise refused_precision(getattr(plugin, "precision", None), type(plugin).__name__, name)


def refuse_delayed_update(name: str, trainer_class: str) -> ValueError:
    """Why ``delayed_update=True`` does not carry over to a Fabric loop, and the fix."""
    return ValueError(
        f"Fabric(strategy={name!r}): delayed_update=True lands a pending update at the Trainer's hooks "
        f"(validation, checkpoints, the end of fit), which a Fabric loop does not call; use "
        f"Trainer(strategy={trainer_class}(delayed_update=True)), or drop delayed_update"
    )


class FabricOffload(Strategy):
    """Fabric's strategy methods over an L2L engine (see the module docstring); combined with Fabric's
    ``SingleDeviceStrategy`` or ``DDPStrategy``, never used alone. The subclass builds ``self.offload`` before
    calling Fabric's ``__init__`` (which hands over the precision)."""

    offload: L2LOffloadHooks
    _forward: Patch | None = None  # the module's forward, which starts each step (see _stepped_forward)
    _stepped_in_backward = False  # overlap_step=True: the blocks stepped during the last fabric.backward

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
        self._precision, self.offload.precision_plugin = for_engine(plugin, self.offload.strategy_name)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> Any:
        # fabric.init_module(empty_init=True) builds on meta: placement materializes it unit by unit
        # (lightning_accel.strategies.l2l_materialize), so a model bigger than host memory is never built whole
        if not empty_init:
            return super().module_init_context(empty_init)
        return _on_meta(self.precision)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        first = self.offload.model
        if self.offload._executor is not None and first is not None and first is not module:
            raise ValueError(
                f"Fabric(strategy={self.offload.strategy_name!r}) streams one model, and {type(first).__name__} is set up; "
                f"fabric.setup was given a second one ({type(module).__name__}), which would take the first one's place; "
                "set the other model up with a Fabric of its own (strategy='auto'), or wrap both in one nn.Module"
            )
        self.offload.model = module
        self.offload.model_to_device()
        self._placed(module)

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
        self._optimizers_added()
        self.offload._setup_offload()
        return module, optimizers, scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        # fabric.setup_optimizers after fabric.setup(model), as litgpt writes it
        if self.offload._executor is None:
            raise ValueError(f"Fabric(strategy={self.offload.strategy_name!r}): set up the model first; call "
                             "fabric.setup(model) before fabric.setup_optimizers(optimizer)")
        self.offload.optimizers = [*self.offload.optimizers, optimizer]
        self._optimizers_added()
        self.offload._setup_offload()
        return optimizer

    def _placed(self, module: nn.Module) -> None:
        """After the engine placed ``module``."""

    def _optimizers_added(self) -> None:
        """After ``self.offload.optimizers`` changed, before the engine sets up their host step."""

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
            raise RuntimeError(f"Fabric(strategy={self.offload.strategy_name!r}): the model is not set up; call "
                               "fabric.setup(model) first")
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
        name = self.offload.strategy_name
        if self._stepped_in_backward:
            raise ValueError(
                f"Fabric(strategy={name!r}, overlap_step=True) stepped every block during the last fabric.backward; "
                "a second fabric.backward before optimizer.step() (gradient accumulation) would step them again; "
                "pass overlap_step=False to accumulate"
            )
        optimizer = self._overlapped()
        fuse = optimizer is not None and self.offload._fuse(optimizer)
        executor.step_blocks_during_backward(functools.partial(step_params, optimizer, fuse=fuse) if optimizer is not None else None)
        self._stepped_in_backward = optimizer is not None
        fused = any(self.offload._fuse(o) for o in self.offload.optimizers)
        executor.keep_low_grads(self.offload._reads_low_grads(fused))
        self._begin_backward(tensor)
        try:
            super().backward(tensor, module, *args, **kwargs)
        finally:
            self._end_backward(tensor)

    def _begin_backward(self, tensor: torch.Tensor) -> None:
        """Before the pass: the executor prefetches backwards."""
        self._executor().begin_backward()

    def _end_backward(self, tensor: torch.Tensor) -> None:
        """After the pass: what is on the device released, the gradients landed on the host."""
        self._executor().end_backward()

    def _land_gradients(self) -> None:
        """Before clipping and the step: the host gradients shown as ``param.grad``."""
        self._executor().install_grads()

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
                f"Fabric(strategy={self.offload.strategy_name!r}, overlap_step=True) stepped every block during "
                f"fabric.backward, before {what} could see every gradient; pass overlap_step=False to clip"
            )
        self._land_gradients()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self._executor()
        self._stepped_in_backward = False
        self._land_gradients()
        optimizer = getattr(optimizer, "optimizer", optimizer)  # (a _FabricOptimizer)

        def step() -> Any:
            self._before_precision_step(optimizer)
            return self.precision.optimizer_step(optimizer, **kwargs)

        return self.offload._host_step(optimizer, self.offload._fuse(optimizer), step)

    def _before_precision_step(self, optimizer: Optimizer) -> None:
        """Inside the host step, right before the precision plugin's step (a ``GradScaler``'s)."""

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        # with the tier a checkpoint is as large as the state kept out of memory: written through our cache-bounded
        # atomic writer, not the page cache (as under the Trainer); a CheckpointIO the user chose is kept
        if self.offload.nvme_path is not None and type(self.checkpoint_io) is TorchCheckpointIO and storage_options is None:
            state = self._convert_stateful_objects_in_state(state, filter=filter or {})  # (every rank: a collective)
            if self.is_global_zero:
                AtomicCheckpointIO().save_checkpoint(state, path)
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
