"""What a pipeline's ranks do together for Lightning: the sampler's shard, ``self.log(sync_dist=True)``,
``self.all_gather``, the ranks' votes, and the whole model's gradient norm.

:class:`ReplicaCollectives` is the part of :class:`~lightning_accel.strategies.gpipe_distributed.DistributedGPipeStrategy`
behind Lightning's collectives: the ranks of one pipeline are the stages of one model and see the same batch, so what
DDP does over every rank (shard the data, reduce logged values, gather) is done over the data-parallel replicas, and
what needs the whole model (the gradient norm for clipping) over the pipeline's ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.comm.gradients import clip_grad_norm_over, grad_norm_over

__all__ = ["ReplicaCollectives"]


class ReplicaCollectives(DDPStrategy):
    """Lightning's collectives over the replicas, the gradient norm over the pipeline (see the module docstring)."""

    # -- what a rank is: DDP's rank is a replica, here a pipeline of pipeline_parallel_size processes ----

    @property
    def _processes(self) -> int:
        """Every process of the run: ``world_size * pipeline_parallel_size``."""
        return self.cluster_environment.world_size() if self.cluster_environment is not None else 1

    @property
    def _process_rank(self) -> int:
        """This process's rank among :attr:`_processes` (what the process group, the mesh and checkpoints use)."""
        return self.cluster_environment.global_rank() if self.cluster_environment is not None else 0

    @property
    @override
    def world_size(self) -> int:
        """How many replicas see data: the data-parallel size, what DDP's world size counts and what Lightning, its
        callbacks and the user's code read as such (``trainer.world_size``: a throughput's global rate, the linear
        learning-rate scaling rule, whether a skipped step must be refused). Not the process count: each of a pipeline's
        processes is a stage of one replica (``global_rank`` stays the process's: per-process files, rank zero's duties;
        :attr:`data_parallel_rank` is its replica)."""
        return self.data_parallel_size

    @property
    @override
    def parallel_devices(self) -> list[torch.device] | None:
        """Once launched, the devices of this node's replicas (``trainer.num_devices``, what callbacks multiply the
        batch size by); before, every process's (what Lightning launches). A pipeline that spans nodes counts one."""
        devices = self._parallel_devices
        if devices is None or getattr(self, "_mesh", None) is None:
            return devices
        return devices[: max(1, len(devices) // self.pipeline_parallel_size)]

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        self._parallel_devices = devices

    @property
    @override
    def root_device(self) -> torch.device:
        assert self._parallel_devices is not None
        return self._parallel_devices[self.local_rank]

    @property
    @override
    def num_processes(self) -> int:
        """This node's processes: every stage's."""
        return len(self._parallel_devices) if self._parallel_devices is not None else 0

    @property
    def data_parallel_rank(self) -> int:
        """This process's replica: the shard of the data it sees (every stage of a replica sees the same batch). The
        process's own rank stays ``global_rank`` (per-process files, rank zero's duties); shard data by hand with this
        and ``world_size``."""
        return self._coords[1]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # the ranks of one pipeline are the stages of one model: they see the same batch; each replica its own shard
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """``self.log(..., sync_dist=True)``: over the replicas (a pipeline's ranks log the same value)."""
        if group is None and self._mesh is not None:
            group = self._mesh.get_group("dp")
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """``self.all_gather(...)``: over the replicas, each on its own shard, as DDP's ranks are (a pipeline's ranks hold
        one step; its last rank alone reaches the end of the user's step, so a gather over every rank would wait). The
        LightningModule passes ``group.WORLD`` when the user names none: that means the replicas too. Inside a training
        micro-batch of several: refused (:meth:`check_fit` refuses it before the first step where the source shows it)."""
        pipe = self.pipeline
        if pipe is not None and pipe._forwarding and pipe.step_chunks > 1:
            raise ValueError(self._gather_in_step())
        if (group is None or group is dist.group.WORLD) and self._mesh is not None:
            group = self._mesh.get_group("dp")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # every rank's vote (early stopping, checkpointing), not the replicas' that ``reduce`` sums
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = self.reduce(flag, group=dist.group.WORLD if dist.is_initialized() else None, reduce_op="sum")
        return bool(flag == self._processes) if all else bool(flag)

    def grad_norm(self, norm_type: float = 2.0) -> Tensor:
        """The whole model's gradient norm, from every stage: what ``lightning.pytorch.utilities.grad_norm(module,
        norm_type)`` reports as its total under DDP (each rank here holds only its own stages' gradients). A collective
        over the pipeline's ranks: call it on every rank, e.g. in ``on_before_optimizer_step``."""
        params = [p for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        split, layout = self._split_state, self._layout
        assert split is not None
        counted = [split.counted_here(p, layout) for p in params]
        return grad_norm_over([p.grad for p in params], counted, float(norm_type), layout.pp_group, self.root_device)

    @override
    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """``torch.nn.utils.clip_grad_norm_`` over every stage: squared norms summed across the pipeline's ranks, what
        is outside the blocks counted once, on a rank that uses it (a tied weight's gradient, summed between its users,
        on the first of them; the replicas hold the same averaged gradients, so summing over them too would count each
        stage ``dp`` times)."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        split, layout = self._split_state, self._layout
        assert split is not None
        counted = [split.counted_here(p, layout) for p in params]  # a tied weight's summed gradient: on one user
        clip_grad_norm_over([p.grad for p in params], counted, float(clip_val), layout.pp_group, self.root_device)
