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
exits within the timeout instead of hanging.

Shapes: a stage fixes its activation shapes at its first step. A batch of another shape
(a smaller last batch) gets stages and a schedule of its own, built on first use and kept
per shape; every rank must agree on the shape, so the caller passes a ``shape`` key that
every rank can compute (the batch's shapes), and without one a new shape is refused.

Data parallel across pipeline replicas (DP x PP): ``world_size = pp * dp`` ranks on a
device mesh of dims ``("pp", "dp")`` (:func:`pipeline_mesh`), ``pp`` outermost: global rank
``pp_rank * dp + dp_rank`` (:func:`mesh_coordinates`). Each replica's ``pp`` ranks form one
pipeline (a :class:`RankPipeline` on the mesh's ``pp`` group); after its backward,
:func:`average_gradients` averages each stage's gradients over the ``dp`` group, the ranks
holding the same stage in the other replicas. Why ``pp`` outermost (as torchtitan and
Megatron order their meshes): the gradient all-reduce moves a whole stage's gradients at every
step, the pipeline only the activations at the stage boundaries, so the ``dp`` ranks are
the adjacent ones (one host's local ranks are consecutive: its fast links), and a pipeline
may cross hosts.

Evaluation micro-batches too: :meth:`RankPipeline.forward` splits the batch into up to
``chunks`` micro-batches (``torch.tensor_split``: any batch size, fewer micro-batches when
the batch is smaller) and streams them through the stages on GPipe's forward clock
(:func:`lightning_accel.pipeline.schedule.clock_cycles`): a rank runs micro-batch ``i``
while the next runs ``i - 1``, its sends non-blocking (waited for before it returns), so
the ranks compute at once instead of in turn, and a stage holds one micro-batch's
activations, not the whole batch's. Each tensor goes after a small header (dtype, shape,
micro-batch count), so shapes may change per batch and no rank needs to know the batch
size in advance; the last stage's rank concatenates the outputs in order. One exception:
``interleaved_1f1b`` on 2 ranks off the CPU evaluates the batch whole, since there the two
ranks send each other activations and NCCL would deadlock on crossing sends (see
:meth:`RankPipeline._eval_chunks`).

:class:`lightning_accel.strategies.gpipe_distributed.DistributedGPipeStrategy` drives it
inside a Lightning ``Trainer``; ``lightning-accel bench pipeline`` and
``tests/pipeline/test_distributed.py`` drive it directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
import torch.utils.checkpoint

from lightning_accel.models.blocks import require_block_network
from lightning_accel.pipeline.microbatch import gather
from lightning_accel.pipeline.local import checkpoint_stop
from lightning_accel.pipeline.partition import check_balance
from lightning_accel.pipeline.schedule import check_schedule, clock_cycles
from lightning_accel.pipeline.timeline import Event

__all__ = ["RankPipeline", "StageModule", "average_gradients", "mesh_coordinates", "pipeline_mesh", "stage_indices"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8]
_MAX_DIMS = 8


def _isend(x: Tensor, dst: int, group: dist.ProcessGroup | None, count: int) -> list[tuple[dist.Work, Tensor]]:
    """Start sending ``x`` to global rank ``dst``, after a header (dtype, ndim, ``count``, shape) so the receiver can
    allocate it and knows how many micro-batches follow. Returns the pending sends: wait on each before returning
    (the tensors ride along so they outlive the transfer); not waiting here lets the next micro-batch compute."""
    if x.ndim > _MAX_DIMS or x.dtype not in _DTYPES:
        raise ValueError(
            f"a stage output of dtype {x.dtype} and {x.ndim} dims cannot cross ranks in evaluation; "
            f"stages must pass one tensor of at most {_MAX_DIMS} dims and a dtype in {_DTYPES}"
        )
    header = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64, device=x.device)
    header[0], header[1], header[2] = _DTYPES.index(x.dtype), x.ndim, count
    header[3 : 3 + x.ndim] = torch.tensor(x.shape, dtype=torch.int64)
    x = x.contiguous()
    return [(dist.isend(header, dst, group=group), header), (dist.isend(x, dst, group=group), x)]


def _recv(src: int, device: torch.device, group: dist.ProcessGroup | None) -> tuple[Tensor, int]:
    """Receive the tensor :func:`_isend` sent from global rank ``src``, and the micro-batch count it sent along."""
    header = torch.empty(3 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    dtype, ndim, count = _DTYPES[int(header[0])], int(header[1]), int(header[2])
    x = torch.empty(header[3 : 3 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(x, src, group=group)
    return x, count


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
    name in the user's network so checkpoints keep those names. ``remat_stop``: the
    micro-batches of a step with index below it are re-materialized (one
    ``torch.utils.checkpoint`` around the stage: only the stage's input is kept, and
    backward runs the stage's forward again), counted by :attr:`microbatch`, which
    :class:`RankPipeline` resets before each step.
    """

    def __init__(self, net: nn.Module, balance: Sequence[int], stage: int, remat_stop: int = 0) -> None:
        super().__init__()
        self.remat_stop, self.microbatch = remat_stop, 0
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
        if x.device.type == "meta":  # the stage's shape inference, not a micro-batch
            return self._run(x)
        remat = self.microbatch < self.remat_stop and torch.is_grad_enabled()
        self.microbatch += 1
        if recorder is None:
            return self._rematerialized(x) if remat else self._run(x)
        index, start = recorder.next_forward(self.stage), time.time()
        x = self.pre(x) if self.pre is not None else x
        # backward of this micro-batch ends when its gradient reaches the stage input (after pre on stage 0)
        x = _Mark.apply(x, lambda: recorder.end_backward(self.stage, index)) if x.requires_grad else x
        out = self._rematerialized(x, pre=False) if remat else self._run(x, pre=False)
        out = _Mark.apply(out, lambda: recorder.start_backward(self.stage, index))
        recorder.events.append(Event(self.stage, "F", index, start, time.time()))
        return out

    def _rematerialized(self, x: Tensor, pre: bool = True) -> Tensor:
        """The stage under one checkpoint: its input is all it keeps; the RNG is replayed, so dropout recomputes alike."""
        return torch.utils.checkpoint.checkpoint(self._run, x, pre, use_reentrant=False)

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


def mesh_coordinates(rank: int, world_size: int, pp: int) -> tuple[int, int]:
    """``(pp_rank, dp_rank)`` of global rank ``rank`` on the ``("pp", "dp")`` mesh of ``world_size`` ranks, ``pp`` per pipeline."""
    if pp < 1 or world_size % pp:
        raise ValueError(
            f"world size {world_size} is not a multiple of {pp} pipeline ranks; HINT: run a multiple of {pp} processes"
        )
    dp = world_size // pp
    return rank // dp, rank % dp


def pipeline_mesh(device_type: str, world_size: int, pp: int, timeout: timedelta | None = None) -> DeviceMesh:
    """The ``("pp", "dp")`` device mesh of the default process group: ``pp`` ranks per pipeline, ``world_size // pp`` replicas.

    ``timeout``: how long the mesh's groups wait for a rank (gloo and nccl). Without it they get
    torch's default (30 minutes for gloo), not the default group's: a hung peer on a pipeline or
    replica group would outwait the timeout the user set.
    """
    mesh_coordinates(0, world_size, pp)  # the check
    options = None if timeout is None else _group_options(dist.get_backend(), timeout)
    override = None if options is None else {"pp": options, "dp": options}
    return init_device_mesh(device_type, (pp, world_size // pp), mesh_dim_names=("pp", "dp"), backend_override=override)


def _group_options(backend: str, timeout: timedelta) -> Any:
    """Process-group options carrying ``timeout`` for ``backend`` (None for a backend without such options)."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    options._timeout = timeout
    return options


@torch.no_grad()
def average_gradients(params: Sequence[Tensor], group: dist.ProcessGroup | None, bucket_bytes: int = 25 * 2**20) -> None:
    """Replace each gradient by its mean over ``group`` (the data-parallel replicas), as ``DistributedDataParallel`` does.

    Gradients go in flat buckets of one dtype and device, at most ``bucket_bytes`` each (one
    all-reduce per bucket, not per tensor). Every rank of ``group`` must pass the same
    parameters, with a gradient on the same ones (the same stage, in every replica).
    """
    size = dist.get_world_size(group)
    if size == 1:
        return
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[Tensor], int]] = {}
    buckets: list[list[Tensor]] = []
    for g in (p.grad for p in params if p.grad is not None):
        bucket, nbytes = open_buckets.get((g.dtype, g.device), ([], 0))
        if not bucket or nbytes + g.nbytes > bucket_bytes:
            bucket, nbytes = [], 0
            buckets.append(bucket)
        bucket.append(g)
        open_buckets[(g.dtype, g.device)] = (bucket, nbytes + g.nbytes)
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)  # SUM, then divide: gloo has no AVG
        flat.div_(size)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


class RankPipeline:
    """This rank's stages of ``net`` and the schedule that drives them.

    ``balance`` has one entry per stage: ``world_size`` stages, or ``2 * world_size`` for
    ``interleaved_1f1b``. ``loss_fn(output, target)`` is the per-micro-batch loss: a mean
    over the micro-batch (``scale_grads=True``: gradients are divided by ``chunks``, so they
    equal those of the batch mean), or a sum (``scale_grads=False``). ``group``: the ranks
    of this pipeline (the mesh's ``pp`` group; ``None``: every rank), whose size is the
    ``world_size`` above. ``checkpoint``: which micro-batches each stage re-materializes,
    ``"always"``, ``"except_last"`` (the last one's backward follows its forward at once on
    the last stage, so keeping it costs little) or ``"never"`` (torch's schedules keep every
    micro-batch's activations in flight: all M with ``gpipe``, up to S with ``1f1b``).
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
        checkpoint: str = "never",
    ) -> None:
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
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
        stop = checkpoint_stop(checkpoint, chunks)
        self.modules = [StageModule(net, self.balance, s, stop).to(self.device) for s in self.indices]
        self.recorder = _Recorder() if record else None
        self._shapes: tuple[tuple[int, ...] | None, tuple[int, ...] | None] | None = None
        for m in self.modules:
            m.recorder = self.recorder
        self.loss_fn, self._inferring = loss_fn, False
        self._schedule_kwargs = {"n_microbatches": chunks, "loss_fn": self._loss, "scale_grads": scale_grads}
        self._by_shape: dict[Any, Any] = {}  # shape key -> schedule, each with stages of their own
        self.schedule: Any = self._build_schedule()

    def _loss(self, output: Tensor, target: Tensor) -> Tensor:
        if self._inferring and torch.is_floating_point(output):
            # torch's shape inference: it runs the loss on micro-batch 0 once more, only for the shapes of the
            # gradients it sends back; a stand-in keeps the user's loss (and its side effects) to one call per micro-batch
            return output.sum()
        return self.loss_fn(output, target)

    def _build_schedule(self) -> Any:
        """Fresh stages over this rank's modules, and the schedule driving them (stages fix their shapes at their first step)."""
        stages = [
            PipelineStage(m, s, len(self.balance), self.device, group=self.group)
            for m, s in zip(self.modules, self.indices)
        ]
        if self.schedule_name == "gpipe":
            schedule: Any = ScheduleGPipe(stages[0], **self._schedule_kwargs)
        elif self.schedule_name == "1f1b":
            schedule = Schedule1F1B(stages[0], **self._schedule_kwargs)
        else:
            schedule = ScheduleInterleaved1F1B(stages, **self._schedule_kwargs)
        initialize = getattr(schedule, "_initialize_pp_stages", None)  # torch's metadata inference (torch 2.13)
        if initialize is not None:

            def inferring(*args: Any, **kwargs: Any) -> Any:
                self._inferring = True
                try:
                    return initialize(*args, **kwargs)
                finally:
                    self._inferring = False
                    self._restart_microbatches()  # the inference's forwards were not micro-batches of the step

            schedule._initialize_pp_stages = inferring
        return schedule

    def _restart_microbatches(self) -> None:
        """The next forward of each stage is micro-batch 0 (what re-materialization counts from)."""
        for m in self.modules:
            m.microbatch = 0

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    @property
    def holds_first(self) -> bool:
        return 0 in self.indices

    @property
    def holds_last(self) -> bool:
        return len(self.balance) - 1 in self.indices

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def step(self, inputs: Tensor | None = None, target: Tensor | None = None, shape: Any = None) -> Tensor | None:
        """Forward and backward of one batch; returns the batch loss (mean of the micro-batch losses) on the last stage's rank.

        ``shape``: a hashable key, equal on every rank, that changes when the batch shapes do
        (the batch's tensor shapes); a new key gets a schedule of its own. Without it, a batch
        shaped unlike the first one is refused.
        """
        if inputs is not None and inputs.size(0) % self.chunks:
            raise ValueError(
                f"the batch size {inputs.size(0)} is not divisible by chunks={self.chunks}; the multi-process "
                "pipeline needs equal micro-batches for its loss to match plain training (drop_last=True and a "
                "batch size that is a multiple of chunks)"
            )
        shapes = (None if inputs is None else tuple(inputs.shape), None if target is None else tuple(target.shape))
        if shape is not None:
            if not self._by_shape:
                self._by_shape[shape] = self.schedule  # the first shape keeps the schedule built in __init__
            elif shape not in self._by_shape:
                self._by_shape[shape] = self._build_schedule()
            schedule = self._by_shape[shape]
        elif self._shapes is None:
            self._shapes, schedule = shapes, self.schedule
        elif shapes != self._shapes:
            raise ValueError(
                f"batch shapes (inputs, target) {shapes} differ from the first step's {self._shapes}; the stages fixed "
                "their activation shapes at the first step and every rank must send the same. HINT: drop_last=True on "
                "the DataLoader, and pad or crop inputs to one shape"
            )
        else:
            schedule = self.schedule
        losses: list[Tensor] = []
        if self.recorder is not None:
            self.recorder.reset()
        self._restart_microbatches()
        args = (inputs.to(self.device),) if self.holds_first and inputs is not None else ()
        try:
            schedule.step(
                *args,
                target=target.to(self.device) if self.holds_last and target is not None else None,
                losses=losses if self.holds_last else None,
            )
        except Exception as err:  # noqa: BLE001  # any transport error: name the ranks, never hang
            raise self._exchange_error("step", err) from err
        return torch.stack(losses).mean() if losses else None

    def _exchange_error(self, what: str, err: Exception) -> RuntimeError:
        """One error naming this rank, its stages and its neighbours (global ranks: what the other ranks' logs name)."""
        near = sorted({r for r in (self.rank - 1, self.rank + 1) if 0 <= r < self.world_size})
        neighbours = [self._global(r) for r in near]
        return RuntimeError(
            f"pipeline {what} failed on rank {self._global(self.rank)} (stages {self.indices}) while exchanging with "
            f"rank(s) {neighbours}: {type(err).__name__}: {err}. HINT: a neighbouring rank probably died or timed "
            "out; its own log has the first error"
        )

    @torch.no_grad()
    def forward(self, inputs: Tensor | None = None) -> Any:
        """Evaluation: the batch in up to ``chunks`` micro-batches streamed through the stages, no gradients.

        ``inputs`` on the first stage's rank; returns the last stage's outputs of the
        micro-batches, concatenated in order, on its rank (``None`` elsewhere). The split is
        ``torch.tensor_split``'s into ``min(chunks, batch size)`` pieces, so any batch size works
        and the result is the whole batch's output (for a model that treats samples
        independently in eval mode, as ``model.eval()`` makes BatchNorm and dropout).
        """
        count = len(self.balance)
        ready: dict[tuple[int, int], Tensor] = {}  # (stage, micro-batch) -> its input, when this rank already has it
        try:
            if self.holds_first:
                if inputs is None:
                    raise ValueError(f"rank {self._global(self.rank)} runs the first stage: pass forward(inputs)")
                x = inputs.to(self.device)
                parts = torch.tensor_split(x, self._eval_chunks(x.size(0)))
                ready = {(0, i): part for i, part in enumerate(parts)}
                m = len(parts)
            else:  # this rank's first op is micro-batch 0 of its first stage: its header says how many follow
                first = self.indices[0]
                ready[(first, 0)], m = _recv(self._global((first - 1) % self.world_size), self.device, self.group)
            outputs: list[Any] = []
            pending: list[tuple[dist.Work, Tensor]] = []  # sends in flight, waited for before returning
            # clock k runs (micro-batch i, stage s) with i + s == k: each rank computes micro-batch i while the next
            # rank computes i - 1; messages between two ranks go in this one order, so blocking receives cannot deadlock
            for cycle in clock_cycles(m, count):
                for i, s in cycle:
                    if s not in self.indices:
                        continue
                    x = ready.pop((s, i), None)
                    if x is None:
                        x, _ = _recv(self._global((s - 1) % self.world_size), self.device, self.group)
                    y = self.modules[self.indices.index(s)]._run(x)  # _run: not recorded on the timeline
                    nxt = (s + 1) % self.world_size
                    if s == count - 1:
                        outputs.append(y)
                    elif nxt == self.rank:
                        ready[(s + 1, i)] = y
                    else:
                        pending += _isend(y, self._global(nxt), self.group, m)
            for work, _ in pending:
                work.wait()
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001  # any transport error: name the ranks, never hang
            raise self._exchange_error("evaluation", err) from err
        return gather(outputs) if self.holds_last else None

    def _eval_chunks(self, size: int) -> int:
        """Micro-batches for an evaluation batch of ``size``: ``min(chunks, size)``, at least 1; but 1 where two ranks
        send each other activations (interleaved on 2 ranks) off the CPU: NCCL runs a pair's sends and receives in
        one stream, in order, and a send waits for its receive, so streaming both ways would deadlock; one
        micro-batch sends and receives in the same order on both ranks (gloo sends in the background: no such limit)."""
        if self.schedule_name == "interleaved_1f1b" and self.world_size == 2 and self.device.type != "cpu":
            return 1
        return max(1, min(self.chunks, size))

    def events(self) -> list[Event]:
        """This rank's timeline of the last step (``record=True``); gather the ranks' lists for the whole picture."""
        if self.recorder is None:
            raise ValueError("this pipeline records no timeline; build it with record=True")
        return self.recorder.step_events(self.chunks)
