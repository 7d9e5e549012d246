"""The clock of a schedule's own order: its step time and peak activations for given costs per action and stage.

One simulation serves the schedule table (``bench pipeline --schedules``: the ideal step beside the
measured one), the tests and ``schedule="auto"`` (:mod:`lightning_accel.pipeline.auto_schedule`:
each candidate's predicted step), so the three agree by construction. The orders are the ones that
run: torch's ``pipeline_order`` for the schedules with two stages per rank (computed by torch's own
class over stand-in stages, so no process group is needed), :func:`~lightning_accel.pipeline.schedule.gpipe_order`
and :func:`~lightning_accel.pipeline.schedule.one_f_one_b_order` for the others. Communication is
free here; what it costs shows as the gap between predicted and measured steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import SimpleNamespace

from lightning_accel.pipeline.schedule import SCHEDULE_TABLE, gpipe_order, one_f_one_b_order, stage_rank

__all__ = ["Orders", "peak_activations", "schedule_orders", "step_time"]

# per rank, its actions in order as (kind, stage, micro-batch); kind F, I (input gradient), W (weight gradient) or
# B (a whole backward)
Orders = dict[int, list[tuple[str, int, int]]]
_KINDS = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}


def schedule_orders(name: str, ranks: int, chunks: int) -> Orders:
    """Per rank, the actions ``name`` runs over ``chunks`` micro-batches on ``ranks`` ranks, in order."""
    spec = SCHEDULE_TABLE[name]
    if spec.stages_per_rank == 1:
        order = gpipe_order(chunks, ranks) if name == "gpipe" else one_f_one_b_order(chunks, ranks)
        return {s: [(a.kind, a.stage, a.microbatch) for a in actions] for s, actions in enumerate(order)}
    import torch.distributed.pipelining as pipelining

    stages = spec.stages_per_rank * ranks
    mine = [s for s in range(stages) if stage_rank(s, ranks, name) == 0]
    stand_ins = [  # what torch's schedule reads of a stage to compute every rank's order
        SimpleNamespace(num_stages=stages, group_size=ranks, group_rank=0, stage_index=s, is_first=s == 0,
                        is_last=s == stages - 1, submod=None)
        for s in mine
    ]
    schedule = getattr(pipelining, spec.torch_class)(stand_ins, n_microbatches=chunks)
    out: Orders = {}
    for rank, actions in schedule.pipeline_order.items():
        flat = []
        for a in actions:
            if a is None:
                continue
            for sub in a.sub_actions or (a,):
                kind = _KINDS.get(sub.computation_type.name)
                if kind is not None:
                    flat.append((kind, sub.stage_index, sub.microbatch_index))
        out[rank] = flat
    return out


def _run(
    orders: Orders, stages: int, cost: Callable[[str, int], float],
    on_action: Callable[[int, float, float, str, int, int], None] | None = None,
) -> float:
    done: dict[tuple[str, int, int], float] = {}
    clock = dict.fromkeys(orders, 0.0)
    position = dict.fromkeys(orders, 0)
    total = sum(len(o) for o in orders.values())
    while len(done) < total:
        moved = False
        for rank, actions in orders.items():
            while position[rank] < len(actions):
                kind, s, m = actions[position[rank]]
                if kind == "F":
                    deps = [("F", s - 1, m)] if s > 0 else []
                elif kind in ("I", "B"):
                    deps = [("F", s, m)] + ([("G", s + 1, m)] if s < stages - 1 else [])
                else:
                    deps = [("G", s, m)]
                if not all(d in done for d in deps):
                    break
                start = max([clock[rank], *(done[d] for d in deps)])
                clock[rank] = done[(kind, s, m)] = start + cost(kind, s)
                if on_action is not None:
                    on_action(rank, start, clock[rank], kind, s, m)
                if kind in ("I", "B"):
                    done[("G", s, m)] = clock[rank]  # the input gradient sent back
                    total += 1
                position[rank] += 1
                moved = True
        if not moved:
            raise ValueError("the schedule's orders deadlock under the simulation")
    return max(clock.values())


def step_time(
    orders: Orders, stages: int, cost: Callable[[str, int], float],
    starts: dict[int, list[tuple[float, str, int, int]]] | None = None,
) -> float:
    """Seconds the per-rank ``orders`` take with ``cost(kind, stage)`` per action and free communication: each rank runs
    its actions in order, each as soon as what it needs is done (F after the previous stage's F; I or B after this
    stage's F and the next stage's I or B; W after this stage's I). ``starts``: filled with each rank's (start, kind,
    stage, micro-batch)."""

    def record(rank: int, start: float, _end: float, kind: str, s: int, m: int) -> None:
        if starts is not None:
            starts.setdefault(rank, []).append((start, kind, s, m))

    return _run(orders, stages, cost, record)


def peak_activations(orders: Orders, stages: int, cost: Callable[[str, int], float], held: Mapping[int, float]) -> float:
    """The most activation bytes any rank holds at once when ``orders`` run as :func:`step_time` runs them: a
    micro-batch's ``held[stage]`` bytes from the start of its forward on that stage to the end of its whole backward
    (B) or of its weight half (W; torch keeps what the weight gradient needs until then)."""
    changes: dict[int, list[tuple[float, float]]] = {}

    def record(rank: int, start: float, end: float, kind: str, s: int, _m: int) -> None:
        if kind == "F":
            changes.setdefault(rank, []).append((start, held[s]))
        elif kind in ("B", "W"):
            changes.setdefault(rank, []).append((end, -held[s]))

    _run(orders, stages, cost, record)
    peak = 0.0
    for events in changes.values():
        now = 0.0
        for _, change in sorted(events, key=lambda e: (e[0], e[1])):  # a release before an allocation at one instant
            now += change
            peak = max(peak, now)
    return peak
