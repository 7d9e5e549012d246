"""The checkpoint state of a tuned map-style loader, in the format of the user's ``StatefulDataLoader``.

Lightning checkpoints a train loader that has ``state_dict``/``load_state_dict`` and, on
resume, loads that state into the loader the user's code returns: torchdata's
``StatefulDataLoader`` for exact mid-epoch resume. Once ``PrefetchTuner`` serves the epoch
from inner loaders of its own, the state saved must still be the one the user's loader
would have after the same batches, or a resumed run (tuned or not) would replay or skip
some. Rather than write torchdata's format by hand, an *index twin* computes it: a
``StatefulDataLoader`` with the user's batch sampler, ``num_workers`` and settings over a
dataset that returns its indices (no I/O, no decoding). The twin draws each epoch's
batches, recording its state at the epoch's start; the state after ``n`` batches is a
second twin, loaded with that start state and advanced by ``n`` index batches, asked
for its ``state_dict``: torchdata's own code writes the format. That second twin works on
a copy of the sampler and its generator, under a forked global RNG, so neither the user's
sampler nor any random stream training uses moves: a checkpoint changes nothing.

Random numbers: drawing an epoch through the twin consumes what the user's loader would
(its base seed, from the loader's generator or the global one, and the sampler's
permutation), so a tuned run draws the same orders as an untuned one.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset


class _Indices(Dataset):
    """Item ``i`` is ``i``: the twin serves index batches at no cost."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _identity(batch: Any) -> Any:
    return batch


def is_stateful_loader(loader: Any) -> bool:
    """A torchdata ``StatefulDataLoader`` (the state format this module reproduces)."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return False
    return isinstance(loader, StatefulDataLoader)


class IndexTwin:
    """Draws a map-style ``StatefulDataLoader``'s epochs as index batches and gives its state after ``n`` of them."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self._start: dict[str, Any] | None = None  # the twin's state where the current epoch (or resume) began
        self._resume: dict[str, Any] | None = None  # loaded by load_state_dict, used by the next epoch

    def _twin(self, batch_sampler: Any, generator: torch.Generator | None) -> DataLoader:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = self.loader
        w = loader.num_workers
        if loader.batch_sampler is None:  # batch_size=None: the sampler yields single indices
            kwargs: dict[str, Any] = dict(batch_size=None, sampler=batch_sampler)
        else:
            kwargs = dict(batch_sampler=batch_sampler)
        return StatefulDataLoader(
            _Indices(len(loader.dataset)),  # type: ignore[arg-type]
            num_workers=w,
            collate_fn=_identity,
            generator=generator,
            multiprocessing_context=loader.multiprocessing_context if w else None,
            **kwargs,
        )

    def _sampler(self) -> Any:
        return self.loader.batch_sampler if self.loader.batch_sampler is not None else self.loader.sampler

    def draw_epoch(self) -> list:
        """This epoch's (remaining, after a loaded state) batches of indices, advancing the user's sampler once."""
        resume, self._resume = self._resume, None
        # A resumed epoch's order comes from the state; the twin's own draws must not move the global RNG.
        with torch.random.fork_rng(devices=[]) if resume is not None else contextlib.nullcontext():
            twin = self._twin(self._sampler(), self.loader.generator)
            if resume is not None:
                twin.load_state_dict(resume)
            self._start = twin.state_dict()  # before any batch: where this epoch (or its resumed part) begins
            return list(twin)

    def state_after(self, n: int) -> dict[str, Any]:
        """The user's loader's ``state_dict()`` had it served the first ``n`` batches of :meth:`draw_epoch`."""
        if self._start is None:
            return self._resume if self._resume is not None else {}
        dataset = self.loader.dataset
        # Copies (sharing only the dataset): the user's sampler and generator are not rewound.
        sampler, generator = copy.deepcopy((self._sampler(), self.loader.generator), memo={id(dataset): dataset})
        with torch.random.fork_rng(devices=[]):
            twin = self._twin(sampler, generator)
            twin.load_state_dict(self._start)
            iterator = iter(twin)
            for _ in range(n):
                next(iterator)
            state = twin.state_dict()
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next epoch drawn resumes from ``state`` (one the user's loader, or :meth:`state_after`, wrote)."""
        self._resume = state if state else None
        self._start = None
