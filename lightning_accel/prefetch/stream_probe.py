"""Tuning a stream that cannot report its position: every candidate probed back to back in one pause.

Such a stream cannot be handed over mid-epoch, so its candidates cannot be measured
while they serve. Each one the search proposes is built and pulled alone for a few
batches (:func:`~lightning_accel.prefetch.probe.measure_loader`); the fastest, if it beats
the start beyond the noise, is switched to, and the loader's ``stream_switch`` says when
it serves: ``"next_epoch"`` (nothing lost or repeated) or ``"restart"`` (now, with the
stream started again from its beginning).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_accel.prefetch.loader_rebuild import RebuildError
from lightning_accel.prefetch.probe import measure_loader
from lightning_accel.prefetch.search import PrefetchSearch
from lightning_accel.prefetch.settings import LoaderSettings
from lightning_accel.prefetch.stream import why_not_resumable
from lightning_accel.prefetch.tunable_loader import TunableLoader

__all__ = ["StreamProbe", "probe_stream"]


@dataclass
class StreamProbe:
    """What :func:`probe_stream` found: ``chosen`` (``None``: the start stays) and why, or the ``error`` that stopped it."""

    chosen: LoaderSettings | None
    reason: str
    cost_s: float  # seconds the probes paused training
    when: str = ""  # when the chosen settings serve, in words
    error: str | None = None  # a candidate could not be built (e.g. a dataset that cannot be pickled into workers)


def probe_stream(search: PrefetchSearch, loader: TunableLoader, start: LoaderSettings) -> StreamProbe:
    """Probe each candidate ``search`` proposes on ``loader``'s template, record it, and switch to the winner."""
    cost = 0.0
    while (candidate := search.propose()) is not None:
        try:
            # Two whole rounds of workers at least: the spread of one round is unknown.
            probe = measure_loader(loader.loader, candidate, min_batches=2 * max(2, candidate.num_workers) + 1)
        except RebuildError as err:
            return StreamProbe(None, "", cost, error=str(err))
        cost += probe.elapsed_s
        search.batch_bytes = max(search.batch_bytes, probe.batch_bytes)
        search.record(candidate, probe.interval_s, probe.spread_s)
    best, baseline = search.best, search.trials[0]
    assert best is not None
    start_fits = search.budget.allows(start, search.batch_bytes)
    if best.settings == start or (start_fits and not search.beats(best, baseline)):
        return StreamProbe(None, "kept your loader: no candidate would wait less by more than the noise", cost)
    try:
        loader.switch(best.settings)
    except RebuildError as err:
        return StreamProbe(None, "", cost, error=str(err))
    why = why_not_resumable(loader.dataset)
    if loader.stream_switch == "restart":
        when = f"serving now, the stream restarted from its beginning ({why}; stream_switch='restart')"
    else:
        when = f"used from the next epoch ({why}); pass stream_switch='restart' to switch now, restarting the stream"
    return StreamProbe(best.settings, f"fastest of {len(search.trials)} probed within the budget, {when}", cost, when)
