"""Swapping the train loader of a running ``Trainer`` at ``on_train_start`` (:class:`DevicePrefetcher`).

By ``on_train_start`` Lightning 2.6 has processed the train loader (distributed sampler
injected, limits computed) and already called ``iter()`` on it in
``FitLoop.setup_data``. Replacing the entry in ``fit_loop._combined_loader.flattened``
and calling ``iter()`` on the data fetcher again makes the first epoch, and every later
one, draw from the replacement; no batch has been trained on yet. The length is
unchanged, so the limits Lightning computed stay valid. A loader is kept when fit resumed
part-way through an epoch unless it reports its position (torchdata's
``StatefulDataLoader``, which Lightning restored before that ``iter()``).

For a loader without a length Lightning's fetcher has already read one batch ahead by
then; the replacement reads the loader afresh. :class:`PrefetchTuner` does not swap here:
it wraps the loader before that read (:mod:`~lightning_accel.callbacks._process_hook`).
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
    if fit_loop.epoch_loop.batch_progress.current.ready and not is_stateful_loader(loaders[0]):
        return "fit resumed part-way through an epoch"
    combined.flattened = [wrap(loaders[0])]
    iter(fit_loop._data_fetcher)  # re-create the epoch iterator over the replacement
    return None
