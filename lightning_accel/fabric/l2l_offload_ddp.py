"""L2L offload on N processes for a loop the user writes: ``Fabric(strategy="l2l_offload_ddp", devices=N)``.

Data parallel with the host optimizer partitioned across ranks (ZeRO-Offload), launched as Fabric launches
(``fabric.launch()`` with its subprocess launcher, or a launcher's environment: torchrun, SLURM): the class is a
Fabric ``DDPStrategy`` for what Fabric decides from it (launcher, process group, ``DistributedSampler``,
``all_reduce`` / ``all_gather`` / ``barrier`` / ``broadcast``) that never wraps the model in
``DistributedDataParallel``. The Trainer's :class:`~lightning_accel.strategies.L2LOffloadDDPStrategy` is its engine,
built from the same arguments (the same options, checks and errors): placement, rank 0's weights sent to every rank,
the units' owners, the gradients averaged block by block as the backward finishes them (on a gloo group of the host
tensors), the partitioned host step and the updated weights sent from each owner. The Fabric methods reach it through
:class:`~lightning_accel.fabric.offload_adapter.FabricOffload` (shared with ``Fabric(strategy="l2l_offload")``); what
several ranks add:

- ``fabric.no_backward_sync(model, enabled=True)``: nothing is averaged during that backward (accumulation: the host
  sums, averaged once, after the backward that ends it), as Fabric's DDP skips its all-reduce;
- ``fabric.clip_gradients``: by norm, the norm of the whole averaged gradient across ranks (partitioned, each rank
  holds its own blocks' averages: the partial norms are summed over the ranks); by value, each rank clips what it
  steps;
- ``precision="16-mixed"``: each rank's ``GradScaler`` checks the gradients it holds, and the ranks agree (any overflow:
  every rank skips the step and lowers the scale), as DDP's ranks do on their common gradient;
- ``fabric.save``: the user's parameter names and one plain optimizer state over every parameter (rank 0 gathers the
  shards); ``fabric.load`` hands each rank its shard, so a checkpoint of Fabric's DDP loads here and this one there.

Refused in one line, when the ``Fabric`` is built: ``delayed_update`` (its landing points are the Trainer's hooks),
``overlap_step=True`` and DistributedDataParallel's own arguments (the engine's refusals), a precision that would
change the host masters' dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy
from torch.amp.grad_scaler import OptState
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.comm.gradients import agree_found_inf, grad_norm_over
from lightning_accel.fabric.offload_adapter import FabricOffload, refuse_delayed_update
from lightning_accel.models.block_policy import BlockPolicy
from lightning_accel.strategies.ddp_without_wrapper import DEFAULT_TIMEOUT
from lightning_accel.strategies.l2l_offload_ddp import HostStep
from lightning_accel.strategies.l2l_offload_ddp import L2LOffloadDDPStrategy as TrainerL2LOffloadDDPStrategy

__all__ = ["L2LOffloadDDPStrategy"]


class _Engine(TrainerL2LOffloadDDPStrategy):
    """The Trainer strategy driven by the Fabric one: a Fabric loop has no LightningModule hooks that read gradients."""

    @override
    def _reads_gradients(self, *hooks: str) -> bool:
        return False


# The engine's errors and plan lines name the strategy as the user wrote it, at either front door.
_Engine.__name__ = _Engine.__qualname__ = "L2LOffloadDDPStrategy"


class _NoAveraging(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the engine averages nothing during that backward."""

    def __init__(self, engine: TrainerL2LOffloadDDPStrategy) -> None:
        self._engine = engine

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self._engine.block_backward_sync() if enabled else nullcontext()


class L2LOffloadDDPStrategy(FabricOffload, DDPStrategy):
    """``Fabric(strategy="l2l_offload_ddp", devices=N)``: L2L offload on every rank, data parallel, the host optimizer
    partitioned across ranks.

    The arguments are the Trainer strategy's (:class:`lightning_accel.strategies.L2LOffloadDDPStrategy`), with the
    same meaning and checks; ``delayed_update`` is refused (see the module docstring). ``accelerator``,
    ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``, ``precision``, ``process_group_backend`` and
    ``start_method`` are Fabric's ``DDPStrategy``'s.
    """

    strategy_name = "l2l_offload_ddp"

    def __init__(
        self,
        host_step: HostStep = "partitioned",
        blocks: BlockPolicy = "auto",
        prefetch_blocks: int = 1,
        offload_resident: bool | None = None,
        checkpoint_blocks: bool = True,
        overlap_step: bool | None = None,
        delayed_update: bool = False,
        delayed_update_warmup: int | None = None,
        offload_activations: bool = False,
        timeout: timedelta | float | None = DEFAULT_TIMEOUT,
        nvme_path: str | None = None,
        host_budget: int | str | None = None,
        nvme_chunk: int | str | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        process_group_backend: str | None = None,
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        # DistributedDataParallel's arguments (kwargs) are refused by the engine: there is no wrapper to take them
        self.offload = _Engine(host_step, blocks, prefetch_blocks, offload_resident, checkpoint_blocks, overlap_step,
                               delayed_update, delayed_update_warmup, offload_activations, timeout, nvme_path,
                               host_budget, nvme_chunk, **kwargs)
        if delayed_update:
            raise refuse_delayed_update("l2l_offload_ddp", "L2LOffloadDDPStrategy")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision=precision, process_group_backend=process_group_backend,
                         timeout=self.offload._timeout, start_method=start_method)  # type: ignore[arg-type]
        self._backward_sync_control = _NoAveraging(self.offload)

    @property
    def host_step(self) -> str:
        return self.offload.host_step

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the default process group (Fabric's, from the launcher's environment)
        engine = self.offload
        # the engine reads the ranks and devices where Fabric keeps them
        engine.cluster_environment = self.cluster_environment
        engine.parallel_devices = self.parallel_devices
        engine.num_nodes = self.num_nodes
        engine._make_host_group()

    @override
    def _placed(self, module: nn.Module) -> None:
        self.offload._broadcast_initial_weights(module)  # rank 0's weights on every rank, as DDP's wrapper does

    @override
    def _optimizers_added(self) -> None:
        if self.offload._grad_sync is None:  # the units' owners and the averaging, once
            self.offload._setup_sync()

    @override
    def _overlapped(self) -> Optimizer | None:
        return None  # a block steps once its gradients are averaged, after the backward (the averaging overlaps)

    @override
    def _begin_backward(self, tensor: torch.Tensor) -> None:
        self.offload.pre_backward(tensor)  # the averaging starts unless fabric.no_backward_sync holds it

    @override
    def _end_backward(self, tensor: torch.Tensor) -> None:
        self.offload.post_backward(tensor)

    @override
    def _land_gradients(self) -> None:
        self.offload._gradients_ready()  # the averages joined (a no-op once joined, or inside an accumulation)
        self._executor().install_grads()

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float | int, norm_type: float | int = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        engine = self.offload
        if not engine._clips_across():  # replicated: every rank holds the whole averaged gradient, as under DDP
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self._gradients_for(optimizer, "fabric.clip_gradients")
        self.precision.unscale_gradients(optimizer)
        grads, counted = engine.held_grads(optimizer)
        norm = grad_norm_over(grads, counted, float(norm_type), engine._host_group, torch.device("cpu"))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it cannot "
                "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for grad in grads:
            grad.detach().mul_(coef.to(grad.dtype))
        return norm

    @override
    def _before_precision_step(self, optimizer: Optimizer) -> None:
        # fp16: each rank's GradScaler checked only the gradients it holds; every rank skips the step (and lowers the
        # scale) if any found an overflow, as DDP's ranks do on their common gradient
        scaler = getattr(self.precision, "scaler", None)
        if scaler is None:
            return
        state = scaler._per_optimizer_states[id(optimizer)]
        if state["stage"] is not OptState.UNSCALED:  # (fabric.clip_gradients unscaled them already)
            scaler.unscale_(optimizer)
        agree_found_inf(state["found_inf_per_device"].values(), *self.offload._found_inf_group())

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.offload.optimizer_state(optimizer)  # partitioned: rank 0 gathers every rank's shard (every rank calls it)

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        if not isinstance(state, dict):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        with _sharded(state, self.offload):  # each optimizer keeps its rank's shard of the checkpoint's plain state
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)


class _Shard:
    """An optimizer as ``fabric.load`` restores it here: the checkpoint's plain state cut to this rank's shard."""

    def __init__(self, optimizer: Optimizer, engine: TrainerL2LOffloadDDPStrategy) -> None:
        self.optimizer, self._engine = optimizer, engine

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(self._engine.optimizer_shard(self.optimizer, state))


@contextmanager
def _sharded(state: dict[str, Any], engine: TrainerL2LOffloadDDPStrategy) -> Iterator[None]:
    """The optimizers in ``state`` (the dict ``fabric.load`` reads back from) loaded as :class:`_Shard` while inside."""
    optimizers = {name: obj for name, obj in state.items() if isinstance(obj, Optimizer)}
    state.update({name: _Shard(optimizer, engine) for name, optimizer in optimizers.items()})
    try:
        yield
    finally:
        state.update(optimizers)
