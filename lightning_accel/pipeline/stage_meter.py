"""Per stage and micro-batch: seconds of the forward, the input-gradient and the weight-gradient halves, and activation bytes.

What ``schedule="auto"`` predicts from (:mod:`lightning_accel.pipeline.auto_schedule`). The pipeline's
stages call :meth:`StageMeter.action` around torch's ``forward_one_chunk``, ``backward_one_chunk``
(input half) and ``backward_weight_one_chunk``; while a meter is on, a whole backward is run as its
two halves back to back, so the split is measured whatever the schedule (the gradients are the
same sums). Activation bytes are what the stage's forward saves for backward (autograd's
saved-tensor hooks; parameters are not activations). No Lightning here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["StageMeter"]


class StageMeter:
    """Collects ``samples[(kind, stage)]`` = [(rows, seconds)] and ``held[stage]`` = [(rows, bytes)] of the steps run with
    it; ``rows``: the rows of the current micro-batches (set per step by its owner)."""

    def __init__(self, weights: set[int]) -> None:
        self.weights = weights  # storage pointers of the parameters: what a forward saves of them is no activation
        self.rows = 0.0
        self.samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
        self.held: dict[int, list[tuple[float, float]]] = {}

    @contextmanager
    def action(self, kind: str, stage: int) -> Iterator[None]:
        saved = [0]
        hooks: Any = self._count_saved(saved) if kind == "F" else nullcontext()
        start = time.perf_counter()
        with hooks:
            yield
        self.samples.setdefault((kind, stage), []).append((self.rows, time.perf_counter() - start))
        if kind == "F":
            self.held.setdefault(stage, []).append((self.rows, float(saved[0])))

    def _count_saved(self, saved: list[int]) -> Any:
        weights = self.weights

        def pack(t: Tensor) -> Tensor:
            if not isinstance(t, nn.Parameter) and t.device.type != "meta" and t.untyped_storage().data_ptr() not in weights:
                saved[0] += t.numel() * t.element_size()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
