"""Reduction of per-micro-batch losses to the loss of the whole batch.

Plain training computes one loss on the whole batch; a pipeline computes one per
micro-batch. For the gradients to match, the micro-batch losses must be combined the
way the batch loss combines samples:

- ``"mean"`` (a loss averaged over samples, e.g. ``F.cross_entropy``'s default):
  ``sum_i loss_i * n_i / n``, where ``n_i`` is micro-batch ``i``'s size. Exact when every
  sample carries the same weight in the mean (a classifier; an LM without ignored tokens).
- ``"sum"`` (a loss summed over samples): ``sum_i loss_i``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

__all__ = ["REDUCTIONS", "reduce_outputs"]

REDUCTIONS = ("mean", "sum")


def _loss(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    raise TypeError(
        f"training_step returned {type(output).__name__}; the pipeline needs the loss tensor or a dict with "
        "a 'loss' tensor from every micro-batch"
    )


def reduce_outputs(outputs: Sequence[Any], sizes: Sequence[int], reduction: str = "mean") -> Any:
    """Combine ``training_step`` outputs of the micro-batches into one output for the batch.

    A dict output keeps its other keys from the last micro-batch. ``None`` from every
    micro-batch (a skipped step) stays ``None``.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if all(o is None for o in outputs):
        return None
    if any(o is None for o in outputs):
        raise ValueError(
            "training_step returned None for some micro-batches but not for others; a pipeline step must "
            "skip the whole batch or none of it (decide from the batch, not from a micro-batch)"
        )
    total = sum(sizes)
    weights = [n / total for n in sizes] if reduction == "mean" else [1.0] * len(sizes)
    loss = sum(_loss(o) * w for o, w in zip(outputs, weights))
    last = outputs[-1]
    if isinstance(last, Mapping):
        return {**last, "loss": loss}
    return loss
