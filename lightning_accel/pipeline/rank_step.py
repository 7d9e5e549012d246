"""One step of the user's code on a pipeline rank: training in micro-batches, evaluation streamed, the last rank's result.

Every rank of a pipeline runs the user's step (a LightningModule's ``training_step``,
``validation_step``, ...) with the model's own forward, which its stage boundaries cut
short on ranks that do not hold the last stage. Training
(:func:`train_step`): where the model's blocks run inside a module's call (:mod:`.whole_step`), every rank runs the
step once, up to that call, whose arguments the schedule's micro-batches split, and under GPipe the last stage's rank
runs it to its end on the whole batch's output; otherwise (other schedules on the last stage's rank, or blocks the
step calls itself) the step runs once per micro-batch inside the schedule, its logs are
recorded per micro-batch, its loss (scaled by a ``GradScaler`` when there is one) drives
the schedule's backward, and the gradients are set aside for the trainer's own backward;
the last rank reduces the loss and the logs over the micro-batches like plain training's
batch. Evaluation (:func:`eval_step`): the batch streams through the stages, the last rank
runs the step once on the whole batch, and what it logged (and returned) reaches every
rank. Either way, what the step appends to the module's lists (Lightning 2's epoch-end
outputs) is the last rank's, one item per batch, on every rank
(:mod:`lightning_accel.pipeline.kept_outputs`). The step is any callable on a module with a
``log`` method. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_accel.pipeline.distributed import RankPipeline
from lightning_accel.pipeline.gradients import set_aside
from lightning_accel.pipeline.kept_outputs import Appended, KeptLists
from lightning_accel.pipeline.microbatch import batch_size, map_tensors, scatter
from lightning_accel.pipeline.reduction import reduce_outputs
from lightning_accel.pipeline.step_report import EvalLogs, MicroBatchLogs, StepResult, silenced
from lightning_accel.pipeline.whole_step import EntryCall, Left, WholeOutputs

__all__ = ["eval_step", "kept_on_cpu", "train_step"]


def train_step(
    pipe: RankPipeline,
    module: nn.Module,
    step: Callable[[Any], Any],
    batch: Any,
    shape: Any,
    loss_reduction: str,
    scaler: Any = None,
    constant_sizes: set[str] | None = None,
) -> tuple[StepResult | None, list[Tensor | None], KeptLists, Appended]:
    """``step(micro_batch)`` over the equal micro-batches of ``batch`` (:meth:`RankPipeline.microbatches`) through the schedule (``shape``: the
    batch's shapes, equal on every rank). Returns the step's result on the last stage's rank (None elsewhere), this
    rank's gradients of ``pipe.parameters()``, set aside (the parameters keep the gradients they had before), and the
    module's lists around the step with, on the last stage's rank, what the whole batch's step appends to them (to send
    to the others; every rank then calls :meth:`KeptLists.settle`). ``constant_sizes``: the logged names whose
    ``batch_size`` is a constant, kept by the caller across steps (:func:`~lightning_accel.pipeline.step_report.reduce_logs`)."""
    if pipe.entry is not None and (not pipe.holds_last or pipe.schedule_name == "gpipe"):
        return _whole_step(pipe, module, step, batch, shape, loss_reduction, scaler, constant_sizes)
    chunks = pipe.microbatches(batch_size(batch))  # pipe.chunks, or equal micro-batches of a ragged batch
    micro = scatter(batch, chunks)
    sizes = [batch_size(mb) for mb in micro]
    outputs: list[Any] = [None] * chunks
    logs = MicroBatchLogs(chunks)
    kept = KeptLists(module)
    if scaler is not None:
        scaler.scale(torch.zeros((), device=pipe.device))  # ranks without the loss need the scale too

    def forward(i: int) -> Tensor:
        """The user's step on micro-batch ``i``: every rank runs it, up to its stage's end."""
        with logs.recording(module, i), kept.recording():
            out = step(micro[i])
        if out is None:
            raise ValueError("training_step returned None (skip the batch), but the pipeline has already run it")
        outputs[i] = out
        loss = out["loss"] if isinstance(out, Mapping) else out
        logs.mark_loss(i, loss)
        return scaler.scale(loss) if scaler is not None else loss  # the schedule's backward: scaled gradients

    with set_aside(pipe.parameters()) as grads:
        pipe.train_step(forward, shape=shape, chunks=chunks)  # a smaller last batch gets a schedule of its own
    if not pipe.holds_last:
        return None, grads, kept, {}
    reduced = reduce_outputs(outputs, sizes, loss_reduction)
    loss = reduced["loss"] if isinstance(reduced, Mapping) else reduced
    result = (loss.detach().cpu(), logs.reduced(sizes, loss_reduction, constant_sizes), isinstance(reduced, Mapping))
    return result, grads, kept, kept.merged(sizes, loss_reduction)


def _whole_step(
    pipe: RankPipeline,
    module: nn.Module,
    step: Callable[[Any], Any],
    batch: Any,
    shape: Any,
    loss_reduction: str,
    scaler: Any,
    constant_sizes: set[str] | None,
) -> tuple[StepResult | None, list[Tensor | None], KeptLists, Appended]:
    """:func:`train_step` with the user's step run once on the whole batch (:mod:`lightning_accel.pipeline.whole_step`):
    on a rank without the last stage up to the entry's call, whose arguments the schedule's micro-batches split; on the
    last stage's rank (GPipe) to its end, the entry's call running every forward and the step's loss every backward."""
    assert pipe.entry is not None
    call = EntryCall(*pipe.entry)
    logs = MicroBatchLogs(1)
    kept = KeptLists(module)
    if scaler is not None:
        scaler.scale(torch.zeros((), device=pipe.device))  # ranks without the loss need the scale too
    size = [batch_size(batch)]

    def chunks_for(n: int) -> int:
        size[0] = n
        return pipe.microbatches(n)

    with set_aside(pipe.parameters()) as grads:
        if not pipe.holds_last:
            with logs.recording(module, 0):
                failed = call.capture(step, batch, chunks_for, "training_step")
            chunks = len(call.parts) if failed is None else pipe.microbatches(size[0])
            pipe.train_step(call.micro, shape=shape, chunks=chunks, failed=failed, after=call.backward_before)
            return None, grads, kept, {}
        whole: WholeOutputs | None = None
        transport: list[Exception] = []  # the exchange itself failed (a peer died): raised as it is, nothing more runs

        def drive(args: tuple, kwargs: dict[str, Any]) -> Any:
            nonlocal whole
            chunks = call.split(args, kwargs, chunks_for)
            whole = WholeOutputs(chunks)
            try:
                pipe.forward_phase(call.micro, whole, shape, chunks)
            except Exception as err:  # noqa: BLE001
                transport.append(err)
                raise Left() from None
            if pipe.failure.stopped():
                raise Left()  # a forward failed (here or on a peer): the step does not go on
            return whole.joined(call.sizes)

        out: Any = None
        failed: Exception | None = None
        with logs.recording(module, 0), kept.recording(), call.driving(drive):
            try:
                out = step(batch)
            except Left:
                pass
            except Exception as err:  # noqa: BLE001
                failed = err
        if transport:
            raise transport[0]
        if whole is None:  # no forward ran (the step failed before the model's call, or never made it): on stand-ins
            pipe.train_step(lambda i: None, shape=shape, chunks=pipe.microbatches(size[0]),
                            failed=failed or call.not_called("training_step"))
            raise AssertionError("unreachable: train_step raises what failed")
        if failed is not None:  # the step's code after the model's call
            pipe.record_failure(failed, backward=False)
        if not pipe.failure.stopped():
            if out is None:
                pipe.record_failure(ValueError("training_step returned None (skip the batch), but the pipeline has already run its "
                                               "forward; skip a batch before calling the model"), backward=False)
            else:
                loss = out["loss"] if isinstance(out, Mapping) else out
                logs.mark_loss(0, loss)
                try:
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                except Exception as err:  # noqa: BLE001  # the step's own backward (detect_anomaly's NaN gradient)
                    pipe.record_failure(err, backward=True)
        pipe.backward_phase(after=call.backward_before)  # raises, on every rank, what failed
    reduced = reduce_outputs([out], size, loss_reduction)
    loss = reduced["loss"] if isinstance(reduced, Mapping) else reduced
    result = (loss.detach().cpu(), logs.reduced(size, loss_reduction, constant_sizes), isinstance(reduced, Mapping))
    return result, grads, kept, kept.merged(size, loss_reduction)


def kept_on_cpu(appended: Appended) -> Appended:
    """What crosses to the other ranks: detached CPU copies."""
    return {name: [map_tensors(item, lambda t: t.detach().cpu()) for item in items] for name, items in appended.items()}


def eval_step(
    pipe: RankPipeline,
    module: nn.Module,
    hook: str,
    batch: Any,
    step: Callable[[Any], Any],
    src: int,
    device: torch.device,
) -> Any:
    """``step`` (the module's ``hook``) on ``batch`` streamed through the stages; on the last stage's rank (global rank
    ``src``) once on the whole batch, its logs replayed on every other rank. Returns the step's output on every rank (as
    Lightning hands it to ``on_validation_batch_end`` and the like there): the last rank's, elsewhere a copy of it, its
    tensors on ``device``."""
    size = batch_size(batch)
    parts = scatter(batch, pipe.eval_chunks(size))
    logs = EvalLogs(module, hook)
    kept = KeptLists(module)

    def run(i: int | None) -> Any:
        # i None: the whole batch on the last stage, where the step's logging (and what it appends) counts
        if i is None:
            with logs.recording(), kept.recording():
                return step(batch)
        if split is not None:
            return split.micro(i)
        with silenced(module):
            return step(parts[i])

    failed: Exception | None = None
    split: EntryCall | None = None  # the model's call of the step run once, split into the streamed micro-batches
    if pipe.entry is not None and not pipe.holds_last:  # the step once, up to the model's call, whose micro-batches stream
        call = EntryCall(*pipe.entry)
        with silenced(module):
            failed = call.capture(step, batch, lambda n: len(parts), hook)
        split = call if failed is None else None
    out = pipe.evaluate(size, run, failed=failed)
    sent = map_tensors(out, lambda t: t.detach().cpu()) if pipe.holds_last else None
    appended = kept.merged([size], "mean") if pipe.holds_last else {}
    records, output, appended = logs.exchange(sent, src, pipe.group, kept_on_cpu(appended))
    kept.settle(appended, device)
    if pipe.holds_last:
        return out
    EvalLogs.replay(module, records, device)
    return map_tensors(output, lambda t: t.to(device))
