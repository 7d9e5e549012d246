"""The multi-process pipeline: one stage (or several, interleaved) per rank on ``torch.distributed.pipelining``.

Each rank builds only its own stage from the user's block network (``pre`` joins the
first stage, ``post`` the last), hands it to a :class:`PipelineStage`, and runs one of
PyTorch's schedules (``gpipe``, ``1f1b``, ``interleaved_1f1b``). The schedule chunks the
batch, sends activations forward and gradients back between ranks, and accumulates
each micro-batch's gradients into the stage's parameters, scaled by ``1 / chunks`` so a
mean loss matches plain training.

Failure: a neighbour that dies makes the transport raise (gloo closes the connection;
a hung peer hits the process group's timeout); :meth:`RankPipeline.step` turns that
into one error naming this rank, its stage and the neighbouring ranks, so every rank
exits within the timeout instead of hanging. Batches whose shape differs from the first
step's (the stages fixed their activation shapes then) are refused before any exchange.

:class:`lightning_accel.strategies.gpipe_distributed.DistributedGPipeStrategy` drives it
inside a Lightning ``Trainer``; ``lightning-accel bench pipeline`` and
``tests/pipeline/test_distributed.py`` drive it directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from lightning_accel.models.blocks import require_block_network
from lightning_accel.pipeline.partition import check_balance
from lightning_accel.pipeline.schedule import check_schedule
from lightning_accel.pipeline.timeline import Event

__all__ = ["RankPipeline", "StageModule", "stage_indices"]


class _Mark(torch.autograd.Function):
    """Identity whose backward calls ``callback``: tells the recorder when a gradient passes a point."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, callback: Callable[[], None]) -> Tensor:
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.callback()
        return grad, None


class _Recorder:
    """Collects this rank's timeline events of one step (wall-clock seconds)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.forwards: dict[int, int] = {}
        self.backward_start: dict[tuple[int, int], float] = {}

    def reset(self) -> None:
        self.events, self.forwards, self.backward_start = [], {}, {}

    def next_forward(self, stage: int) -> int:
        index = self.forwards.get(stage, 0)
        self.forwards[stage] = index + 1
        return index

    def start_backward(self, stage: int, microbatch: int) -> None:
        self.backward_start[(stage, microbatch)] = time.time()

    def end_backward(self, stage: int, microbatch: int) -> None:
        start = self.backward_start.pop((stage, microbatch), None)
        if start is not None:
            self.events.append(Event(stage, "B", microbatch, start, time.time()))

    def step_events(self, chunks: int) -> list[Event]:
        """The events of the step's ``chunks`` micro-batches. On the first step the stage runs
        an extra forward first (its shape inference, on real tensors); that one is dropped."""
        out = []
        for e in self.events:
            extra = self.forwards.get(e.stage, chunks) - chunks
            if e.microbatch >= extra:
                out.append(e._replace(microbatch=e.microbatch - extra))
        return out


class StageModule(nn.Module):
    """The slice of a block network one stage runs: ``pre`` (first stage), some blocks, ``post`` (last stage).

    It holds the user's modules themselves, not copies, and remembers each parameter's
    name in the user's network so checkpoints keep those names.
    """

    def __init__(self, net: nn.Module, balance: Sequence[int], stage: int) -> None:
        super().__init__()
        block_net = require_block_network(net, "the multi-process GPipe pipeline")
        start = sum(balance[:stage])
        self.stage, self.first, self.last = stage, stage == 0, stage == len(balance) - 1
        self.recorder: _Recorder | None = None
        self.pre = block_net.pre if self.first else None
        self.blocks = nn.ModuleList(block_net.blocks[start : start + balance[stage]])
        self.post = block_net.post if self.last else None
        mine = {id(p) for p in self.parameters()}
        self.user_names = {id(p): n for n, p in net.named_parameters(remove_duplicate=False) if id(p) in mine}
        outside = [block_net.pre] * (not self.first) + [block_net.post] * (not self.last) + [
            b for i, b in enumerate(block_net.blocks) if not start <= i < start + balance[stage]
        ]
        # a tensor both here and in another stage (GPT's tied embedding and head) would need its
        # gradient summed across ranks; refuse it rather than train two diverging copies
        shared = sorted(self.user_names[id(p)] for m in outside for p in m.parameters() if id(p) in mine)
        if shared:
            raise ValueError(
                f"parameter {shared[0]} is shared between pipeline stage {stage} and another stage; the "
                "multi-process pipeline cannot keep one tensor on two ranks. HINT: untie it (e.g. GPT(tie_weights=False))"
            )

    def forward(self, x: Tensor) -> Tensor:
        recorder = self.recorder
        if recorder is None or x.device.type == "meta":  # meta: the stage's shape inference, not a micro-batch
            return self._run(x)
        index, start = recorder.next_forward(self.stage), time.time()
        x = self.pre(x) if self.pre is not None else x
        # backward of this micro-batch ends when its gradient reaches the stage input (after pre on stage 0)
        x = _Mark.apply(x, lambda: recorder.end_backward(self.stage, index)) if x.requires_grad else x
        out = self._run(x, pre=False)
        out = _Mark.apply(out, lambda: recorder.start_backward(self.stage, index))
        recorder.events.append(Event(self.stage, "F", index, start, time.time()))
        return out

    def _run(self, x: Tensor, pre: bool = True) -> Tensor:
        if pre and self.pre is not None:
            x = self.pre(x)
        for block in self.blocks:
            x = block(x)
        return self.post(x) if self.post is not None else x

    def user_state_dict(self) -> dict[str, Tensor]:
        """This stage's parameters under their names in the user's network."""
        return {self.user_names[id(p)]: p.detach() for p in self.parameters()}


def stage_indices(rank: int, world_size: int, schedule: str) -> list[int]:
    """Stages rank ``rank`` runs: one, or two for ``interleaved_1f1b`` (``rank`` and ``rank + world_size``)."""
    return [rank, rank + world_size] if schedule == "interleaved_1f1b" else [rank]


class RankPipeline:
    """This rank's stages of ``net`` and the schedule that drives them.

    ``balance`` has one entry per stage: ``world_size`` stages, or ``2 * world_size`` for
    ``interleaved_1f1b``. ``loss_fn(output, target)`` is the per-micro-batch loss: a mean
    over the micro-batch (``scale_grads=True``: gradients are divided by ``chunks``, so they
    equal those of the batch mean), or a sum (``scale_grads=False``).
    """

    def __init__(
        self,
        net: nn.Module,
        balance: Sequence[int],
        chunks: int,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        schedule: str = "gpipe",
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
        record: bool = False,
        scale_grads: bool = True,
    ) -> None:
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        stages = len(stage_indices(0, self.world_size, schedule)) * self.world_size
        check_schedule(schedule, chunks, stages)
        block_net = require_block_network(net, "the multi-process GPipe pipeline")
        if len(balance) != stages:
            raise ValueError(
                f"schedule {schedule!r} on {self.world_size} ranks runs {stages} stages but balance has "
                f"{len(balance)} ({list(balance)}); give {stages} entries"
            )
        self.balance = check_balance(balance, len(block_net.blocks), stages)
        self.chunks, self.schedule_name, self.device = chunks, schedule, torch.device(device)
        self.indices = stage_indices(self.rank, self.world_size, schedule)
        self.modules = [StageModule(net, self.balance, s).to(self.device) for s in self.indices]
        self.recorder = _Recorder() if record else None
        self._shapes: tuple[tuple[int, ...] | None, tuple[int, ...] | None] | None = None
        for m in self.modules:
            m.recorder = self.recorder
        self.stages = [
            PipelineStage(m, s, stages, self.device, group=group) for m, s in zip(self.modules, self.indices)
        ]
        kwargs = {"n_microbatches": chunks, "loss_fn": loss_fn, "scale_grads": scale_grads}
        if schedule == "gpipe":
            self.schedule: Any = ScheduleGPipe(self.stages[0], **kwargs)
        elif schedule == "1f1b":
            self.schedule = Schedule1F1B(self.stages[0], **kwargs)
        else:
            self.schedule = ScheduleInterleaved1F1B(self.stages, **kwargs)

    @property
    def holds_first(self) -> bool:
        return 0 in self.indices

    @property
    def holds_last(self) -> bool:
        return len(self.balance) - 1 in self.indices

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def step(self, inputs: Tensor | None = None, target: Tensor | None = None) -> Tensor | None:
        """Forward and backward of one batch; returns the batch loss (mean of the micro-batch losses) on the last stage's rank."""
        if inputs is not None and inputs.size(0) % self.chunks:
            raise ValueError(
                f"the batch size {inputs.size(0)} is not divisible by chunks={self.chunks}; the multi-process "
                "pipeline needs equal micro-batches for its loss to match plain training (drop_last=True and a "
                "batch size that is a multiple of chunks)"
            )
        shapes = (None if inputs is None else tuple(inputs.shape), None if target is None else tuple(target.shape))
        if self._shapes is None:
            self._shapes = shapes
        elif shapes != self._shapes:
            raise ValueError(
                f"batch shapes (inputs, target) {shapes} differ from the first step's {self._shapes}; the stages fixed "
                "their activation shapes at the first step and every rank must send the same. HINT: drop_last=True on "
                "the DataLoader, and pad or crop inputs to one shape"
            )
        losses: list[Tensor] = []
        if self.recorder is not None:
            self.recorder.reset()
        args = (inputs.to(self.device),) if self.holds_first and inputs is not None else ()
        try:
            self.schedule.step(
                *args,
                target=target.to(self.device) if self.holds_last and target is not None else None,
                losses=losses if self.holds_last else None,
            )
        except Exception as err:  # noqa: BLE001  # any transport error: name the ranks, never hang
            neighbours = sorted({r for r in (self.rank - 1, self.rank + 1) if 0 <= r < self.world_size})
            raise RuntimeError(
                f"pipeline step failed on rank {self.rank} (stages {self.indices}) while exchanging with rank(s) "
                f"{neighbours}: {type(err).__name__}: {err}. HINT: a neighbouring rank probably died or timed "
                "out; its own log has the first error"
            ) from err
        return torch.stack(losses).mean() if losses else None

    def events(self) -> list[Event]:
        """This rank's timeline of the last step (``record=True``); gather the ranks' lists for the whole picture."""
        if self.recorder is None:
            raise ValueError("this pipeline records no timeline; build it with record=True")
        return self.recorder.step_events(self.chunks)
