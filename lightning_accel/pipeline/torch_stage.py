"""torch's ``PipelineStage`` as a rank's stage runs it: block structures in the shape metadata, metered actions, own errors.

:class:`PipeStage` wraps a :class:`~lightning_accel.pipeline.distributed.StageModule` (``submod``, whose ``pipe`` is the
rank's :class:`~lightning_accel.pipeline.distributed.RankPipeline`) and adds, around torch's own stage:

- the structure of the block outputs it sends rides with torch's shape metadata
  (:attr:`~lightning_accel.pipeline.boundaries.StageBoundaries.structures`), so the next stage's rank never runs
  another rank's block to learn it;
- under ``schedule="auto"`` each forward (F), input-gradient (I) and weight-gradient (W) action is timed
  (:mod:`lightning_accel.pipeline.stage_meter`);
- during a split backward (zero-bubble schedules) the stage module lists the weights outside the blocks too;
- an exception the stage's own backward raises (``detect_anomaly``'s NaN gradient, a user's autograd Function) is
  kept on the pipeline as the stage's, like one its forward raises, so the step re-raises it as itself, its type and
  message first, instead of as a failed exchange with the neighbours: torch wraps it in "Failed to run stage
  backward", and its cause is the user's. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from torch import Tensor
from torch.distributed.pipelining import PipelineStage

__all__ = ["PipeStage", "own_error"]

_TORCH_WRAPPERS = ("Failed to run stage backward", "failed to run forward")


def own_error(err: BaseException) -> BaseException:
    """The error a stage's own code raised: ``err``, or the cause torch's stage wrapped it around."""
    while isinstance(err, RuntimeError) and err.__cause__ is not None and any(w in str(err) for w in _TORCH_WRAPPERS):
        err = err.__cause__
    return err


class PipeStage(PipelineStage):
    """torch's stage over a :class:`~lightning_accel.pipeline.distributed.StageModule` (see the module docstring)."""

    @contextmanager
    def _own_errors(self) -> Iterator[None]:
        try:
            yield
        except Exception as err:
            pipe = self.submod.pipe
            if pipe._raised is None:  # the first one: a full backward's weight half runs inside its input half's call
                cause = own_error(err)
                pipe._raised = (cause if isinstance(cause, Exception) else err, self.stage_index)
            raise

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[tuple[Tensor | None, ...], list[dict[str, Any]] | None]:
        self.submod.split_backward = backward_type != "full"
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        finally:
            self.submod.split_backward = False

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        meter = self.submod.pipe.meter
        with meter.action("F", self.stage_index) if meter is not None else nullcontext():
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False) -> None:
        meter = self.submod.pipe.meter  # measuring (schedule="auto"): a whole backward as its two halves, each timed
        with self._own_errors():
            if meter is None:
                return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
            with meter.action("I", self.stage_index):
                super().backward_one_chunk(bwd_chunk_id, loss, False, last_backward)
            if full_backward:
                self.backward_weight_one_chunk(bwd_chunk_id, last_backward)
        return None

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        meter = self.submod.pipe.meter
        with self._own_errors(), meter.action("W", self.stage_index) if meter is not None else nullcontext():
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

    def _send_meta(self, meta: Any, dst_stage: int) -> None:
        super()._send_meta((meta, dict(self.submod.pipe.boundaries.structures)), dst_stage)

    def _recv_meta(self, src_stage: int) -> Any:
        meta, structures = super()._recv_meta(src_stage)
        known = self.submod.pipe.boundaries.structures
        known.update({k: v for k, v in structures.items() if k not in known})
        return meta
