"""Evaluation through a multi-process pipeline: micro-batches streamed through the stages, each activation after a header.

Why not the training schedule: evaluation has no backward to interleave, and its batches
may have any size and shape (a smaller last batch, another sequence length), while a
``PipelineStage`` fixes its shapes at its first step. Here :func:`stream_evaluate` splits
the batch into up to ``chunks`` micro-batches (``torch.tensor_split``) and runs them on
GPipe's forward clock (:func:`lightning_accel.pipeline.schedule.clock_cycles`): a rank
runs micro-batch ``i`` while the next runs ``i - 1``, its sends non-blocking (waited for
before it returns), so the ranks compute at once instead of in turn, and a stage holds one
micro-batch's activations, not the whole batch's. Each tensor goes after a small header
(dtype, shape, micro-batch count; :func:`isend_tensor`, :func:`recv_tensor`), so shapes
may change per batch and no rank needs to know the batch size in advance; the last
stage's rank concatenates the outputs in order (a tensor a micro-batch broadcasts over its samples, T5's
position bias, kept once). A mixture of experts' router sums ride beside the activations as in training
(:mod:`lightning_accel.pipeline.router_carry`). Before a batch's first micro-batch each rank sends the next the
block output structures it knows, so a stage puts received tensors back in their block's structure without running
that block on meta, before any training step too. No Lightning here.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_accel.pipeline.microbatch import gather, gather_output
from lightning_accel.pipeline.schedule import clock_cycles

__all__ = ["isend_activation", "isend_tensor", "recv_activation", "recv_tensor", "stream_evaluate"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8]
_MAX_DIMS = 8


def isend_tensor(
    x: Tensor, dst: int, group: dist.ProcessGroup | None, count: int, more: int = 0
) -> list[tuple[dist.Work, Tensor]]:
    """Start sending ``x`` to global rank ``dst``, after a header (dtype, ndim, ``count``, ``more``, shape) so the
    receiver can allocate it and knows how many micro-batches follow (``count``) and how many tensors of this activation
    come after it (``more``). Returns the pending sends: wait on each before returning (the tensors ride along so they
    outlive the transfer); not waiting here lets the next micro-batch compute."""
    if x.ndim > _MAX_DIMS or x.dtype not in _DTYPES:
        raise ValueError(
            f"a stage output of dtype {x.dtype} and {x.ndim} dims cannot cross ranks in evaluation; "
            f"stages must pass one tensor of at most {_MAX_DIMS} dims and a dtype in {_DTYPES}"
        )
    header = torch.zeros(4 + _MAX_DIMS, dtype=torch.int64, device=x.device)
    header[0], header[1], header[2], header[3] = _DTYPES.index(x.dtype), x.ndim, count, more
    header[4 : 4 + x.ndim] = torch.tensor(x.shape, dtype=torch.int64)
    x = x.contiguous()
    return [(dist.isend(header, dst, group=group), header), (dist.isend(x, dst, group=group), x)]


def recv_tensor(src: int, device: torch.device, group: dist.ProcessGroup | None) -> tuple[Tensor, int]:
    """Receive the tensor :func:`isend_tensor` sent from global rank ``src``, and the micro-batch count it sent along."""
    x, count, _ = _recv(src, device, group)
    return x, count


def _recv(src: int, device: torch.device, group: dist.ProcessGroup | None) -> tuple[Tensor, int, int]:
    header = torch.empty(4 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    dtype, ndim, count, more = _DTYPES[int(header[0])], int(header[1]), int(header[2]), int(header[3])
    x = torch.empty(header[4 : 4 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(x, src, group=group)
    return x, count, more


def isend_activation(y: Tensor | tuple[Tensor, ...], dst: int, group: dist.ProcessGroup | None, count: int) -> list[tuple[dist.Work, Tensor]]:
    """:func:`isend_tensor` of a stage's output: one tensor, or each of a tuple's, each header saying how many follow."""
    parts = (y,) if isinstance(y, Tensor) else y
    return [w for k, t in enumerate(parts) for w in isend_tensor(t, dst, group, count, len(parts) - 1 - k)]


def recv_activation(src: int, device: torch.device, group: dist.ProcessGroup | None) -> Tensor | tuple[Tensor, ...]:
    """What :func:`isend_activation` sent: one tensor, or a tuple of them."""
    parts = [_recv(src, device, group)]
    while parts[-1][2]:
        parts.append(_recv(src, device, group))
    return parts[0][0] if len(parts) == 1 else tuple(p[0] for p in parts)


def _structures(pipe: Any) -> Tensor:
    """The block output structures this rank knows (:attr:`StageBoundaries.structures`), pickled into a byte tensor."""
    known = {k: v for k, v in pipe.boundaries.structures.items() if v is not None}
    return torch.frombuffer(bytearray(pickle.dumps(known)), dtype=torch.uint8).to(pipe.device)


def _learn_structures(pipe: Any, sent: Tensor) -> None:
    """Add the structures the previous stage's rank sent (:func:`_structures`) to the ones this rank knows: the block
    that hands this stage its input is then never run on meta for them (an MoE's grouped_mm refuses meta float32),
    even before any training step has carried them with torch's shape metadata."""
    known = pipe.boundaries.structures
    for k, v in pickle.loads(sent.cpu().numpy().tobytes()).items():
        known.setdefault(k, v)


@torch.no_grad()
def stream_evaluate(pipe: Any, size: int, run: Callable[[int | None], Any], whole_on_last: bool = True,
                    failed: Exception | None = None) -> Any:
    """Evaluation of a batch of ``size`` samples on ``pipe`` (a :class:`lightning_accel.pipeline.RankPipeline`; every
    rank of the pipeline calls it), no gradients; see :meth:`RankPipeline.evaluate`. The user's step raising on one rank
    ends the batch on every rank with that error, as in training (:mod:`lightning_accel.pipeline.step_failure`): its
    later micro-batches travel on as one zero, no rank runs the user's code again, and one flag is reduced at the end."""
    count, last = len(pipe.balance), len(pipe.balance) - 1
    m = pipe.eval_chunks(size)
    failure = pipe.failure
    failure.start()
    if failed is not None:  # the step raised before the model's call on this rank (lightning_accel.pipeline.rank_step)
        failure.record(failed, pipe.indices[0], backward=False)
    ready: dict[tuple[int, int], Tensor] = {}  # (stage, micro-batch) -> its input, when this rank already has it
    arrived: list[Tensor] = []  # the last stage's inputs, in micro-batch order
    router = pipe.router if count > 1 else None  # a router loss: each stage's sums ride last (router_carry), as in training
    sums: list[Tensor] = []  # the router sums that reached the last stage, per micro-batch
    try:
        pending: list[tuple[dist.Work, Tensor]] = []  # sends in flight, waited for before returning
        # clock k runs (micro-batch i, stage s) with i + s == k: each rank computes micro-batch i while the next
        # rank computes i - 1; messages between two ranks go in this one order, so blocking receives cannot deadlock
        for cycle in clock_cycles(m, count) if count > 1 else []:
            for i, s in cycle:
                if s not in pipe.indices:
                    continue
                x = None if s == 0 else ready.pop((s, i), None)
                if s > 0 and x is None:
                    source = pipe._global(pipe.stage_rank(s - 1))
                    if i == 0:  # first, what the sender knows of its blocks' output structures
                        _learn_structures(pipe, recv_tensor(source, pipe.device, pipe.group)[0])
                    x = recv_activation(source, pipe.device, pipe.group)
                if failure.stopped():  # the batch failed (here or on a peer): a zero travels on, no user code runs
                    y: Any = torch.zeros(1, device=pipe.device)
                else:
                    carried = None
                    if router is not None and s > 0:
                        *rest, carried = (x,) if isinstance(x, Tensor) else x
                        x = rest[0] if len(rest) == 1 else tuple(rest)
                    if s == last and whole_on_last:
                        arrived.append(x)
                        sums += [carried] if carried is not None else []
                        continue
                    try:
                        with router.micro_batch(carried, s == last, pipe.device) if router is not None else nullcontext() as routed:
                            y = pipe.boundaries.run(s, x, lambda i=i: run(i))
                            if routed is not None and s != last:
                                y = routed.attach(y)
                    except Exception as err:  # the user's step: raised on every rank after the batch
                        failure.record(err, s, backward=False)
                        y = torch.zeros(1, device=pipe.device)
                if s == last:
                    arrived.append(y)
                    continue
                nxt = pipe.stage_rank(s + 1)
                if nxt == pipe.rank:
                    ready[(s + 1, i)] = y
                else:
                    if i == 0:
                        pending += isend_tensor(_structures(pipe), pipe._global(nxt), pipe.group, m)
                    pending += isend_activation(y, pipe._global(nxt), pipe.group, m)
        for work, _ in pending:
            work.wait()
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001  # any transport error: name the ranks, never hang
        raise pipe._exchange_error("evaluation", err) from err
    result = None
    if pipe.holds_last and not failure.stopped():
        try:
            result = _last_stage(pipe, size, m, run, whole_on_last, arrived, sums)
        except Exception as err:  # the user's step on the whole batch
            failure.record(err, last, backward=False)
    failed = failure.settle(pipe.group)  # the pipeline's ranks only: replicas may evaluate different batch counts, as DDP's
    if failed is not None:
        raise failed from None
    return result


def _last_stage(pipe: Any, size: int, m: int, run: Callable[[int | None], Any], whole_on_last: bool, arrived: list[Any],
                sums: list[Tensor]) -> Any:
    """What the last stage returns: its micro-batches' outputs concatenated, or ``run(None)`` on the whole batch."""
    count, last = len(pipe.balance), len(pipe.balance) - 1
    router = pipe.router if count > 1 else None
    if not whole_on_last:
        return gather(arrived) if count > 1 else gather([run(i) for i in range(m)])
    # a tensor the model computes once per micro-batch and broadcasts over its samples (T5's position bias, batch
    # dimension 1) is the same in each: kept once, not concatenated into a batch dimension of the micro-batch count
    sizes = [len(part) for part in torch.arange(size).tensor_split(m)]
    # the earlier stages' router sums are sums over tokens: added over the micro-batches, they are the whole batch's
    with router.micro_batch(sum(sums), True, pipe.device) if router is not None and sums else nullcontext():
        return pipe.boundaries.run(last, gather_output(arrived, sizes)[0] if count > 1 else None, lambda: run(None))
