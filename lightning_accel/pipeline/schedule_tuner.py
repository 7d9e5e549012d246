"""``schedule="auto"`` online: measure the first steps, agree on the numbers across ranks, switch once between steps.

Over a :class:`~lightning_accel.pipeline.distributed.RankPipeline` (no Lightning here; the strategy
and ``bench pipeline --schedules auto`` drive it alike). The steps go:

- one step to warm up (torch's shape inference runs an extra micro-batch), then ``steps`` steps
  measured at the start's ``chunks`` (each stage's F, I and W per micro-batch, by
  :class:`~lightning_accel.pipeline.stage_meter.StageMeter`, and the step's wall time);
- the same at a second micro-batch count (twice, or else half, the start's), so each action's cost
  splits into a fixed part and a part per row (:class:`~lightning_accel.pipeline.auto_schedule.StageCosts`), and
  the two counts' measured steps give what each action and each step costs beyond the meter
  (:func:`~lightning_accel.pipeline.auto_schedule.fit_residual`);
- one ``all_gather_object`` over every rank (replicas included, so they all choose alike), then
  :func:`~lightning_accel.pipeline.auto_schedule.choose`, and the next step runs the choice (or the start
  again when nothing beats it beyond the noise).

Every step trains: changing the schedule or the micro-batch count changes neither the batch nor the
gradient's sum (the loss of equal micro-batches is the batch's mean), so nothing is lost or
repeated, and the weights equal those of a run started with the choice up to the order of float sums.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_accel.pipeline.auto_schedule import AutoSchedule, Choice, StageCosts, candidates, choose, fit_residual
from lightning_accel.pipeline.distributed import RankPipeline
from lightning_accel.pipeline.stage_meter import StageMeter

__all__ = ["ScheduleTuner"]


class ScheduleTuner:
    """Call :meth:`before_step` with the batch's size and :meth:`after_step` with the step's seconds on every rank;
    :attr:`choice` is set (and returned once by ``after_step``) when the decision is made."""

    def __init__(self, pipe: RankPipeline, settings: AutoSchedule) -> None:
        self.pipe, self.settings = pipe, settings
        self.start = (pipe.schedule_name, pipe.chunks)
        self.batch: int | None = None
        self.step = 0  # counted steps of the batch size measured (others run, unmeasured)
        self.second: int | None = None  # the second micro-batch count
        self.times: dict[int, list[float]] = {}  # chunks -> this rank's measured step seconds
        self.choice: Choice | None = None
        self.meter = StageMeter(set())
        self._counted = self._measuring = False

    @property
    def done(self) -> bool:
        return self.choice is not None

    def _second_count(self, batch: int) -> int | None:
        name, m = self.start
        runs = {c for n, c in candidates(name, batch, len(self.pipe.balance), self.settings.max_chunks) if n == name}
        return next((c for c in (2 * m, m // 2) if c in runs and c != m), None)

    def before_step(self, batch: int) -> None:
        if self.done:
            return
        if self.batch is None:  # the start runs the first batch in this many equal micro-batches (chunks, if it divides)
            self.start = (self.start[0], self.pipe.microbatches(batch))
            self.batch, self.second = batch, self._second_count(batch)
            weights = {p.untyped_storage().data_ptr() for p in self.pipe.parameters() if not p.is_meta}
            self.meter = StageMeter(weights)
        self._counted = batch == self.batch  # a ragged batch runs, unmeasured and uncounted
        self._measuring = self._counted and self.step % (self.settings.steps + 1) != 0  # each count's first step warms up
        self.pipe.meter = self.meter if self._measuring else None
        if self._measuring:
            self.meter.rows = batch / self.pipe.microbatches(batch)

    def after_step(self, seconds: float) -> Choice | None:
        """Count the step; at the end of the measurement, decide and reschedule (every rank, collectively)."""
        self.pipe.meter = None
        if self.done or not self._counted:
            return None
        if self._measuring:
            self.times.setdefault(self.pipe.step_chunks, []).append(seconds)
        self.step += 1
        n = self.settings.steps
        if self.step == n + 1 and self.second is not None:
            self.pipe.reschedule(self.start[0], self.second)
            return None
        if self.step < (2 if self.second is not None else 1) * (n + 1):
            return None
        self.choice = self._decide(self.meter)
        if (self.pipe.schedule_name, self.pipe.chunks) != self.choice.chosen:
            self.pipe.reschedule(*self.choice.chosen)
        return self.choice

    def _decide(self, meter: StageMeter) -> Choice:
        free = None
        if self.pipe.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.pipe.device)[0]
        mine = {"samples": meter.samples, "held": meter.held, "times": self.times, "free": free}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
        held: dict[int, list[tuple[float, float]]] = {}
        for r in everyone:
            for key, points in r["samples"].items():
                samples.setdefault(key, []).extend(points)
            for s, points in r["held"].items():
                held.setdefault(s, []).extend(points)
        # per micro-batch count measured, each step as the slowest rank's
        measured = {m: [max(ts) for ts in zip(*(r["times"][m] for r in everyone))] for m in everyone[0]["times"]}
        budgets = [b for b in (self.settings.max_activation_bytes, *(r["free"] for r in everyone)) if b is not None]
        assert self.batch is not None
        ranks = self.pipe.world_size
        costs = StageCosts.fit(samples, held)
        return choose(
            costs, ranks, self.batch, self.start, measured[self.start[1]],
            candidates(self.start[0], self.batch, len(self.pipe.balance), self.settings.max_chunks),
            min(budgets) if budgets else None, fit_residual(costs, ranks, self.batch, self.start[0], measured),
        )
