"""The prefetch tuner's settings in one object: what :class:`PrefetchTuner` is given, read by every part of the search.

:class:`~lightning_accel.callbacks.PrefetchTuner` builds one :class:`TunerOptions` from
its constructor arguments (the names Hydra recipes pass) and keeps no copy of any field;
:class:`~lightning_accel.prefetch.online.OnlineSearch` and the loader wrap read the same
object. The fields past ``stream_switch`` steer the online search's heuristics and have
no constructor argument: set them on ``tuner.options`` before fit. Values are checked
here, once, before any work, each refusal naming the value and what to pass instead.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from lightning_accel.prefetch.search import Budget
from lightning_accel.prefetch.tunable_loader import check_stream_switch

__all__ = ["TunerOptions"]


def _positive_int(name: str, value: object, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer; pass {hint}")


@dataclass
class TunerOptions:
    """Every setting of the prefetch tuner (see :class:`~lightning_accel.callbacks.PrefetchTuner` for the first eight).

    Attributes past ``stream_switch`` (see :class:`~lightning_accel.prefetch.online.OnlineSearch`):
        early: start the likely first candidate's workers while the start is measured.
        speculate: with ``early``, start workers already while a slow first batch loads.
        guess: let the start's measurement pick where the doubling starts.
        max_lead: steps a candidate's workers may fill up before taking over.
        remeasure: an undecided candidate is measured on up to this many times its usual batches.
        cpu_busy_threshold: workers' CPU share above which items count as CPU-bound.
    """

    max_workers: int | None = None
    memory_budget_bytes: int | None = None
    warmup_steps: int = 1
    trial_steps: int = 3
    max_search_steps: int = 30
    cache_path: str | None = None
    data_bound_fraction: float = 0.1
    stream_switch: str = "next_epoch"
    early: bool = True
    speculate: bool = True
    guess: bool = True
    max_lead: int = 16
    remeasure: int = 4
    cpu_busy_threshold: float = 0.5

    def __post_init__(self) -> None:
        if self.max_workers is not None or self.memory_budget_bytes is not None:
            # a value left as None is checked as a valid placeholder
            Budget(1 if self.max_workers is None else self.max_workers,
                   1 if self.memory_budget_bytes is None else self.memory_budget_bytes)
        warmup = self.warmup_steps
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup_steps={warmup!r} must be an integer >= 0; pass warmup_steps=1")
        _positive_int("trial_steps", self.trial_steps, "trial_steps=3")
        _positive_int("max_search_steps", self.max_search_steps, "max_search_steps=30")
        if warmup + self.trial_steps >= self.max_search_steps:
            raise ValueError(
                f"warmup_steps + trial_steps = {warmup + self.trial_steps} leaves no room within "
                f"max_search_steps={self.max_search_steps}; lower them or raise max_search_steps"
            )
        if not 0 < self.data_bound_fraction < 1:
            raise ValueError(
                f"data_bound_fraction={self.data_bound_fraction!r} must lie strictly between 0 and 1; pass e.g. 0.1"
            )
        check_stream_switch(self.stream_switch)


OPTION_NAMES = frozenset(f.name for f in fields(TunerOptions))
