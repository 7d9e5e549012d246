"""A rank's timeline of one pipeline step, recorded as its stages run (forwards timed directly, backwards from autograd).

A stage's backward runs inside torch's schedule, out of reach; an identity autograd
function (:class:`Mark`) at the stage's output and another at its first block's input
call back when the gradient passes them, which brackets the stage's backward of that
micro-batch. :meth:`StepRecorder.step_events` gives the step's
:class:`lightning_accel.pipeline.timeline.Event` list. No Lightning here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_accel.pipeline.timeline import Event

__all__ = ["Mark", "StepRecorder"]


class Mark(torch.autograd.Function):
    """Identity whose backward calls ``callback``: tells the recorder when a gradient passes a point."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, callback: Callable[[], None]) -> Tensor:
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.callback()
        return grad, None


class StepRecorder:
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
