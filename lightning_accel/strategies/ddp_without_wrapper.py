"""DDPWithoutWrapper: Lightning's DDP launch, process group and sampler, with gradients the subclass averages itself.

Why a base of its own: :class:`~lightning_accel.strategies.DistributedGPipeStrategy` (each rank a
pipeline stage) and :class:`~lightning_accel.strategies.L2LOffloadDDPStrategy` (each rank streams
the model from host memory) are ``DDPStrategy`` subclasses for what Lightning decides from the
strategy's class (launcher, process-group backend, ``DistributedSampler``), and neither can wrap
the model in ``DistributedDataParallel``: the model is split, or lives on the host. What every such
strategy then owes the user is written here once:

- the process-group timeout: one default for both, :data:`DEFAULT_TIMEOUT` (Lightning's and torch's
  30 minutes), a number taken as seconds;
- refusals, each with its reason: ``DistributedDataParallel`` arguments (there is no wrapper to take
  them), manual optimization and ``sync_batchnorm`` for a fit, and a loss scaler that is not
  torch's ``GradScaler`` (the found-inf agreement reads its per-optimizer state);
- ``block_backward_sync``: while Lightning accumulates gradients, :attr:`_sync_grads` is False and
  the subclass averages nothing;
- clipping by norm and a ``GradScaler``'s overflow verdict across ranks: from the end of setup
  (:meth:`_replace_plugin_methods`, which the subclass's setup calls) to teardown, the precision
  plugin's ``clip_grad_by_norm`` is the subclass's :meth:`_clip_grad_by_norm` (the whole gradient's
  norm, :mod:`lightning_accel.comm.gradients`) and its ``_after_closure`` first agrees on found-inf
  over :meth:`_found_inf_group`, so every rank skips the step and lowers the scale together. The
  plugin is the user's object (a second ``Trainer`` may get it): teardown puts both back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.comm.gradients import agree_found_inf
from lightning_accel.patching import Patch, patch, remove_all

__all__ = ["DEFAULT_TIMEOUT", "DDPWithoutWrapper"]

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""How long a rank waits in a collective before failing (a dead rank ends every rank with an error, never a hang):
Lightning's ``DDPStrategy`` default, torch's ``default_pg_timeout``."""

# DDPStrategy's arguments for the wrapper, and the ones it takes for itself
_WRAPPER_ARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
_DDP_KEYS = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
             "process_group_backend", "start_method", *_WRAPPER_ARGS}


class DDPWithoutWrapper(DDPStrategy):
    """A ``DDPStrategy`` that never wraps the model; the subclass averages its gradients (see the module docstring).

    Subclasses say, for the refusals' messages, how they average (:attr:`_averaging`), why they need automatic
    optimization (:attr:`_needs_automatic`) and which fp16 plugin to use (:attr:`_fp16_hint`); they give
    :meth:`_clip_grad_by_norm`, :meth:`_clips_across` / :meth:`_found_inf_group` where the defaults do not fit, and call
    :meth:`_refuse_unsupported` first in their setup and :meth:`_replace_plugin_methods` last.

    Args:
        timeout: see :data:`DEFAULT_TIMEOUT`; a number is seconds, None the default.
        kwargs: ``DDPStrategy``'s own arguments (``process_group_backend``, ``start_method``, ``parallel_devices``,
            ...); the wrapper's (``ddp_comm_hook``, ``find_unused_parameters``, ...) are refused.
    """

    _averaging = "gradients are averaged by the strategy itself"
    _needs_automatic = "it averages gradients once per optimizer step"
    _fp16_hint = "MixedPrecision('16-mixed', device, scaler=torch.amp.GradScaler(device))"

    def __init__(self, timeout: timedelta | float | None = DEFAULT_TIMEOUT, **kwargs: Any) -> None:
        unused = [k for k in _WRAPPER_ARGS if kwargs.get(k) is not None] + [k for k in kwargs if k not in _DDP_KEYS]
        if unused:
            raise ValueError(
                f"{type(self).__name__} does not wrap the model in DistributedDataParallel, so {unused[0]}=... would be "
                f"ignored; remove it ({self._averaging})"
            )
        if timeout is None:
            timeout = DEFAULT_TIMEOUT
        elif not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        super().__init__(timeout=timeout, **kwargs)
        self._sync_grads = True  # False while Lightning accumulates gradients (block_backward_sync)
        self._plugin_patches: list[Patch] = []  # on the precision plugin, from setup to teardown

    def _refuse_unsupported(self, trainer: pl.Trainer) -> None:
        """At setup, before any work: what this strategy cannot honour, each with its reason."""
        fitting = trainer.state.fn == TrainerFn.FITTING
        name = type(self).__name__
        if fitting:
            self.check_fit(trainer.lightning_module, self._layer_sync is not None)
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise ValueError(
                f"{name} agrees on fp16 overflows across ranks through torch's GradScaler, not "
                f"{type(scaler).__name__}; use {self._fp16_hint}"
            )

    def check_fit(self, module: Any, sync_batchnorm: bool) -> None:
        """What a fit of ``module`` needs of this strategy that it cannot honour, asked at set-up and by preflight (on
        the module built on the meta device and ``trainer.sync_batchnorm``): manual optimization, BatchNorm sync."""
        name = type(self).__name__
        if not getattr(module, "automatic_optimization", True):  # a plain nn.Module network: Lightning's default
            raise ValueError(
                f"{name} needs automatic optimization ({type(module).__name__} sets automatic_optimization=False): "
                f"{self._needs_automatic}; remove `self.automatic_optimization = False`"
            )
        if sync_batchnorm:
            raise ValueError(f"{name} does not convert BatchNorm layers (Trainer(sync_batchnorm=True)); remove sync_batchnorm")

    @contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning accumulates gradients over batches: they are averaged only after the last one."""
        self._sync_grads = False
        try:
            yield
        finally:
            self._sync_grads = True

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """The precision plugin's ``clip_grad_by_norm`` during a step: by the norm of the whole gradient, across ranks."""
        raise NotImplementedError

    def _clips_across(self) -> bool:
        """Whether clipping needs the ranks' parts (False where every rank holds the whole averaged gradient)."""
        return True

    def _found_inf_group(self) -> tuple[dist.ProcessGroup | None, torch.device]:
        """The group (None: every rank) and device of the found-inf agreement."""
        return None, self.root_device

    def _replace_plugin_methods(self) -> None:
        """At the end of setup: the precision plugin clips by the norm across ranks (where :meth:`_clips_across`) and,
        with a ``GradScaler``, agrees on found-inf over :meth:`_found_inf_group` between its ``unscale_`` and its
        ``scaler.step``, so every rank skips the step and lowers the scale together. Through :class:`~lightning_accel.patching.Patch`
        until :meth:`teardown` (which Lightning also calls when a fit raises): the plugin is the user's object, and a
        second ``Trainer`` may be handed it."""
        self._remove_plugin_methods()  # a setup without a teardown between: patch once, not over our own patch
        plugin = self.precision_plugin
        if self._clips_across():  # Lightning's clipping by norm would see only this rank's part
            self._plugin_patches.append(patch(plugin, "clip_grad_by_norm", self._clip_grad_by_norm))
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None:
            after_closure = plugin._after_closure
            group, device = self._found_inf_group()

            def agreed(module: Any, optimizer: Any) -> None:
                agree_found_inf(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values(), group, device)
                after_closure(module, optimizer)

            self._plugin_patches.append(patch(plugin, "_after_closure", agreed))

    def _remove_plugin_methods(self) -> None:
        remove_all(self._plugin_patches)

    @override
    def teardown(self) -> None:
        self._remove_plugin_methods()
        super().teardown()
