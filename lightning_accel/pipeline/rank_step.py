"""The user's step once per micro-batch on the last stage's rank: training under 1F1B and the other schedules, and
evaluation of a model whose LightningModule calls the blocks itself.

Under a schedule whose backwards start before the last forward (1F1B, interleaved, zero-bubble), the whole batch's
output never exists on one rank, so the user's step cannot run once on it (:mod:`.whole_step` does that under GPipe).
Here (:func:`train_step`) every rank runs the step once per micro-batch inside the schedule, the model's own forward cut
short after the rank's stages on every rank but the last; the last rank's runs record their ``self.log`` calls
(:class:`~lightning_accel.pipeline.step_report.MicroBatchLogs`), their loss (scaled by a ``GradScaler`` when there is
one) drives the schedule's backward, and the gradients are set aside for the trainer's own backward. The last rank
reduces the loss and the logs over the micro-batches like plain training's batch and sends them to the others
(:func:`~lightning_accel.pipeline.step_report.broadcast_step_result`); what the step appends to the module's lists
(Lightning 2's epoch-end outputs) is merged into one item per batch and sent too
(:mod:`lightning_accel.pipeline.kept_outputs`). Evaluation (:func:`eval_step`), for a model without an entry module
(the LightningModule holds the blocks itself): the batch streams through the stages, the last rank runs the step once on
the whole batch, and what it logged and returned reaches every rank. The step is any callable on a module with a ``log``
method. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_accel.pipeline.distributed import RankPipeline
from lightning_accel.pipeline.gradients import set_aside
from lightning_accel.pipeline.kept_outputs import Appended, KeptLists, merge_items
from lightning_accel.pipeline.microbatch import batch_size, map_tensors, scatter
from lightning_accel.pipeline.reduction import reduce_outputs
from lightning_accel.pipeline.step_report import EvalLogs, MicroBatchLogs, StepResult, silenced

__all__ = ["RETURNED", "eval_step", "kept_on_cpu", "train_step"]

RETURNED = "returned"  # in a record's options: a key of the dict training_step returned, not a logged value


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
    to the others; every rank then calls :meth:`KeptLists.settle`). A returned dict's other keys are in the result's
    records, marked :data:`RETURNED` in their options. ``constant_sizes``: the logged names whose
    ``batch_size`` is a constant, kept by the caller across steps (:func:`~lightning_accel.pipeline.step_report.reduce_logs`)."""
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
    records = logs.reduced(sizes, loss_reduction, constant_sizes)
    # a returned dict's other keys ride with the logs, marked (numbers in the step's float64 tensor, the rest as objects)
    records += [(k, v, {RETURNED: True}) for k, v in _other_keys(outputs, sizes, loss_reduction).items()]
    result = (loss.detach().cpu(), records, isinstance(reduced, Mapping))
    return result, grads, kept, kept.merged(sizes, loss_reduction)


def _other_keys(outputs: list[Any], sizes: list[int], reduction: str) -> dict[str, Any]:
    """A dict ``training_step`` returned: its keys beside ``loss``, each what one step on the whole batch would have
    returned (:func:`~lightning_accel.pipeline.kept_outputs.merge_items`), detached on the CPU, to send to every rank."""
    if not all(isinstance(o, Mapping) for o in outputs):
        return {}
    keys = [k for k in outputs[-1] if k != "loss" and all(k in o for o in outputs)]
    merged = {k: merge_items([o[k] for o in outputs], sizes, reduction) for k in keys}
    return {k: map_tensors(v, lambda t: t.detach().cpu()) for k, v in merged.items()}  # what crosses: CPU copies


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
        with silenced(module):
            return step(parts[i])

    out = pipe.evaluate(size, run)
    sent = map_tensors(out, lambda t: t.detach().cpu()) if pipe.holds_last else None
    appended = kept.merged([size], "mean") if pipe.holds_last else {}
    records, output, appended = logs.exchange(sent, src, pipe.group, kept_on_cpu(appended))
    kept.settle(appended, device)
    if pipe.holds_last:
        return out
    EvalLogs.replay(module, records, device)
    return map_tensors(output, lambda t: t.to(device))
