"""One pipeline stage as torch's ``PipelineStage`` runs it, and which parameters lie outside every stage.

A :class:`StageModule` is the ``submod`` torch's stage calls: the model's own forward on a micro-batch, this stage's
blocks computing and the other ranks' blocks standing in as receive and send points
(:class:`~lightning_accel.pipeline.boundaries.StageBoundaries`). :func:`shared_parameters` lists what lies outside the
blocks (embeddings, final norm, head), which every rank keeps, and refuses a tensor two stages' blocks share. No
Lightning here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_accel.models.block_policy import Block
from lightning_accel.pipeline.step_failure import stand_in
from lightning_accel.pipeline.step_recorder import Mark, StepRecorder
from lightning_accel.pipeline.timeline import Event

if TYPE_CHECKING:
    from lightning_accel.pipeline.distributed import RankPipeline

__all__ = ["StageModule", "shared_parameters"]


class StageModule(nn.Module):
    """One pipeline stage as torch's ``PipelineStage`` runs it: the model's own forward on a micro-batch, with this
    stage's blocks computing and the others' as boundaries (:class:`StageBoundaries`).

    Its submodules are the stage's blocks (the user's modules themselves, not copies). The
    first stage's input is the micro-batch index; a later stage's, the activation the
    previous stage sent (micro-batches arrive in order, so the index is counted). The last
    stage returns the micro-batch's loss. ``remat_stop``: micro-batches of a step with an
    index below it re-materialize the stage's blocks (counted by :attr:`microbatch`, which
    :class:`RankPipeline` resets before each step).
    """

    def __init__(self, pipe: RankPipeline, stage: int, remat_stop: int = 0) -> None:
        super().__init__()
        self.pipe, self.stage, self.remat_stop, self.microbatch = pipe, stage, remat_stop, 0
        self.blocks = nn.ModuleList([pipe.blocks[k] for k in pipe.boundaries.stage_range(stage)])
        self.recorder: StepRecorder | None = None
        self.split_backward = False  # set by PipeStage while torch runs an input- or weight-gradient half of a backward
        self.out_metas: Any = None  # torch's metadata of this stage's outputs, set by PipeStage before each forward

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The stage's blocks' parameters; during a split backward (zero-bubble schedules) also the trainable ones outside
        the blocks, which this stage's forward may use (an embedding, a head): torch computes the weight half for exactly
        ``submod.parameters()``, so those would otherwise get no gradient."""
        yield from super().parameters(recurse)
        if self.split_backward:
            yield from (p for p in self.pipe.shared_params if p.requires_grad)

    def forward(self, *xs: Tensor) -> Tensor | tuple[Tensor, ...]:
        # stage 0: the micro-batch index; a later stage: the previous stage's tensors (one, or a block output's several)
        index = int(xs[0].reshape(-1)[0]) if self.stage == 0 else self.microbatch
        self.microbatch += 1
        router, carried, sent = self.pipe.router, None, xs
        if router is not None and self.stage > 0:  # the previous stages' router sums ride last (router_carry)
            *sent, carried = xs
        received = None if self.stage == 0 else sent[0] if len(sent) == 1 else tuple(sent)
        remat = index < self.remat_stop
        recorder, mark = self.recorder, None
        if recorder is not None:
            position, start = recorder.next_forward(self.stage), time.time()
            mark = lambda t: Mark.apply(t, lambda: recorder.end_backward(self.stage, position))  # noqa: E731
        last = self.stage == len(self.pipe.balance) - 1
        if last and self.pipe._inferring:
            # torch's shape inference runs each stage once more before the first step; the last stage's output is a
            # loss (no shape to learn), so a stand-in keeps the user's code (and its side effects) to one run per micro-batch
            floats = [t for t in xs if t.is_floating_point()]
            if received is None or not floats:
                return torch.zeros(1, device=self.pipe.device, requires_grad=True)
            return sum((t * 0).sum() for t in floats).reshape(1)  # its gradients: dense zeros shaped like the inputs
        failure = self.pipe.failure
        if failure.stopped():  # this step failed (here or on a peer): zeros travel on, the user's code does not run again
            return stand_in(None if last else self.out_metas, self.pipe.device)
        self.pipe._forwarding = True  # a micro-batch's forward (a recomputation in backward runs outside it)
        try:
            with router.micro_batch(carried, last, self.pipe.device) if router is not None else nullcontext() as routed:
                out = self.pipe.boundaries.run(self.stage, received, lambda: self.pipe._forward(index), remat, mark)
                if routed is not None and not last:
                    out = routed.attach(out)
        except Exception as err:  # the user's error: raised as itself after the schedule (lightning_accel.pipeline.step_failure)
            failure.record(err, self.stage, backward=False)
            return stand_in(None if last else self.out_metas, self.pipe.device)
        finally:
            self.pipe._forwarding = False
        if last and self.pipe._whole is not None:  # the whole step: the output is kept, the schedule gets a stand-in
            out = self.pipe._whole.keep(index, out, self.pipe.device)
        if last:
            if not isinstance(out, Tensor) or out.numel() != 1:
                raise ValueError(
                    f"the last pipeline stage's forward must return the micro-batch's loss (one number), got "
                    f"{type(out).__name__}{tuple(out.shape) if isinstance(out, Tensor) else ''}"
                )
            out = out.reshape(1)  # torch's schedule concatenates the last stage's outputs: one row per micro-batch
        elif isinstance(out, tuple):
            out = tuple(t.contiguous() for t in out)  # what the transport sends (a block may return views)
        else:
            out = out.contiguous()
        if recorder is not None:
            marked = lambda t: Mark.apply(t, lambda: recorder.start_backward(self.stage, position))  # noqa: E731
            out = (marked(out[0]), *out[1:]) if isinstance(out, tuple) else marked(out)
            recorder.events.append(Event(self.stage, "F", position, start, time.time()))
        return out


def shared_parameters(net: nn.Module, blocks: Sequence[Block], balance: Sequence[int]) -> list[nn.Parameter]:
    """The parameters outside every block (on every rank), in one order all ranks share; refuses a tensor that a block of
    one stage shares with another stage's block or with the model outside the blocks (it would live on two ranks)."""
    stage_of: dict[int, tuple[int, str]] = {}
    start = 0
    for s, count in enumerate(balance):
        for block in blocks[start : start + count]:
            for n, t in [*block.module.named_parameters(), *block.module.named_buffers()]:
                seen = stage_of.setdefault(id(t), (s, f"{block.name}.{n}"))
                if seen[0] != s:
                    raise ValueError(
                        f"{seen[1]} is shared between pipeline stages {seen[0]} and {s}; the multi-process pipeline "
                        "cannot keep one block tensor on two ranks; untie it, or choose blocks (blocks=...) that "
                        "do not share weights"
                    )
        start += count
    in_blocks = {id(m) for b in blocks for m in b.module.modules()}
    shared_params: list[nn.Parameter] = []
    kept: set[int] = set()
    for name, module in net.named_modules(remove_duplicate=False):
        if id(module) in in_blocks:
            continue
        for n, p in module.named_parameters(recurse=False):
            if id(p) in stage_of:
                raise ValueError(
                    f"{name}.{n} is also {stage_of[id(p)][1]}, a block's parameter; the pipeline keeps what is outside "
                    "the blocks on every rank and a block on one; untie it"
                )
            if id(p) not in kept:
                kept.add(id(p))
                shared_params.append(p)
    return shared_params
