"""torch's ``PipelineStage`` as a rank's stage runs it: block structures in the shape metadata, metered actions, own errors.

:class:`PipeStage` wraps a :class:`~lightning_accel.pipeline.stage_module.StageModule` (``submod``, whose ``pipe`` is the
rank's :class:`~lightning_accel.pipeline.distributed.RankPipeline`) and adds, around torch's own stage:

- the structure of the block outputs it sends rides with torch's shape metadata
  (:attr:`~lightning_accel.pipeline.boundaries.StageBoundaries.structures`), so the next stage's rank never runs
  another rank's block to learn it;
- under ``schedule="auto"`` each forward (F), input-gradient (I) and weight-gradient (W) action is timed
  (:mod:`lightning_accel.pipeline.stage_meter`);
- during a split backward (zero-bubble schedules) the stage module lists the weights outside the blocks too;
- an exception the stage's own backward raises (``detect_anomaly``'s NaN gradient, a user's autograd Function), in a
  step or in the first step's shape inference, is kept as the stage's (:mod:`lightning_accel.pipeline.step_failure`),
  like one its forward raises, so the step re-raises it as itself, its type and message first, instead of as a failed
  exchange with the neighbours (torch wraps it in "Failed to run stage backward"; its cause is the user's); from then on
  the stage's backwards return no gradients, which torch sends as zeros, so the schedule ends on every rank, and its
  forwards zeros shaped as its outputs (the metadata torch inferred, set on the stage module before each). No
  Lightning here.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from torch import Tensor
from torch.distributed.pipelining import PipelineStage

__all__ = ["PipeStage", "own_error"]

_TORCH_WRAPPERS = ("Failed to run stage backward", "failed to run forward")


def _no_gradients(backward_type: str, bwd_kwargs: dict) -> tuple[tuple[None, ...], None]:
    """A skipped backward's result: no input gradients (torch sends zeros where the previous stage expects one)."""
    inputs = bwd_kwargs.get("input_values", ()) if backward_type != "weight" else ()
    return tuple(None for _ in inputs), None


def own_error(err: BaseException) -> BaseException:
    """The error a stage's own code raised: ``err``, or the cause torch's stage wrapped it around."""
    while isinstance(err, RuntimeError) and err.__cause__ is not None and any(w in str(err) for w in _TORCH_WRAPPERS):
        err = err.__cause__
    return err


class PipeStage(PipelineStage):
    """torch's stage over a :class:`~lightning_accel.pipeline.stage_module.StageModule` (see the module docstring)."""

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[tuple[Tensor | None, ...], list[dict[str, Any]] | None]:
        failure = self.submod.pipe.failure
        if failure.stopped():  # this step failed (here or on a peer): no gradients (torch sends zeros), no user code
            return _no_gradients(backward_type, bwd_kwargs)
        self.submod.split_backward = backward_type != "full"
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        except Exception as err:  # the stage's own: raised as itself after the schedule (lightning_accel.pipeline.step_failure)
            cause = own_error(err)
            failure.record(cause if isinstance(cause, Exception) else err, self.stage_index, backward=True)
            return _no_gradients(backward_type, bwd_kwargs)
        finally:
            self.submod.split_backward = False

    def _compute_input_grads(self, outputs: list[Tensor], all_fwd_inputs: list[Tensor], grad_outputs: Any = None) -> tuple[Tensor | None, ...]:
        """The first step's shape inference runs a backward of its own: an error there is the stage's too."""
        failure = self.submod.pipe.failure
        if not failure.stopped():
            try:
                return super()._compute_input_grads(outputs, all_fwd_inputs, grad_outputs)
            except Exception as err:
                cause = own_error(err)
                failure.record(cause if isinstance(cause, Exception) else err, self.stage_index, backward=True)
        return tuple(None for _ in all_fwd_inputs)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.submod.out_metas = self._stage_meta.outputs  # what a failed step's stand-ins are shaped as
        meter = self.submod.pipe.meter
        with meter.action("F", self.stage_index) if meter is not None else nullcontext():
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False) -> None:
        meter = self.submod.pipe.meter  # measuring (schedule="auto"): a whole backward as its two halves, each timed
        if meter is None:
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        with meter.action("I", self.stage_index):
            super().backward_one_chunk(bwd_chunk_id, loss, False, last_backward)
        if full_backward:
            self.backward_weight_one_chunk(bwd_chunk_id, last_backward)
        return None

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        meter = self.submod.pipe.meter
        with meter.action("W", self.stage_index) if meter is not None else nullcontext():
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

    def _send_meta(self, meta: Any, dst_stage: int) -> None:
        super()._send_meta((meta, dict(self.submod.pipe.boundaries.structures)), dst_stage)

    def _recv_meta(self, src_stage: int) -> Any:
        meta, structures = super()._recv_meta(src_stage)
        known = self.submod.pipe.boundaries.structures
        known.update({k: v for k, v in structures.items() if k not in known})
        return meta
