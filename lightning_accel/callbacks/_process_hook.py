"""Wrapping the fit's train ``DataLoader`` as Lightning processes it, before the fit loop reads from it.

``FitLoop.setup_data`` (Lightning 2.6) requests the train loader, injects the distributed
sampler, lets the strategy process it (``Strategy.process_dataloader``) and then calls
``iter()`` on its data fetcher, which, for a loader without a length, reads one whole
batch ahead, all before the first callback hook of the fit loop (``on_train_start``). A
callback that swaps the loader at ``on_train_start`` therefore meets a stream whose first
batch was already loaded by the user's loader: without workers, in this process, with
nothing watching (0.2 s on the bench's latency stream, where hand-set workers, forked at
that ``iter()``, had it and the next one made in parallel).

:class:`TrainLoaderHook` wraps the strategy's ``process_dataloader`` of one trainer for
the length of a fit: the fit's train loader (the first one processed while the trainer's
stage is training, so not the sanity check's or validation's loaders) passes through
``wrap`` after the strategy's own processing, so distributed samplers are already in
place (and a strategy that turns it into something else, torch_xla's ``MpDeviceLoader``,
hands ``wrap`` that). Lightning's own worker seeding (``seed_everything(workers=True)``)
only handles a ``DataLoader``, and runs after the strategy; it is applied here before the
wrap. The wrapper then owns the fetcher's first read.

It is the one way a callback here replaces the train loader: :class:`PrefetchTuner` wraps
it in its tunable loader, :class:`DevicePrefetcher` in a device copy (after the tuner,
over the tuned loader: hooks stack, the last installed wraps what the one below returns).
Checkpoint states are loaded afterwards, into the wrapper (Lightning's
``_load_combined_loader_states``), so a wrapper over a ``StatefulDataLoader`` must carry
its state; :func:`resumed_mid_epoch` tells the callbacks when a loader that cannot report
its position must be kept instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import _auto_add_worker_init_fn
from torch.utils.data import DataLoader

from lightning_accel.patching import patch

__all__ = ["TrainLoaderHook", "resumed_mid_epoch"]


class TrainLoaderHook:
    """Until :meth:`remove`, the fit's train loader is replaced by ``wrap(loader)`` as it is processed.

    ``wrap`` returns the replacement, or the loader itself to keep it; it is called at most
    once per hook: with several train loaders, on the first (the caller learns how many at
    ``on_train_start``); a fit's later reloads of the train loader pass through untouched.
    """

    def __init__(self, trainer: pl.Trainer, wrap: Callable[[DataLoader], Any]) -> None:
        self.trainer = trainer
        self.wrap = wrap
        self.fired = False
        self.removed = False
        self._strategy = trainer.strategy
        self._original = self._strategy.process_dataloader
        # an instance attribute over the class's method; remove() puts back whichever was there
        self._patch = patch(self._strategy, "process_dataloader", self._process)

    def _process(self, dataloader: object) -> object:
        processed = self._original(dataloader)
        if self.fired or self.removed or not self.trainer.training:
            return processed
        self.fired = True
        if isinstance(processed, DataLoader):
            _auto_add_worker_init_fn(processed, self.trainer.global_rank)  # after us, Lightning sees the wrapper
        return self.wrap(processed)

    def remove(self) -> None:
        """Restore the strategy's own ``process_dataloader`` (where another wrapper was installed over this
        one since, this one passes through from now on)."""
        self.removed = True
        # Stacked hooks (the tuner's, then DevicePrefetcher's over it) may be removed in either order: the top
        # one takes itself off, then each one below that was removed already, so the strategy's own shows through.
        while True:
            top = vars(self._strategy).get("process_dataloader")
            hook = getattr(top, "__self__", None)
            if not (isinstance(hook, TrainLoaderHook) and hook.removed and top == hook._process):
                return
            hook._patch.remove()
            if vars(self._strategy).get("process_dataloader") == top:  # its patch had been taken off already
                return


def resumed_mid_epoch(trainer: pl.Trainer) -> bool:
    """Fit resumed from a checkpoint taken part-way through an epoch (the loop's progress is restored before
    the train loader is processed): a loader that cannot report its position must serve the rest unwrapped."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return bool(progress.current.ready) and not progress.is_last_batch
