"""Pipeline schedules as pure functions: which (micro-batch, stage) runs at each clock.

A schedule is plain data computed before any work: per stage, the ordered list of
forward (``"F"``) and backward (``"B"``) actions, and from those the clock cycles on
which each action runs when every action takes one unit of time. The executors follow
the orders; the tests compare them with orders written out by hand; the timeline
picture and the bubble figure are read off the same data.

- GPipe (fill-drain): every stage runs all M forwards, then all M backwards in
  reverse; activations of all M micro-batches are alive at the peak.
- 1F1B (PipeDream-flush): stage ``s`` runs ``S - s - 1`` warm-up forwards, then
  alternates one forward and one backward, then drains; at most ``S - s`` micro-batches
  are alive on stage ``s``. Same bubble as GPipe, less activation memory.
- Zero-bubble (``interleaved_zb``, ``zbv``) and DualPipeV (``dualpipev``): torch's own
  schedules, which split each backward into its input-gradient and weight-gradient
  halves and fill the bubble with the weight halves; ``zbv`` and ``dualpipev`` place
  two stages per rank V-wise (:func:`stage_rank`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "Action",
    "stage_indices",
    "equal_microbatches",
    "SCHEDULES",
    "SCHEDULE_TABLE",
    "ScheduleSpec",
    "bubble_fraction",
    "check_schedule",
    "clock_cycles",
    "gpipe_order",
    "ideal_speedup",
    "one_f_one_b_order",
    "simulate",
    "stage_rank",
]

@dataclass(frozen=True)
class ScheduleSpec:
    """What the multi-process pipeline needs to know about one schedule, in one place.

    ``torch_class``: its class in ``torch.distributed.pipelining``; ``stages_per_rank``: 1,
    or 2 for an interleaved (looped) schedule; ``needs_chunks_per_stage``: at least as many
    micro-batches as stages (1F1B's steady state); ``rounds``: micro-batches go in rounds of
    the stage count, so ``chunks`` must be a multiple of the rounds; ``eval_whole_on_pairs``:
    evaluation sends the batch whole where two ranks send each other activations off the
    CPU (NCCL would deadlock on crossing streamed sends; see ``RankPipeline.eval_chunks``);
    ``v_shape``: rank ``r`` of ``W`` holds stages ``r`` and ``2W - 1 - r`` (torch's "v" style),
    not ``r`` and ``r + W`` (looped).
    """

    name: str
    torch_class: str
    stages_per_rank: int = 1
    needs_chunks_per_stage: bool = False
    rounds: bool = False
    eval_whole_on_pairs: bool = False
    v_shape: bool = False

    @property
    def placement(self) -> str:
        """Where a rank's stages sit: ``"one"`` stage per rank, ``"looped"`` (``r``, ``r + W``) or ``"v"``."""
        return "v" if self.v_shape else "looped" if self.stages_per_rank > 1 else "one"

    def build(self, stages: Sequence[Any], **kwargs: Any) -> Any:
        """The torch schedule over this rank's ``PipelineStage`` objects (one, or several for a looped schedule)."""
        import torch.distributed.pipelining as pipelining

        cls = getattr(pipelining, self.torch_class)
        return cls(list(stages) if self.stages_per_rank > 1 else stages[0], **kwargs)


SCHEDULE_TABLE: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", "ScheduleGPipe"),
        ScheduleSpec("1f1b", "Schedule1F1B", needs_chunks_per_stage=True),
        ScheduleSpec(
            "interleaved_1f1b", "ScheduleInterleaved1F1B", stages_per_rank=2, needs_chunks_per_stage=True, rounds=True,
            eval_whole_on_pairs=True,
        ),
        ScheduleSpec(
            "interleaved_zb", "ScheduleInterleavedZeroBubble", stages_per_rank=2, needs_chunks_per_stage=True,
            rounds=True, eval_whole_on_pairs=True,
        ),
        ScheduleSpec("zbv", "ScheduleZBVZeroBubble", stages_per_rank=2, eval_whole_on_pairs=True, v_shape=True),
        ScheduleSpec(
            "dualpipev", "ScheduleDualPipeV", stages_per_rank=2, needs_chunks_per_stage=True, eval_whole_on_pairs=True,
            v_shape=True,
        ),
    )
}
SCHEDULES = tuple(SCHEDULE_TABLE)


def stage_rank(stage: int, world_size: int, schedule: str) -> int:
    """The pipeline rank that runs ``stage`` under ``schedule``: ``stage % world_size`` (looped), or V-wise for ``zbv``
    and ``dualpipev`` (stages ``0 .. W-1`` down the ranks, ``W .. 2W-1`` back up: rank 0 holds the first and the last)."""
    if SCHEDULE_TABLE[schedule].v_shape and stage >= world_size:
        return 2 * world_size - 1 - stage
    return stage % world_size


class Action(NamedTuple):
    """One unit of work: ``kind`` "F" or "B" of ``microbatch`` on ``stage``."""

    kind: str
    microbatch: int
    stage: int


def _check(m: int, n: int) -> None:
    if m < 1 or n < 1:
        raise ValueError(f"a schedule needs at least one micro-batch and one stage, got m={m}, n={n}")


def clock_cycles(m: int, n: int) -> Iterator[list[tuple[int, int]]]:
    """GPipe's forward clock cycles: at clock ``k`` every (micro-batch i, stage j) with i + j == k runs."""
    _check(m, n)
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]


def gpipe_order(m: int, n: int) -> list[list[Action]]:
    """Per stage: F0 .. F(m-1), then B(m-1) .. B0 (fill, then drain in reverse)."""
    _check(m, n)
    return [
        [Action("F", i, s) for i in range(m)] + [Action("B", i, s) for i in reversed(range(m))]
        for s in range(n)
    ]


def one_f_one_b_order(m: int, n: int) -> list[list[Action]]:
    """Per stage: ``min(n - s - 1, m)`` warm-up forwards, then one F / one B, then the remaining Bs."""
    _check(m, n)
    orders: list[list[Action]] = []
    for s in range(n):
        warmup = min(n - s - 1, m)
        order = [Action("F", i, s) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action("F", warmup + i, s), Action("B", i, s)]
        order += [Action("B", i, s) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


def simulate(orders: Sequence[Sequence[Action]]) -> list[list[Action]]:
    """Clock cycles of per-stage orders when each action takes one unit of time.

    F(i, s) waits for F(i, s-1); B(i, s) waits for F(i, s) and B(i, s+1). Each stage
    runs its order in sequence. Returns, per clock, the actions running then. Raises
    ``ValueError`` if the orders deadlock (an action waits on one that never runs first).
    """
    n = len(orders)
    done: dict[tuple[str, int, int], int] = {}  # action -> clock it ran on
    position = [0] * n
    clocks: list[list[Action]] = []
    total = sum(len(o) for o in orders)
    while len(done) < total:
        k = len(clocks)
        running: list[Action] = []
        for s in range(n):
            if position[s] == len(orders[s]):
                continue
            a = orders[s][position[s]]
            if a.kind == "F":
                deps = [("F", a.microbatch, s - 1)] if s > 0 else []
            else:
                deps = [("F", a.microbatch, s)] + ([("B", a.microbatch, s + 1)] if s < n - 1 else [])
            if all(d in done and done[d] < k for d in deps):
                running.append(a)
        if not running:
            raise ValueError(f"the pipeline orders deadlock at clock {k}: no stage can run its next action")
        for a in running:
            done[tuple(a)] = k  # type: ignore[index]
            position[a.stage] += 1
        clocks.append(running)
    return clocks


def bubble_fraction(m: int, n: int) -> float:
    """Idle share of a fill-drain pipeline with equal stages: (n - 1) / (m + n - 1)."""
    _check(m, n)
    return (n - 1) / (m + n - 1)


def ideal_speedup(m: int, n: int) -> float:
    """Speed-up of n equal stages over one device running them all: n * m / (m + n - 1)."""
    _check(m, n)
    return n * m / (m + n - 1)


def stage_indices(rank: int, world_size: int, schedule: str) -> list[int]:
    """Stages rank ``rank`` runs: one, or two for an interleaved schedule (``rank`` and ``rank + world_size``; V-wise
    ``rank`` and ``2 * world_size - 1 - rank`` for ``zbv`` and ``dualpipev``), in stage order."""
    stages = SCHEDULE_TABLE[schedule].stages_per_rank * world_size
    return [s for s in range(stages) if stage_rank(s, world_size, schedule) == rank]


def check_schedule(name: str, chunks: int, stages: int) -> None:
    """Refuse, before any work, a schedule the chosen (chunks, stages) cannot run."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    spec = SCHEDULE_TABLE[name]
    if spec.needs_chunks_per_stage and chunks < stages:
        raise ValueError(
            f"schedule {name!r} needs at least as many micro-batches as stages (chunks={chunks}, stages={stages}); "
            f"set chunks >= {stages} or schedule='gpipe'"
        )
    rounds = max(1, chunks // stages)
    if spec.rounds and chunks % rounds != 0:
        raise ValueError(
            f"schedule {name!r} runs micro-batches in rounds of {stages} and needs chunks to be a "
            f"multiple of the {rounds} rounds (chunks={chunks}, stages={stages}); set chunks={rounds * stages}"
        )


def equal_microbatches(size: int, chunks: int, name: str, stages: int) -> int | None:
    """How many equal micro-batches a batch of ``size`` runs in under schedule ``name`` on ``stages`` stages, or None if
    no count works.

    ``chunks`` when it divides ``size``; else the largest divisor of ``size`` below ``chunks`` that the schedule runs
    (fewer micro-batches, as the reference GPipe runs a batch smaller than ``chunks``); else the smallest above it.
    Equal, because torch's stages fix their activation shapes per step (uneven micro-batches do not fit its
    buffers), and equal micro-batches keep a mean loss the batch's mean."""

    def runs(m: int) -> bool:
        try:
            check_schedule(name, m, stages)
        except ValueError:
            return False
        return True

    if size % chunks == 0 and runs(chunks):  # the usual batch, at every step: no search
        return chunks
    divisors = [m for m in range(1, size + 1) if size % m == 0 and runs(m)]
    below = [m for m in divisors if m <= chunks]
    if below:
        return below[-1]
    return divisors[0] if divisors else None
