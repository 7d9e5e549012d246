"""The tuner's report: what was measured, tried and chosen, as a table and as CSV.

Plain text from plain data, so a search that never ran (a cache hit, a loader kept as it
was) reports its one line the same way as one that tried every candidate. The SVG of the
same trials is :func:`~lightning_accel.prefetch.plot.trials_svg`.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_accel.prefetch.search import PrefetchSearch, Trial
from lightning_accel.prefetch.settings import LoaderSettings
from lightning_accel.prefetch.wait_meter import WaitStats
from lightning_accel.table import format_table

__all__ = ["search_report", "trials_csv"]


def search_report(
    reason: str,
    measured: WaitStats | None = None,
    search: PrefetchSearch | None = None,
    chosen: LoaderSettings | None = None,
    finished_step: int | None = None,
    measurement_cost_s: float = 0.0,
    cpu_note: str = "",
    start_note: str = "",
) -> str:
    """``PrefetchTuner: <reason>``, then the start's measurement and one row per trial, if there were any;
    the notes (CPU-bound items, a start restated from its first candidate's workers) close it."""
    lines = [f"PrefetchTuner: {reason}"]
    if measured is not None:
        lines.append(
            f"  measured over {measured.steps} steps: wait {1000 * measured.wait_s:.1f} ms, "
            f"step {1000 * measured.step_s:.1f} ms ({100 * measured.wait_fraction:.0f}% waiting)"
        )
    if search is not None and search.trials:
        budget = search.budget
        rows = [
            [
                t.settings.label(),
                f"{1000 * t.interval_s:.1f} +- {1000 * t.spread_s:.1f}",
                1000 * t.wait_s,
                f"{t.settings.buffered_batches * search.batch_bytes / 2**20:.0f}",
                "<- chosen" if chosen == t.settings else ("start" if i == 0 else ""),
            ]
            for i, t in enumerate(search.trials)
        ]
        table = format_table(["settings", "ms/batch +- s.e.", "pred. wait ms", "buffer MiB", ""], rows)
        lines += ["  " + line for line in table.splitlines()]
        lines.append(
            f"  budget per rank: {budget.max_workers} workers, {budget.memory_bytes / 2**20:.0f} MiB; "
            f"search over by step {finished_step}; measurement cost {measurement_cost_s:.1f} s"
        )
        lines += [f"  {note}" for note in (start_note, cpu_note) if note]
    return "\n".join(lines)


def trials_csv(trials: Sequence[Trial]) -> str:
    """``settings,ms_per_batch,batches_per_s`` per trial: throughput against the settings tried."""
    rows = ["num_workers,prefetch_factor,pin_memory,ms_per_batch,batches_per_s"]
    for t in trials:
        s = t.settings
        rate = 1.0 / t.interval_s if t.interval_s > 0 else float("inf")
        rows.append(f"{s.num_workers},{s.prefetch_factor or 0},{int(s.pin_memory)},{1000 * t.interval_s:.3f},{rate:.3f}")
    return "\n".join(rows) + "\n"
