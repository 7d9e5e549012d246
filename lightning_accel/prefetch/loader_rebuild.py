"""Re-creating a ``DataLoader`` with other worker settings, keeping everything else the user chose.

Kept: dataset, batch size, sampler and shuffle order, ``collate_fn``, ``drop_last``,
``generator``, ``worker_init_fn``, ``timeout``, multiprocessing context. Changed: the
fields of :class:`LoaderSettings`. A loader we cannot copy faithfully (a custom batch
sampler, a dataset that cannot be pickled into spawned workers) raises
:class:`RebuildError` with one line saying why and what to do, so the caller can keep the
user's loader instead of training on a silently different one.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from lightning_accel.prefetch.settings import LoaderSettings


class RebuildError(ValueError):
    """This loader cannot be re-created with other settings; the user's loader stays in use."""


def settings_of(loader: DataLoader) -> LoaderSettings:
    return LoaderSettings(
        num_workers=loader.num_workers,
        prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
        pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers,
    )


def is_iterable(loader: DataLoader) -> bool:
    return isinstance(loader.dataset, IterableDataset)


def check_rebuildable(loader: Any, workers: bool = True) -> None:
    """Raise :class:`RebuildError` unless :func:`rebuild_loader` can copy ``loader`` (with workers if asked)."""
    if not isinstance(loader, DataLoader):
        raise RebuildError(
            f"train loader is a {type(loader).__name__}, not a torch DataLoader; return a DataLoader from "
            "train_dataloader() or drop PrefetchTuner"
        )
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler and not _torchdata_batch_sampler(batch_sampler):
        raise RebuildError(
            f"custom batch_sampler {type(batch_sampler).__name__} cannot be re-created; tune num_workers by hand "
            "or use DataLoader(sampler=..., batch_size=...)"
        )
    if workers:
        context = loader.multiprocessing_context
        method = context.get_start_method() if context is not None else multiprocessing.get_start_method()
        if method != "fork":  # fork copies the dataset; spawn and forkserver pickle it
            try:
                pickle.dumps(loader.dataset)
            except Exception as err:  # pickle raises many types (PicklingError, TypeError, AttributeError)
                raise RebuildError(
                    f"dataset {type(loader.dataset).__name__} cannot be pickled for '{method}' workers ({err}); "
                    "make it picklable or keep num_workers=0"
                ) from None


def _torchdata_batch_sampler(batch_sampler: Any) -> bool:
    """torchdata's stateful ``BatchSampler`` (what a ``StatefulDataLoader`` builds): torch's, plus a state."""
    cls = type(batch_sampler)
    return cls.__name__ == "BatchSampler" and cls.__module__ == "torchdata.stateful_dataloader.sampler"


def rebuild_loader(
    loader: DataLoader,
    settings: LoaderSettings,
    plan: Iterable | None = None,
    collate_fn: Callable | None = None,
    dataset: Any = None,
    generator: Any = None,
) -> DataLoader:
    """A copy of ``loader`` with ``settings`` (and ``collate_fn`` when given, e.g. one wrapping the user's).

    ``plan`` replaces the index source: for a batched map-style loader an iterable of
    index lists (the batches still to serve), for ``batch_size=None`` an iterable of
    indices. Without it the user's own (batch) sampler object is shared, so its
    shuffle order and generator state carry over. ``dataset`` replaces an iterable
    dataset (a copy positioned mid-stream, see ``prefetch.stream``); ``generator`` the
    loader's own (which then seeds only the workers: a plan has no randomness).
    """
    check_rebuildable(loader, workers=settings.num_workers > 0)
    common: dict[str, Any] = dict(
        collate_fn=collate_fn if collate_fn is not None else loader.collate_fn,
        worker_init_fn=loader.worker_init_fn,
        timeout=loader.timeout if settings.num_workers else 0,
        generator=generator if generator is not None else loader.generator,
        multiprocessing_context=loader.multiprocessing_context if settings.num_workers else None,
        pin_memory_device=loader.pin_memory_device,
        **settings.as_kwargs(),
    )
    with more_workers_than_cores():
        if is_iterable(loader):
            source = dataset if dataset is not None else loader.dataset
            return DataLoader(source, batch_size=loader.batch_size, drop_last=loader.drop_last, **common)
        if loader.batch_sampler is None:  # batch_size=None: the sampler yields single indices
            sampler = plan if plan is not None else loader.sampler
            return DataLoader(loader.dataset, batch_size=None, sampler=sampler, **common)
        return DataLoader(loader.dataset, batch_sampler=plan if plan is not None else loader.batch_sampler, **common)


@contextlib.contextmanager
def more_workers_than_cores() -> Iterator[None]:
    """Silence torch's "more workers than cores" warning: for I/O-bound items that is the point."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        yield
