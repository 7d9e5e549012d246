"""When a candidate loader takes over: how many batches the current one still serves.

A candidate's workers start in the background; until their first batches are ready,
the current loader keeps serving. Each batch of this lead trades a slow batch from
the current loader for a fast one later, which pays while the new workers would not
be ready anyway; past that it only costs waiting. So the lead is about the time the new
workers take to start (forking each one; measured, about 80 ms per worker under a load
average of 6 on 2 cores) plus one item's time (what a new worker needs for its first batch)
over the current time per step, the item stretched when the new workers outnumber the
cores and their items need the CPU: I/O waits overlap on any number of cores, computation
does not. A lead too short is paid in full: the hand-over then blocks until the new workers
deliver (measured: 0.95 s at the bench stream's hand-over to 8 workers, against a lead of 1).
"""

from __future__ import annotations

import math

__all__ = ["handover_lead"]


def handover_lead(
    current_workers: int,
    current_interval_s: float | None,
    candidate_workers: int,
    step_s: float,
    cores: int,
    cpu_share: float = 1.0,
    max_lead: int = 16,
    start_s: float = 0.0,
) -> int:
    """Batches (>= 1, <= ``max_lead``) the current loader serves before the candidate takes over.

    Args:
        current_workers: the current loader's ``num_workers``.
        current_interval_s: its measured seconds between batches, ``None`` if not measured.
        candidate_workers: the candidate's ``num_workers``.
        step_s: seconds a training step takes.
        cores: CPU cores the new workers share.
        cpu_share: CPU seconds per second of making an item (measured when this process
            did the loading itself; 1.0, the cautious value, when unknown).
        start_s: seconds the candidate's workers take to start, before their first item.
    """
    if current_workers == 0 or current_interval_s is None:
        item_s = current_interval_s if current_interval_s is not None else step_s
        period = item_s + step_s  # no overlap: each step waits for its item, then computes
    else:
        item_s = current_interval_s * current_workers  # each worker takes w intervals per batch
        period = max(step_s, current_interval_s)
    period = max(period, 1e-6)
    share = min(1.0, max(0.0, cpu_share))
    crowd = max(1.0, candidate_workers * share / max(1, cores))
    return max(1, min(max_lead, math.floor(1.1 * (max(0.0, start_s) + item_s * crowd) / period)))
