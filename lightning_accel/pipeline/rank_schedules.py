"""The schedules one pipeline rank keeps: torch's stages and schedule over its stage modules, one per batch shape and call.

Why several: a ``PipelineStage`` fixes its activation shapes (and which of them carry gradients) at its first step, and
receives into buffers of those shapes. So a batch of another shape (a smaller last batch), a micro-batch count that
``chunks`` does not give, a second call of the model in one step, or parameters frozen or unfrozen since (BaseFinetuning)
each get fresh stages and a schedule of their own, built on first use under a key every rank computes alike
(:meth:`RankSchedules._ready`). Building one runs torch's shape inference, a real forward and backward of micro-batch 0:
what it writes to buffers and draws from the random generators is put back (BatchNorm statistics, dropout masks). Under
GPipe the schedule is :class:`~lightning_accel.pipeline.split_gpipe.SplitGPipe`, whose step also runs as a forward phase
and a backward phase (a model call inside the user's step: :mod:`lightning_accel.pipeline.whole_step`). No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_accel.pipeline.local import checkpoint_stop
from lightning_accel.pipeline.schedule import SCHEDULE_TABLE, check_schedule, stage_indices
from lightning_accel.pipeline.split_gpipe import SplitGPipe
from lightning_accel.pipeline.torch_stage import PipeStage

__all__ = ["RankSchedules"]


def _rng_kept(device: torch.device) -> Any:
    """The CPU's (and ``device``'s) random generators restored on exit."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device.index or 0], device_type=device.type)


class RankSchedules:
    """The schedules of :class:`~lightning_accel.pipeline.distributed.RankPipeline` (see the module docstring): a mixin
    over its state (its stage modules, balance, schedule name, chunks, device and group)."""

    rank: int
    world_size: int
    indices: list[int]
    balance: list[int]
    schedule_name: str
    chunks: int
    device: torch.device
    group: Any
    net: torch.nn.Module
    modules: list[Any]
    checkpoint: str
    scale_grads: bool
    recorder: Any
    schedule: Any
    step_chunks: int
    _by_shape: dict[Any, Any]
    _trainable: tuple[bool, ...]
    _inferring: bool
    _whole: Any
    _losses: list[Tensor]
    _forward: Callable[[int], Any]

    def reschedule(self, schedule: str, chunks: int) -> None:
        """Run the next steps under ``schedule`` in ``chunks`` micro-batches; between steps only, and only to a schedule
        whose stages sit on the same ranks (:func:`lightning_accel.pipeline.auto_schedule.same_placement`): the
        parameters and optimizer state stay where they are."""
        if stage_indices(self.rank, self.world_size, schedule) != self.indices:
            raise ValueError(
                f"cannot reschedule from {self.schedule_name!r} to {schedule!r}: its stages sit on other ranks; "
                "choose a schedule of the same placement"
            )
        check_schedule(schedule, chunks, len(self.balance))
        self.schedule_name, self.chunks = schedule, chunks
        self._by_shape = {}
        self.schedule = self._build_schedule(chunks)


    def _loss(self, output: Tensor, _target: Tensor) -> Tensor:
        """The last stage returns the micro-batch's loss itself; the schedule's loss function only scales it."""
        output = output.reshape(())
        if self._whole is not None:  # a whole step's stand-in (lightning_accel.pipeline.whole_step): its gradients are exact
            return output.sum()  # not a view: torch's stage detaches the loss in place after its backward
        if self._inferring:
            # torch's shape inference runs the last stage once more, only for the shapes of the gradients it sends back
            return output
        self._losses.append(output.detach())
        return output / self.step_chunks if self.scale_grads else output

    def _build_schedule(self, chunks: int) -> Any:
        """Fresh stages over this rank's modules, and the schedule driving them over ``chunks`` micro-batches (stages fix
        their shapes at their first step)."""
        stages = [
            PipeStage(m, s, len(self.balance), self.device, group=self.group)
            for m, s in zip(self.modules, self.indices)
        ]
        if self.schedule_name == "gpipe":  # torch's, its step also runnable in two halves (a model call inside a step)
            schedule: Any = SplitGPipe(stages[0], n_microbatches=chunks, loss_fn=self._loss, scale_grads=False)
        else:
            schedule = SCHEDULE_TABLE[self.schedule_name].build(stages, n_microbatches=chunks, loss_fn=self._loss, scale_grads=False)
        initialize = getattr(schedule, "_initialize_pp_stages", None)  # torch's metadata inference (torch 2.13)
        if initialize is not None:

            def inferring(*args: Any, **kwargs: Any) -> Any:
                # a real forward and backward of micro-batch 0 (torch 2.13; later stages on uninitialized inputs): what
                # it writes to buffers and draws from the random generators is put back, so the step runs as if it
                # had not happened (BatchNorm statistics, dropout masks)
                saved = [(b, b.detach().clone()) for b in self.net.buffers() if not b.is_meta]
                self._inferring = True
                try:
                    with _rng_kept(self.device):
                        return initialize(*args, **kwargs)
                finally:
                    self._inferring = False
                    with torch.no_grad():
                        for b, value in saved:
                            if not torch.equal(b, value):  # an unchanged buffer keeps its version (a view of it may be saved for a backward)
                                b.copy_(value)
                    self._restart_microbatches()  # the inference's forwards were not micro-batches of the step

            schedule._initialize_pp_stages = inferring
        return schedule

    def _requires_grad(self) -> tuple[bool, ...]:
        """Which of the whole model's parameters train (placeholders included: every rank sees the same, no exchange).
        torch's stages learn at their first step which activations carry a gradient between ranks, so a change needs
        fresh stages."""
        return tuple(p.requires_grad for p in self.net.parameters())

    def _restart_microbatches(self) -> None:
        """The next forward of each stage is micro-batch 0 (what re-materialization counts from)."""
        for m in self.modules:
            m.microbatch = 0


    @staticmethod
    def discard(schedule: Any) -> None:
        """Forget a :meth:`forward_phase` whose backward will not run (the step returned no loss, or failed)."""
        schedule._internal_losses.clear()
        schedule._stage.clear_runtime_states()


    def _ready(self, forward: Callable[[int], Any], shape: Any, chunks: int | None) -> tuple[Any, int]:
        """The schedule for this step's shape and micro-batch count, made ready to run ``forward``."""
        chunks = self.chunks if chunks is None else chunks
        if self._requires_grad() != self._trainable:  # frozen or unfrozen since the stages were built (BaseFinetuning)
            self._trainable, self._by_shape = self._requires_grad(), {}
            self.schedule = self._build_schedule(self.chunks)  # its shape inference learns which activations need grad
        if shape is not None:
            if not self._by_shape and chunks == self.chunks:
                self._by_shape[shape] = self.schedule  # the first shape keeps the schedule built in __init__
            elif shape not in self._by_shape:
                self._by_shape[shape] = self._build_schedule(chunks)
            schedule = self._by_shape[shape]
        elif chunks != self.chunks:
            raise ValueError(f"a step of {chunks} micro-batches (not chunks={self.chunks}) needs a shape key of its own")
        else:
            schedule = self.schedule
        self.step_chunks = chunks
        for m in self.modules:
            m.remat_stop = checkpoint_stop(self.checkpoint, chunks)
        self._losses = []
        if self.recorder is not None:
            self.recorder.reset()
        self._restart_microbatches()
        self._forward = forward
        return schedule, chunks

