"""A train loader whose worker settings can change between two batches without losing its place.

For a map-style dataset the epoch's batches are drawn once from the user's (batch)
sampler; the inner ``DataLoader`` serves them from a plan. A switch builds a new inner
loader over the batches not yet handed out, so no sample is duplicated or lost: batches
the old workers had prefetched but not delivered are dropped and served again by the
new ones. An iterable dataset cannot be resumed part-way, so there a switch takes
effect at the next epoch. Between switches the inner loader lives on, so
``persistent_workers`` keeps its workers across epochs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from lightning_accel.prefetch.loader_rebuild import (
    check_rebuildable,
    is_iterable,
    more_workers_than_cores,
    rebuild_loader,
    settings_of,
)
from lightning_accel.prefetch.settings import LoaderSettings


class _Plan:
    """The index batches (or indices) the inner loader serves next; set before each ``iter``."""

    def __init__(self) -> None:
        self.items: list = []

    def __iter__(self) -> Iterator:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


class TunableLoader:
    """Wraps the user's ``DataLoader``; ``switch(settings)`` applies at the next batch (map-style) or epoch."""

    def __init__(self, loader: DataLoader) -> None:
        check_rebuildable(loader, workers=False)
        self.loader = loader
        self.settings = settings_of(loader)
        self.switches = 0  # how many times an inner loader was replaced (for tests and reports)
        self._pending: LoaderSettings | None = None
        self._plan = _Plan()
        self._inner: DataLoader | None = None
        self._iterator: Any = None
        self._batches: list | None = None  # this epoch's batches while a map-style epoch runs
        self._consumed = 0
        # From now on the user's loader is only a template; free the workers it may keep alive.
        if loader.persistent_workers and getattr(loader, "_iterator", None) is not None:
            loader._iterator._shutdown_workers()
            loader._iterator = None

    # Lightning reads these (set_epoch on the sampler under DDP, length for the epoch).
    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    @property
    def batch_sampler(self) -> Any:
        return self.loader.batch_sampler

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def switch(self, settings: LoaderSettings) -> None:
        """Use ``settings`` from the next batch (map-style, mid-epoch) or the next epoch (iterable).

        Mid-epoch, the new workers start here, so they fetch while the current step
        finishes instead of after it.
        """
        if settings == self.settings:
            return
        check_rebuildable(self.loader, workers=settings.num_workers > 0)
        self._pending = settings
        if self._batches is not None:  # a map-style epoch is under way: resume it on new workers now
            self._apply_pending()
            self._plan.items = self._batches[self._consumed :]
            self._iter_inner()

    def _apply_pending(self) -> None:
        if self._pending is not None:
            self.close()
            self.settings, self._pending = self._pending, None
            self.switches += 1

    def close(self) -> None:
        """Shut down the inner loader's workers now rather than at garbage collection."""
        shutdown = getattr(self._iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._iterator = None
        self._inner = None

    def _iter_inner(self) -> Iterator:
        if self._inner is None:
            plan = None if is_iterable(self.loader) else self._plan
            self._inner = rebuild_loader(self.loader, self.settings, plan)
        with more_workers_than_cores():
            self._iterator = iter(self._inner)
        return self._iterator

    def __iter__(self) -> Iterator:
        self._apply_pending()
        if is_iterable(self.loader):
            yield from self._iter_inner()
            return
        source = self.loader.batch_sampler if self.loader.batch_sampler is not None else self.loader.sampler
        self._batches = list(source)  # this epoch's order, drawn from the user's sampler exactly once
        self._consumed = 0
        self._plan.items = self._batches
        self._iter_inner()
        try:
            while True:
                try:
                    batch = next(self._iterator)  # switch() may have replaced it since the last batch
                except StopIteration:
                    return
                self._consumed += 1
                yield batch
        finally:
            self._batches = None
