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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import _auto_add_worker_init_fn
from torch.utils.data import DataLoader

from lightning_accel.patching import patch

__all__ = ["TrainLoaderHook"]


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
        if vars(self._strategy).get("process_dataloader") == self._process:
            self._patch.remove()
