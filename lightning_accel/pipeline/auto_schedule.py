"""The choice of ``schedule="auto"``: each candidate's step predicted by the schedule's own clock, the best kept beyond the noise.

Pure: measured costs in, a :class:`Choice` out, no process group and no clock, so the policy is
tested on synthetic timings. A candidate is a schedule and a micro-batch count (``chunks``
dividing the batch). Its step is :func:`lightning_accel.pipeline.schedule_clock.step_time` of its
own order with each stage's measured forward (F), input-gradient (I) and weight-gradient (W)
seconds per micro-batch, a whole backward (B) costing I + W. A micro-batch's cost is a fixed part
plus a part per row (:class:`StageCosts`, fitted on two micro-batch sizes): a per-row model alone
would always favour more micro-batches (a smaller bubble for the same work), which the per
micro-batch overhead of a real stage, and of a send, denies. Its peak activations are
:func:`~lightning_accel.pipeline.schedule_clock.peak_activations` with each stage's measured bytes
per row; a candidate over the memory budget is never chosen.

What the meter does not see is fitted, not assumed (:class:`Residual`, :func:`fit_residual`): each action
also costs time outside its timed F, I or W (torch's schedule runtime, the sends and receives and
their waits), and each step some more once (the optimizer, the barriers). The start is measured at two
micro-batch counts, so the measured minus the predicted step at both fits a cost per action and one per
step; every candidate's clock then runs with that cost added to each of its own actions. Without it
the clock undercounts what more micro-batches cost (twice the micro-batches, twice the actions): on
the bench's balanced zbv start it predicted zbv/2 1-5% under zbv/4 where the sweep measured 10-16%.

Switching is decided as the prefetch tuner decides to leave the user's loader
(:func:`lightning_accel.prefetch.search.noise`): the best candidate replaces the current setting only
when its predicted step is shorter than the current setting's predicted step by more than twice
the combined standard error of the measurement (the current setting's measured steps, their spread
carried to the candidate in proportion). Both sides are predicted by the same clock with the same
residual, so the per-step part cancels and the per-action part counts as often as each side acts;
the measured step is reported beside.

Placement: today only candidates that keep the current stages on their ranks are considered
(:func:`same_placement`): one stage per rank (``gpipe``, ``1f1b``), looped (``interleaved_1f1b``,
``interleaved_zb``) or V-shaped (``zbv``, ``dualpipev``). Moving to another placement would move
parameters and optimizer state between ranks at the switch; that is not done.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import mean

from lightning_accel.pipeline.schedule import SCHEDULE_TABLE, SCHEDULES, check_schedule
from lightning_accel.pipeline.schedule_clock import Orders, peak_activations, schedule_orders, step_time
from lightning_accel.prefetch.search import noise, spread

__all__ = [
    "AutoSchedule", "Choice", "Prediction", "Residual", "Setting", "StageCosts", "candidates", "choose", "fit_residual",
    "same_placement",
]

Setting = tuple[str, int]  # (schedule, chunks)


@dataclass(frozen=True)
class AutoSchedule:
    """``schedule=AutoSchedule(...)`` (or ``"auto"``, these defaults): measure ``start`` for ``steps`` steps at its
    ``chunks`` and ``steps`` more at a second count (each after one step to warm up), then switch once.

    ``max_activation_bytes``: a candidate whose predicted peak activations on a rank exceed it is never chosen (on CUDA
    the device's free memory at the decision bounds it too). ``max_chunks``: the largest micro-batch count considered.
    """

    start: str = "1f1b"
    steps: int = 3
    max_activation_bytes: int | None = None
    max_chunks: int = 32

    def __post_init__(self) -> None:
        if self.start not in SCHEDULE_TABLE:
            raise ValueError(f"AutoSchedule(start={self.start!r}): choose one of {', '.join(SCHEDULES)}")
        if self.steps < 2:
            raise ValueError(f"AutoSchedule(steps={self.steps}): at least 2 steps per measurement, for their spread")


@dataclass(frozen=True)
class StageCosts:
    """Measured per stage: seconds of each action per micro-batch, ``fixed[kind][s] + per_row[kind][s] * rows``
    (kind F, I, W), and activation bytes per row ``held_per_row[s]``."""

    fixed: Mapping[str, Sequence[float]]
    per_row: Mapping[str, Sequence[float]]
    held_per_row: Sequence[float]

    @property
    def stages(self) -> int:
        return len(self.held_per_row)

    def seconds(self, kind: str, stage: int, rows: float) -> float:
        if kind == "B":
            return self.seconds("I", stage, rows) + self.seconds("W", stage, rows)
        return max(0.0, self.fixed[kind][stage] + self.per_row[kind][stage] * rows)

    @classmethod
    def fit(cls, samples: Mapping[tuple[str, int], Sequence[tuple[float, float]]], held: Mapping[int, Sequence[tuple[float, float]]]) -> StageCosts:
        """From ``samples[(kind, stage)]`` = [(rows, seconds), ...] at one or two micro-batch sizes (a line through the two
        sizes' means; one size: all per row) and ``held[stage]`` = [(rows, bytes), ...]."""
        stages = 1 + max(s for _, s in samples)
        fixed: dict[str, list[float]] = {k: [0.0] * stages for k in "FIW"}
        per_row: dict[str, list[float]] = {k: [0.0] * stages for k in "FIW"}
        for (kind, s), points in samples.items():
            by_rows: dict[float, list[float]] = {}
            for rows, seconds in points:
                by_rows.setdefault(rows, []).append(seconds)
            sizes = sorted(by_rows)
            if len(sizes) == 1:
                per_row[kind][s] = mean(by_rows[sizes[0]]) / sizes[0]
                continue
            (r0, r1), (t0, t1) = (sizes[0], sizes[-1]), (mean(by_rows[sizes[0]]), mean(by_rows[sizes[-1]]))
            slope = max(0.0, (t1 - t0) / (r1 - r0))
            per_row[kind][s], fixed[kind][s] = slope, max(0.0, t0 - slope * r0)
        held_per_row = [max((b / r for r, b in held.get(s, [])), default=0.0) for s in range(stages)]
        return cls(fixed, per_row, held_per_row)


@dataclass(frozen=True)
class Residual:
    """What a step costs beyond its actions' metered F, I and W: ``per_action_s`` on every action of the schedule's
    order (torch's runtime around it, its sends and receives and their waits), ``per_step_s`` once per step (may be
    negative: what the clock over-counts). ``fitted_on``: the micro-batch counts whose measured steps gave it."""

    per_action_s: float = 0.0
    per_step_s: float = 0.0
    fitted_on: tuple[int, ...] = ()

    def describe(self) -> str:
        on = f" (fitted on chunks={','.join(map(str, self.fitted_on))}'s measured steps)" if self.fitted_on else ""
        return f"{self.per_action_s * 1e3:.2f} ms per action and {self.per_step_s * 1e3:.1f} ms per step beyond F/I/W{on}"


def _clock(orders: Orders, costs: StageCosts, rows: float, per_action_s: float) -> float:
    return step_time(orders, costs.stages, lambda kind, s: costs.seconds(kind, s, rows) + per_action_s)


def fit_residual(costs: StageCosts, ranks: int, batch: int, schedule: str, measured: Mapping[int, Sequence[float]]) -> Residual:
    """The :class:`Residual` under which ``schedule``'s clock gives the mean of ``measured[chunks]`` (the measured steps
    at each micro-batch count) at the fewest and the most counts measured: the cost per action is what makes the
    predicted difference between them the measured one (0 when the clock already predicts at least that: no
    negative cost, which would favour more micro-batches), the cost per step what is left, averaged over the counts.
    One count measured: no residual (nothing tells a cost per action from one per step)."""
    counts = sorted(m for m, steps in measured.items() if steps)
    if len(counts) < 2:
        return Residual()
    few, many = counts[0], counts[-1]
    orders = {m: schedule_orders(schedule, ranks, m) for m in (few, many)}
    gap = mean(measured[many]) - mean(measured[few])

    def excess(r: float) -> float:  # predicted minus measured difference: rises with r (more actions on many's path)
        return _clock(orders[many], costs, batch / many, r) - _clock(orders[few], costs, batch / few, r) - gap

    per_action = 0.0
    if excess(0.0) < 0:
        low, high = 0.0, 1e-4
        while excess(high) < 0 and high < 10.0:
            low, high = high, 2 * high
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (mid, high) if excess(mid) < 0 else (low, mid)
        per_action = high
    per_step = mean(mean(measured[m]) - _clock(orders[m], costs, batch / m, per_action) for m in (few, many))
    return Residual(per_action, per_step, (few, many))


@dataclass(frozen=True)
class Prediction:
    setting: Setting
    step_s: float
    peak_bytes: float


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided: ``chosen`` (the current setting when nothing beats it beyond the noise)."""

    chosen: Setting
    current: Prediction
    best: Prediction
    measured_s: float  # mean measured step of the current setting
    noise_s: float
    considered: list[Prediction] = field(default_factory=list)
    over_budget: list[Setting] = field(default_factory=list)
    residual: Residual = Residual()

    @property
    def switches(self) -> bool:
        return self.chosen != self.current.setting

    def report(self) -> str:
        """One line: what was chosen and why."""
        cur, best = self.current, self.best
        head = (f"schedule='auto': {'switched to' if self.switches else 'kept'} {_name(self.chosen)}; predicted "
                f"{best.step_s * 1e3:.1f} ms/step vs {_name(cur.setting)}'s {cur.step_s * 1e3:.1f} ms predicted, "
                f"{self.measured_s * 1e3:.1f} ms measured (noise {self.noise_s * 1e3:.1f} ms)")
        if not self.switches and best.setting != cur.setting:
            head += f"; best {_name(best.setting)} gains less than the noise"
        head += f"; {self.residual.describe()}"
        rest = ", ".join(f"{_name(p.setting)} {p.step_s * 1e3:.1f}" for p in sorted(self.considered, key=lambda p: p.step_s))
        tail = f"; {len(self.considered)} candidates (ms predicted): {rest}"
        if self.over_budget:
            tail += f"; over the activation budget: {', '.join(_name(s) for s in self.over_budget)}"
        return head + tail + "; candidates keep the current stage placement (re-placement not done)"


def _name(setting: Setting) -> str:
    return f"{setting[0]}/chunks={setting[1]}"


def same_placement(schedule: str) -> list[str]:
    """The schedules whose stages sit on the ranks where ``schedule``'s do (switching among them moves no weights)."""
    placement = SCHEDULE_TABLE[schedule].placement
    return [name for name, spec in SCHEDULE_TABLE.items() if spec.placement == placement]


def candidates(schedule: str, batch: int, stages: int, max_chunks: int) -> list[Setting]:
    """Every schedule of ``schedule``'s placement with every micro-batch count up to ``max_chunks`` that divides the
    ``batch`` and that schedule runs on ``stages`` stages."""
    out = []
    for name in same_placement(schedule):
        for m in range(1, min(batch, max_chunks) + 1):
            if batch % m:
                continue
            try:
                check_schedule(name, m, stages)
            except ValueError:
                continue
            out.append((name, m))
    return out


def predict(setting: Setting, costs: StageCosts, ranks: int, batch: int, residual: Residual = Residual()) -> Prediction:
    """``setting``'s step and peak activations per rank by the schedule's own clock with ``costs``, each action
    costing ``residual.per_action_s`` more and the step ``residual.per_step_s`` more."""
    name, chunks = setting
    rows = batch / chunks
    orders = schedule_orders(name, ranks, chunks)
    cost = lambda kind, s: costs.seconds(kind, s, rows) + residual.per_action_s  # noqa: E731
    held = {s: costs.held_per_row[s] * rows for s in range(costs.stages)}
    step = step_time(orders, costs.stages, cost) + residual.per_step_s
    return Prediction(setting, step, peak_activations(orders, costs.stages, cost, held))


@dataclass(frozen=True)
class _Spread:
    spread_s: float  # what prefetch.search.noise reads of a measurement


def choose(
    costs: StageCosts, ranks: int, batch: int, current: Setting, measured_s: Sequence[float],
    settings: Iterable[Setting], max_activation_bytes: float | None = None, residual: Residual = Residual(),
) -> Choice:
    """The candidate of ``settings`` with the shortest predicted step (``residual`` added to each:
    :func:`fit_residual`) within the activation budget, chosen over ``current`` only when it gains more than the
    noise of ``measured_s`` (the current setting's measured steps)."""
    now = predict(current, costs, ranks, batch, residual)
    considered, over = [], []
    for setting in settings:
        p = now if setting == current else predict(setting, costs, ranks, batch, residual)
        if max_activation_bytes is not None and p.peak_bytes > max_activation_bytes:
            over.append(setting)
            continue
        considered.append(p)
    if not considered:
        raise ValueError(
            f"schedule='auto': every candidate's predicted peak activations exceed max_activation_bytes="
            f"{max_activation_bytes:.0f}; raise it, or set checkpoint='always'"
        )
    # a tie: the current setting, then fewer activations (1f1b over gpipe), then fewer micro-batches
    best = min(considered, key=lambda p: (p.step_s, p.setting != current, p.peak_bytes, p.setting[1]))
    measured = mean(measured_s)
    here = spread(list(measured_s))
    there = here * best.step_s / now.step_s if now.step_s > 0 else here
    margin = noise(_Spread(here), _Spread(there))  # type: ignore[arg-type]  # it reads only spread_s
    fits_now = max_activation_bytes is None or now.peak_bytes <= max_activation_bytes
    switch = best.setting != current and (now.step_s - best.step_s > margin or not fits_now)
    return Choice(best.setting if switch else current, now, best, measured, margin, considered, over, residual)
