"""The multi-process pipeline: one stage (or several, interleaved) per rank on ``torch.distributed.pipelining``.

Each rank runs the model's own forward on every micro-batch; its stages' blocks compute, the other ranks' blocks are
receive and send points (:mod:`~lightning_accel.pipeline.boundaries`), so a model that calls its blocks from its own
loop with masks, position ids or rotary tables (transformers, litgpt) runs unchanged, and what it computes before the
first block is recomputed on every rank. A :class:`~lightning_accel.pipeline.stage_module.StageModule` per stage hands
that to torch's ``PipelineStage``, and one of torch's schedules (:data:`~lightning_accel.pipeline.schedule.SCHEDULE_TABLE`;
one per batch shape and call: :mod:`~lightning_accel.pipeline.rank_schedules`) sends activations forward and gradients
back. The other ranks' blocks are on ``meta``; what is outside the blocks is on every rank, stepped by the ranks that use
it (:mod:`~lightning_accel.pipeline.shared_params`). Why the model's own forward and not torch's ``pipeline()`` tracer: a
traced stage has its own parameter names, moves the user's loss and logging outside the graph, fixes one input shape,
and needs a model that traces (docs/pipeline.md has what it did on five real models).

Three ways to drive it: :meth:`RankPipeline.train_step` runs a batch's forward and backward in one schedule step (the
per-micro-batch user step of :mod:`~lightning_accel.pipeline.rank_step`, and :meth:`RankPipeline.step` for a loss
function); :meth:`RankPipeline.forward_phase` and :meth:`RankPipeline.backward_phase` run GPipe's halves apart (a model
call inside the user's step, :mod:`~lightning_accel.pipeline.whole_step`); :meth:`RankPipeline.evaluate` streams a batch
forward (:mod:`~lightning_accel.pipeline.evaluation`). Failures: an exception a stage raises keeps the schedule running on
stand-ins and is raised on every rank (:mod:`~lightning_accel.pipeline.step_failure`, :meth:`RankPipeline.settle`); a
neighbour that dies ends every rank with an error naming it (:meth:`RankPipeline._exchange_error`). Data parallel
replicas (DP x PP): each replica's ranks form one pipeline on the mesh's ``pp`` group (:mod:`~lightning_accel.pipeline.mesh`).
No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_accel.models.block_policy import Block, BlockPolicy, find_blocks
from lightning_accel.pipeline.batchnorm import DeferredBatchNorm
from lightning_accel.pipeline.boundaries import StageBoundaries
from lightning_accel.pipeline.evaluation import stream_evaluate
from lightning_accel.pipeline.gradients import average_gradients, sum_over_users
from lightning_accel.pipeline.local import checkpoint_stop
from lightning_accel.pipeline.mesh import mesh_coordinates, pipeline_mesh
from lightning_accel.pipeline.microbatch import batch_size, map_tensors, scatter, tensors_in
from lightning_accel.pipeline.partition import check_balance
from lightning_accel.pipeline.rank_schedules import RankSchedules
from lightning_accel.pipeline.router_carry import RouterCarry
from lightning_accel.pipeline.schedule import SCHEDULE_TABLE, check_schedule, equal_microbatches, stage_indices, stage_rank
from lightning_accel.pipeline.shared_params import SharedParams
from lightning_accel.pipeline.stage_meter import StageMeter
from lightning_accel.pipeline.stage_module import StageModule, shared_parameters
from lightning_accel.pipeline.step_failure import StepFailure, peer_said
from lightning_accel.pipeline.step_recorder import StepRecorder
from lightning_accel.pipeline.timeline import Event
from lightning_accel.pipeline.whole_step import entry_module

__all__ = [
    "RankPipeline",
    "StageModule",  # re-exported: lightning_accel.pipeline.stage_module
    "average_gradients",
    "mesh_coordinates",
    "pipeline_mesh",
    "stage_indices",
    "sum_over_users",
]


class RankPipeline(RankSchedules):
    """This rank's stages of ``net`` and the schedule that drives them.

    ``net`` is any model whose forward calls its blocks (``blocks``: a policy for
    :func:`lightning_accel.models.block_policy.find_blocks`, or the blocks found); each
    rank runs the model's own forward, its stages' blocks computing and the others'
    becoming receive and send points (:mod:`lightning_accel.pipeline.boundaries`). The
    blocks of other ranks' stages go to the ``meta`` device; everything outside the blocks
    (embeddings, norms, heads, their tied weights) stays on every rank, its parameters
    :attr:`shared_params` (shared by the ranks; ``offload/`` calls the same part its *resident*
    unit, for staying on the device while the blocks stream); after each step
    a parameter there has a gradient only on the ranks whose stages' forward used it,
    summed between them where there are two or more (a tied embedding and head), so the
    ranks that use it step it alike and the others leave it (:class:`~.shared_params.SharedParams`;
    :attr:`shared_owner` says whose value counts, :class:`~.rank_split.RankSplit` reads it).

    ``balance`` has one entry per stage: ``world_size`` stages, or ``2 * world_size`` for
    ``interleaved_1f1b``. ``loss_fn(output, target)`` is the per-micro-batch loss: a mean
    over the micro-batch (``scale_grads=True``: gradients are divided by ``chunks``, so they
    equal those of the batch mean), or a sum (``scale_grads=False``). ``group``: the ranks
    of this pipeline (the mesh's ``pp`` group; ``None``: every rank), whose size is the
    ``world_size`` above. ``checkpoint``: which micro-batches each stage re-materializes
    (its blocks, each under ``torch.utils.checkpoint``), ``"always"``, ``"except_last"``
    (the last one's backward follows its forward at once on the last stage, so keeping it
    costs little) or ``"never"`` (torch's schedules keep every micro-batch's activations in
    flight: all M with ``gpipe``, up to S with ``1f1b``). ``deferred_batch_norm``: BatchNorm
    running statistics are updated once per step from the whole batch (each stage's own
    BatchNorms, committed after the schedule); without it once per micro-batch, as plain
    BatchNorm on each micro-batch would. Either way a re-materialization and torch's shape
    inference leave every buffer untouched (:class:`lightning_accel.pipeline.batchnorm.DeferredBatchNorm`,
    :meth:`_build_schedule`). ``failure_group``: the ranks that learn, after each step, that a stage raised
    (:mod:`lightning_accel.pipeline.step_failure`): this pipeline's (``"pipeline"``, the default), or a group holding
    every replica (``None``: every rank), so that no replica waits for a failed one in its gradient average.
    """

    def __init__(
        self,
        net: nn.Module,
        balance: Sequence[int],
        chunks: int,
        loss_fn: Callable[[Any, Any], Tensor] | None = None,
        schedule: str = "gpipe",
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
        record: bool = False,
        scale_grads: bool = True,
        checkpoint: str = "never",
        blocks: BlockPolicy | Sequence[Block] = "auto",
        deferred_batch_norm: bool = False,
        failure_group: dist.ProcessGroup | None | str = "pipeline",
    ) -> None:
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        stages = len(stage_indices(0, self.world_size, schedule)) * self.world_size
        check_schedule(schedule, chunks, stages)
        found = list(blocks) if isinstance(blocks, (list, tuple)) and all(isinstance(b, Block) for b in blocks) else find_blocks(net, blocks)  # type: ignore[arg-type]
        if len(balance) != stages:
            raise ValueError(
                f"schedule {schedule!r} on {self.world_size} ranks runs {stages} stages but balance has "
                f"{len(balance)} ({list(balance)}); give {stages} entries"
            )
        self.balance = check_balance(balance, len(found), stages)
        self.net, self.loss_fn, self.scale_grads = net, loss_fn, scale_grads
        self.chunks, self.schedule_name, self.device = chunks, schedule, torch.device(device)
        self.indices = stage_indices(self.rank, self.world_size, schedule)
        self.blocks = [b.module for b in found]
        self.block_names = [b.name for b in found]
        self.shared_params = shared_parameters(net, found, self.balance)
        # who steps each of them, and who keeps it current (lightning_accel.pipeline.shared_params)
        self.shared = SharedParams(net, self.shared_params, self.rank, group, self._global)
        self.shared_owner = self.shared.owner  # id -> the rank whose value counts (its first user), once known
        # the module whose call runs the blocks: the user's step runs once a batch around it (lightning_accel.pipeline.whole_step);
        # where the model adds a router loss outside that module, the module that adds it (the loss needs every stage's sums)
        self.router = RouterCarry.of(net)  # a mixture of experts' router loss: its sums carried between stages
        self.entry = entry_module(net, self.blocks)
        if self.router is not None and self.entry is not None:
            self.entry = next(((n, m) for n, m in net.named_modules() if m is self.router.owner and n), self.entry)
        inside = {id(m) for m in self.entry[1].modules()} if self.entry is not None else set()
        # what the user's step may read after the model's call: every parameter outside the entry's module
        self.outside = {id(p) for m in net.modules() if id(m) not in inside for p in m.parameters(recurse=False)}
        for k, block in enumerate(self.blocks):  # other ranks' blocks: names, shapes and dtypes stay, storage goes
            if not any(k in self._stage_range(s) for s in self.indices):
                block.to("meta")
        net._apply(lambda t: t if t.is_meta else t.to(self.device))
        # a training forward inside a stage's micro-batch counts; a recomputation in backward and torch's shape
        # inference do not. Installed before the boundaries, so a BatchNorm that is a block of its own is recomputed
        # through it too (the block's checkpoint calls what it wraps)
        self._forwarding = self._inferring = False
        self.batch_norm = DeferredBatchNorm(net, lambda: self._forwarding and not self._inferring, deferred_batch_norm)
        self.boundaries = StageBoundaries(self.blocks, self.balance, self.block_names)
        self.checkpoint = checkpoint
        self.step_chunks = chunks  # the micro-batches of the current step (fewer or more for a ragged batch)
        self.modules = [StageModule(self, s, checkpoint_stop(checkpoint, chunks)) for s in self.indices]
        self.recorder = StepRecorder() if record else None
        self._shapes: Any = None
        for m in self.modules:
            m.recorder = self.recorder
        self._forward: Callable[[int], Any] = lambda i: None  # the model's code on micro-batch i, set per step
        self._losses: list[Tensor] = []
        self._whole: Any = None  # a whole step's last-stage outputs (lightning_accel.pipeline.whole_step), in its forward phase
        # what a stage of this rank raised in this step, and whether a peer did (lightning_accel.pipeline.step_failure)
        key = "lightning_accel/pipeline-error/" + ",".join(str(self._global(r)) for r in range(self.world_size))
        self.failure = StepFailure(key, self._global(self.rank), group if failure_group == "pipeline" else failure_group, self.device)
        self._by_shape: dict[Any, Any] = {}  # shape key -> schedule, each with stages of their own
        self.meter: StageMeter | None = None  # set while schedule="auto" measures (lightning_accel.pipeline.schedule_tuner)
        self.schedule: Any = self._build_schedule(chunks)
        self._trainable = self._requires_grad()

    def restore(self) -> None:
        """Take the stage boundaries off the blocks: their forwards are the model's own again.

        A strategy that drops this pipeline calls it, or the next pipeline built on the same
        model wraps the old boundaries once more (nested pass-throughs, one per fit).
        """
        self.boundaries.restore()
        self.batch_norm.detach()
        if self.router is not None:
            self.router.remove()

    def _stage_range(self, stage: int) -> range:
        start = sum(self.balance[:stage])
        return range(start, start + self.balance[stage])

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that runs ``stage`` (:func:`lightning_accel.pipeline.schedule.stage_rank`)."""
        return stage_rank(stage, self.world_size, self.schedule_name)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    @property
    def holds_first(self) -> bool:
        return 0 in self.indices

    @property
    def holds_last(self) -> bool:
        return len(self.balance) - 1 in self.indices

    def parameters(self) -> list[nn.Parameter]:
        """What this rank trains: its stages' blocks' parameters, then everything outside the blocks."""
        return [*(p for m in self.modules for p in m.parameters()), *self.shared_params]

    def microbatches(self, size: int) -> int:
        """The equal micro-batches a training batch of ``size`` runs in: ``chunks``, or for a batch it does not divide
        the count :func:`lightning_accel.pipeline.schedule.equal_microbatches` picks; refuses a size no count fits."""
        count = equal_microbatches(size, self.chunks, self.schedule_name, len(self.balance))
        if count is None:
            raise ValueError(
                f"a training batch of {size} cannot be split into equal micro-batches that schedule "
                f"{self.schedule_name!r} runs on {len(self.balance)} stages; drop_last=True on the DataLoader, or a "
                f"batch size of at least {len(self.balance)}"
            )
        return count

    @property
    def users(self) -> list[tuple[int, ...]]:
        """Per parameter outside the blocks: the pipeline ranks that step it (:class:`SharedParams`)."""
        return self.shared.users

    @property
    def summed_bytes(self) -> int:
        """Gradient bytes this rank put into sums between a shared weight's users at the last step."""
        return self.shared.summed_bytes

    def begin_step(self) -> None:
        """A step of the user's code begins on every rank of the pipeline: nothing has failed yet."""
        self.failure.start()

    def train_step(
        self, forward: Callable[[int], Tensor], shape: Any = None, chunks: int | None = None, failed: Exception | None = None,
    ) -> Tensor | None:
        """Forward and backward of one batch in ``chunks`` micro-batches (default: the pipeline's; a ragged batch's
        count from :meth:`microbatches`); every rank of the pipeline calls it.

        ``forward(i)`` runs the model's own code on micro-batch ``i`` (the same batch on every
        rank) and returns that micro-batch's loss (on the last stage's rank; the others stop
        at their stage's end). ``shape``: a hashable key, equal on every rank, that changes
        when the batch shapes do; a new key gets a schedule of its own (stages fix their
        activation shapes at their first step). Without it, a batch shaped unlike the first
        one is refused. ``failed``: what this rank's step raised before the schedule: the schedule runs on stand-ins and
        every rank raises it. Returns the mean of the micro-batch losses on the last stage's rank.
        """
        self.failure.start()
        if failed is not None:
            self.failure.record(failed, self.indices[0], backward=False)
        schedule, chunks = self._ready(forward, shape, chunks)
        index = torch.arange(chunks, device=self.device)
        try:
            schedule.step(
                *((index,) if self.holds_first else ()),
                target=index if self.holds_last else None,
                losses=[] if self.holds_last else None,
            )
        except Exception as err:  # noqa: BLE001  # a transport error (a stage's own is kept by self.failure): name the ranks
            raise self._exchange_error("step", err) from err
        finally:
            self._forward = lambda i: None
        self.settle()
        self.batch_norm.commit()  # deferred: the whole batch's statistics, once
        self.shared.sum_gradients()
        losses = self._losses[-chunks:]
        return torch.stack(losses).mean() if self.holds_last and losses else None

    # -- GPipe in two phases: one call of the model inside the user's step (lightning_accel.pipeline.whole_step)

    def forward_phase(self, forward: Callable[[int], Any], shape: Any, chunks: int, whole: Any = None) -> Any:
        """Every micro-batch's forward of one call of the model, on every rank of the pipeline (GPipe's first half:
        :class:`~lightning_accel.pipeline.split_gpipe.SplitGPipe`); on the last stage's rank ``whole``
        (:class:`~lightning_accel.pipeline.whole_step.WholeOutputs`) keeps the outputs. A stage's error is raised here on
        every rank. Returns the schedule, for :meth:`backward_phase`; BatchNorm statistics (deferred) are the batch's."""
        schedule, chunks = self._ready(forward, shape, chunks)
        self._whole = whole
        index = torch.arange(chunks, device=self.device)
        try:
            schedule.forward_phase(*((index,) if self.holds_first else ()), target=index if self.holds_last else None,
                                   losses=[] if self.holds_last else None)
        except Exception as err:  # noqa: BLE001
            raise self._exchange_error("step", err) from err
        finally:
            self._whole, self._forward = None, lambda i: None
        self.settle()
        self.batch_norm.commit()  # deferred: this call's whole batch's statistics, once
        return schedule

    def backward_phase(self, schedule: Any, after: Callable[[], None] | None = None) -> None:
        """The second half of :meth:`forward_phase`'s call: every micro-batch's backward (on the last stage's rank from
        the gradients its outputs got), then ``after`` (the backward of the code before the call); every rank raises
        what failed."""
        try:
            schedule.backward_phase(losses=[] if self.holds_last else None)
        except Exception as err:  # noqa: BLE001
            raise self._exchange_error("step", err) from err
        if after is not None and not self.failure.stopped():
            try:
                after()
            except Exception as err:  # noqa: BLE001  # the step's own backward (detect_anomaly): every rank raises it
                self.failure.record(err, self.indices[0], backward=True)
        self.settle()

    def record_failure(self, err: Exception, backward: bool) -> None:
        """An error of the step's own code on this rank: the rest of the step runs on stand-ins and every rank raises it
        at the next :meth:`settle`."""
        self.failure.record(err, self.indices[-1], backward=backward)

    def settle(self) -> None:
        """Every rank of the pipeline: raise what a rank's stage or step raised since the step began (a collective)."""
        failed = self.failure.settle()
        if failed is not None:
            # its shapes may be stand-ins' (a failure in the first step's shape inference): fresh stages next time
            self._trainable, self._by_shape = self._requires_grad(), {}
            self.schedule = self._build_schedule(self.chunks)
            raise failed from None

    def step(self, inputs: Any, target: Any = None, shape: Any = None) -> Tensor | None:
        """:meth:`train_step` of ``loss_fn(net(inputs_i), target_i)`` over the micro-batches; every rank passes the batch
        (``target`` is only read on the last stage's rank)."""
        if self.loss_fn is None:
            raise ValueError("step() needs the loss_fn given to RankPipeline; or call train_step(forward)")
        chunks = self.microbatches(batch_size(inputs))
        shapes = tuple(tuple(t.shape) for t in tensors_in((inputs, target)))
        if shape is None:
            if self._shapes is None:
                self._shapes = shapes
            elif shapes != self._shapes:
                raise ValueError(
                    f"batch shapes (inputs, target) {shapes} differ from the first step's {self._shapes}; the stages "
                    "fixed their activation shapes at the first step and every rank must send the same; "
                    "drop_last=True on the DataLoader, and pad or crop inputs to one shape"
                )
        xs = scatter(map_tensors(inputs, lambda t: t.to(self.device)), chunks)
        ys = scatter(map_tensors(target, lambda t: t.to(self.device)), chunks) if target is not None else [None] * chunks
        loss_fn = self.loss_fn
        return self.train_step(lambda i: loss_fn(self.net(xs[i]), ys[i]), shapes if shape is None else shape, chunks)

    def _exchange_error(self, what: str, err: Exception) -> RuntimeError:
        """One error naming this rank, its stages and its neighbours (global ranks: what the other ranks' logs name);
        where another rank's stage raised, the error names that rank and what it raised."""
        peer = peer_said(self.failure.key, wait=3.0)
        if peer is not None:
            return RuntimeError(
                f"pipeline {what} stopped on rank {self._global(self.rank)} (stages {self.indices}): {peer['line']}; its "
                "log has the traceback"
            )
        near = sorted({r for r in (self.rank - 1, self.rank + 1) if 0 <= r < self.world_size})
        neighbours = [self._global(r) for r in near]
        return RuntimeError(
            f"pipeline {what} failed on rank {self._global(self.rank)} (stages {self.indices}) while exchanging with "
            f"rank(s) {neighbours}: {type(err).__name__}: {err}; look in the neighbouring ranks' logs for the first error "
            "(one probably died or timed out)"
        )

    def evaluate(self, size: int, run: Callable[[int | None], Any], whole_on_last: bool = True,
                 failed: Exception | None = None) -> Any:
        """Evaluation of a batch of ``size`` samples (every rank of the pipeline calls it), no gradients.

        ``run(i)`` runs the model's own code on micro-batch ``i`` of the batch split by
        ``torch.tensor_split`` into :meth:`eval_chunks` pieces; ``run(None)`` on the whole batch.
        The micro-batches stream through the stages (:func:`lightning_accel.pipeline.evaluation.stream_evaluate`).
        The last stage's rank concatenates what reached it and runs ``run(None)`` once, on the whole
        batch (so the user's step sees the batch it was given); returns that there, ``None``
        elsewhere. ``whole_on_last=False``: the last stage runs per micro-batch too and returns
        the micro-batches' outputs concatenated (for a model that treats samples
        independently in eval mode, the whole batch's output). ``failed``: what this rank's step raised before the
        model's call; the batch ends on every rank with it.
        """
        return stream_evaluate(self, size, run, whole_on_last, failed)

    def forward(self, inputs: Any) -> Any:
        """:meth:`evaluate` of ``net(inputs)``: every rank passes the batch; the output on the last stage's rank."""
        inputs = map_tensors(inputs, lambda t: t.to(self.device))
        size = batch_size(inputs)
        parts = scatter(inputs, self.eval_chunks(size))
        return self.evaluate(size, lambda i: self.net(inputs if i is None else parts[i]), whole_on_last=False)

    def eval_chunks(self, size: int) -> int:
        """Micro-batches for an evaluation batch of ``size``: ``min(chunks, size)``, at least 1; but 1 where two ranks
        send each other activations (interleaved on 2 ranks) off the CPU: NCCL runs a pair's sends and receives in
        one stream, in order, and a send waits for its receive, so streaming both ways would deadlock; one
        micro-batch sends and receives in the same order on both ranks (gloo sends in the background: no such limit)."""
        if SCHEDULE_TABLE[self.schedule_name].eval_whole_on_pairs and self.world_size == 2 and self.device.type != "cpu":
            return 1
        return max(1, min(self.chunks, size))

    def events(self) -> list[Event]:
        """This rank's timeline of the last step (``record=True``); gather the ranks' lists for the whole picture."""
        if self.recorder is None:
            raise ValueError("this pipeline records no timeline; build it with record=True")
        return self.recorder.step_events(self.step_chunks)
