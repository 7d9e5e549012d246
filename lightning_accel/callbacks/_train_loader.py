"""Swapping the train loader of a running ``Trainer`` at ``on_train_start``.

By ``on_train_start`` Lightning 2.6 has processed the train loader (distributed sampler
injected, limits computed) and already called ``iter()`` on it in
``FitLoop.setup_data``. Replacing the entry in ``fit_loop._combined_loader.flattened``
and calling ``iter()`` on the data fetcher again makes the first epoch, and every later
one, draw from the replacement; no batch has been trained on yet, so nothing is lost. The
length is unchanged, so the limits Lightning computed stay valid. A torchdata
``StatefulDataLoader`` hands its iterator's state over, so the replacement serves the
order that loader would have, mid-epoch after a resume included; any other loader is
kept when fit resumed part-way through an epoch (its position is unknown).

For a loader without a length (a stream), Lightning's fetcher has already read one batch
ahead, and without workers that read moved the dataset's own position. A replacement
that resumes from that position is handed those batches to serve first
(``serve_first``), when the fetcher's batches are the loader's own (a single loader
passed as itself); otherwise it is told to ``rewind`` by the batches read and reads them
again, or they would never be trained on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from lightning_accel.prefetch.loader_state import is_stateful_loader


def swap_train_loader(trainer: pl.Trainer, wrap: Callable[[Any], Any]) -> str | None:
    """Replace the single train loader ``L`` with ``wrap(L)``; returns why not, or ``None`` on success."""
    fit_loop = trainer.fit_loop
    combined = fit_loop._combined_loader
    if combined is None or fit_loop._data_fetcher is None:
        return "no train loader is set up"
    loaders = list(combined.flattened)
    if len(loaders) != 1:
        return f"{len(loaders)} train loaders; only a single train loader is supported"
    stateful = is_stateful_loader(loaders[0])
    if fit_loop.epoch_loop.batch_progress.current.ready and not stateful:
        return "fit resumed part-way through an epoch"
    replacement = wrap(loaders[0])
    if stateful and hasattr(replacement, "load_state_dict"):
        # The user's iterator stands where the checkpoint left it (or at the epoch's start):
        # the replacement serves the same order from there.
        replacement.load_state_dict(loaders[0].state_dict())
    read_here = _batches_read_in_process(combined)
    if read_here:
        ahead = _read_ahead(fit_loop._data_fetcher, combined, read_here)
        served = ahead is not None and hasattr(replacement, "serve_first") and replacement.serve_first(ahead)
        if not served and hasattr(replacement, "rewind"):
            replacement.rewind(read_here)
    combined.flattened = [replacement]
    iter(fit_loop._data_fetcher)  # re-create the epoch iterator over the replacement
    return None


def _read_ahead(fetcher: Any, combined: Any, count: int) -> list | None:
    """The ``count`` batches the fetcher read ahead, as the user's loader made them; ``None`` where the
    combined loader wraps them in a structure of several loaders' batches (its spec is not a leaf)."""
    fetched = getattr(fetcher, "batches", None)
    is_leaf = getattr(getattr(combined, "_spec", None), "is_leaf", None)
    if not isinstance(fetched, list) or len(fetched) != count or not callable(is_leaf) or not is_leaf():
        return None
    if not all(isinstance(item, tuple) and len(item) == 3 for item in fetched):  # (batch, batch_idx, dataloader_idx)
        return None
    return [item[0] for item in fetched]


def _batches_read_in_process(combined: Any) -> int:
    """Batches the single train loader's current iterator has read in this process (it has no workers)."""
    iterators = getattr(getattr(combined, "_iterator", None), "iterators", None) or []
    if len(iterators) != 1 or getattr(iterators[0], "_num_workers", None) != 0:
        return 0
    return int(getattr(iterators[0], "_num_yielded", 0))
