"""What a pipeline step logs: recorded where the user's step runs, replayed on the pipeline's other ranks.

Only the last stage's rank runs the user's step to its end, so only there does its
``self.log`` see the loss and the outputs; rank 0 owns the loggers and the progress bar,
and every rank's callbacks (``ModelCheckpoint(monitor=...)``) must see the same values.

- Training: each micro-batch's ``log`` calls are recorded (:class:`MicroBatchLogs`) and
  reduced over the micro-batches like the loss
  (:func:`lightning_accel.pipeline.step_result.reduce_logs`); the step result carries them.
- Evaluation: the last rank's step runs once, on the whole batch, and logs for real;
  :class:`EvalLogs` records those calls as well (a torchmetrics ``Metric`` as its state and
  its path in the module), broadcasts them with what the step returned, and the other
  ranks log the same. Their own runs of the step (up to their stages' end) are silenced.

Works on any object with a ``log(name, value, ...)`` method (a LightningModule). No Lightning here.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_accel.patching import swapped
from lightning_accel.pipeline.metric_state import load_metric_state, loggable, metric_state
from lightning_accel.pipeline.step_result import reduce_logs

__all__ = ["EvalLogs", "MicroBatchLogs", "silenced"]


def silenced(module: Any) -> AbstractContextManager[None]:
    """``module.log`` does nothing inside the block (a rank's partial run of the step logs nothing)."""
    return swapped(module, "log", lambda *_, **__: None)


class MicroBatchLogs:
    """The ``log`` calls of a training step, one list per micro-batch, each value made :func:`loggable`."""

    def __init__(self, chunks: int) -> None:
        self.records: list[list[tuple[str, Any, dict]]] = [[] for _ in range(chunks)]

    def recording(self, module: Any, i: int) -> AbstractContextManager[None]:
        """``module.log`` records into micro-batch ``i``'s list inside the block."""
        self.records[i] = []  # should torch run a micro-batch's loss twice, keep the last
        records = self.records[i]

        def log(name: str, value: Any, *_: Any, **kw: Any) -> None:
            records.append((name, loggable(value), kw))

        return swapped(module, "log", log)

    def reduced(self, sizes: Sequence[int], reduction: str) -> list[tuple[str, Any, dict]]:
        """Each name's values over the micro-batches, reduced as the loss is (``"mean"`` weighted by ``sizes``, or ``"sum"``)."""
        return reduce_logs(self.records, sizes, reduction)


class EvalLogs:
    """The ``log`` calls of ``hook`` (an evaluation step) on ``module``: logged for real and recorded, to send on."""

    def __init__(self, module: nn.Module, hook: str) -> None:
        self.module, self.hook = module, hook
        self.records: list[tuple[str, Any, tuple, dict]] = []
        self._paths = {id(m): n for n, m in module.named_modules()}
        self._log = module.log  # type: ignore[operator]  # the real one, bound before any swap

    def recording(self) -> AbstractContextManager[None]:
        return swapped(self.module, "log", self._record)

    def _record(self, name: str, value: Any, *a: Any, **kw: Any) -> None:
        self._log(name, value, *a, **kw)
        if isinstance(value, Metric):
            if id(value) not in self._paths:
                raise ValueError(
                    f"{self.hook} logged {name!r}, a Metric that is not a submodule of the LightningModule; the "
                    "pipeline's other ranks cannot log the same one; assign it as an attribute in __init__"
                )
            self.records.append((name, ("metric", self._paths[id(value)], metric_state(value)), a, kw))
        else:
            self.records.append((name, loggable(value), a, kw))

    def exchange(self, output: Any, src: int, group: Any) -> tuple[list[tuple[str, Any, tuple, dict]], Any]:
        """Every rank of the pipeline calls it: ``src`` (the last stage's global rank) sends its records and ``output``
        (what the step returned, on the CPU, or None); returns what ``src`` sent."""
        payload: list[Any] = [self.records, output]
        dist.broadcast_object_list(payload, src=src, group=group)
        return payload[0], payload[1]

    @staticmethod
    def replay(module: nn.Module, records: Sequence[tuple[str, Any, tuple, dict]], device: torch.device) -> None:
        """Log on ``module`` what another rank's :class:`EvalLogs` recorded (a metric: its state loaded, then itself)."""
        for name, value, a, kw in records:
            if isinstance(value, tuple) and value[:1] == ("metric",):
                metric = module.get_submodule(value[1])
                load_metric_state(metric, value[2], device)  # type: ignore[arg-type]
                value = metric
            elif isinstance(value, Tensor):
                value = value.to(device)
            module.log(name, value, *a, **kw)  # type: ignore[operator]
