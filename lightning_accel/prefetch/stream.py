"""Iterable datasets whose position a loader can hand over mid-stream: the protocol and a base class.

A map-style epoch is a list of batches, so a new loader can serve "the rest of it". A
stream has no such list: each worker iterates its own copy of the dataset and takes its
share. For a new loader, possibly with another worker count, to take over with no
sample lost or repeated, the stream must say where it is and start from there. The
protocol (ours; the method pair is torchdata's ``Stateful`` and Lightning's stateful-loader
one):

- ``state_dict()`` returns a dict with an integer ``"position"``: the index, in stream
  order, of the first item the next ``iter()`` yields. Other keys are kept as they are.
  An optional integer ``"chunk"`` (default 1) is the sharding granularity below.
- ``load_state_dict(state)`` makes the next ``iter()`` start at ``state["position"]``.
- Under ``W`` DataLoader workers, worker ``k`` yields the chunks ``k, k + W, k + 2W, ...``
  of ``chunk`` consecutive positions from there (round-robin sharding, the usual way of
  reading ``get_worker_info()``); without workers, every position in order.

The DataLoader hands the workers' batches out in turn, so after ``q`` whole rounds of
``W`` batches of ``B`` items, every position below ``start + q W B`` has been delivered and
none above, provided ``q B`` is a multiple of ``chunk``: those are the batch boundaries
where :func:`handover_position` gives the position a new loader starts at. The old
loader's workers may have read ahead of it; those items are dropped, never trained twice.

:class:`PositionStream` implements the protocol over a ``read(position)`` method (an
indexed shard reader, a paged API, a generator of synthetic items). HF
``IterableDataset.state_dict`` and torchdata's per-worker states describe each worker's
own shard list and cannot be re-split across another worker count; such datasets, like
streams without any state, are handed over by the choice described in
``TunableLoader`` (restart the stream now, or change at the next epoch).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info


def stream_state(dataset: Any) -> dict[str, Any] | None:
    """The dataset's state if it follows the protocol above, else ``None``."""
    if not (callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))):
        return None
    try:
        state = dataset.state_dict()
    except Exception:  # a state_dict that needs an iterator first (torchdata nodes, HF before iter) is not ours
        return None
    if not isinstance(state, dict) or isinstance(state.get("position"), bool) or not isinstance(state.get("position"), int):
        return None
    chunk = state.get("chunk", 1)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        return None
    return state


def why_not_resumable(dataset: Any) -> str:
    """One phrase saying why ``dataset`` cannot be handed over at its position."""
    name = type(dataset).__name__
    if not callable(getattr(dataset, "state_dict", None)):
        return f"{name} cannot report its position (no state_dict/load_state_dict)"
    return f"{name}.state_dict() has no integer 'position' (see lightning_accel.prefetch.stream)"


def handover_at(consumed: int, first: int, workers: int, batch_size: int, chunk: int) -> int:
    """The first batch count ``>= consumed`` at which every item before the hand-over is delivered.

    ``first``: the batch count at which the serving loader started; ``workers``: its
    ``num_workers``; ``batch_size``: items per batch (1 for ``batch_size=None``).
    """
    if workers == 0:
        return consumed  # one stream in order: any batch boundary
    # Whole rounds of W batches, and a whole number of chunks per worker.
    rounds_per_step = 1
    while (rounds_per_step * batch_size) % chunk:
        rounds_per_step += 1
    period = rounds_per_step * workers
    served = max(0, consumed - first)
    return first + -(-served // period) * period


def handover_position(start_position: int, first: int, at: int, batch_size: int) -> int:
    """The position of the first item not delivered once batch ``at`` is next (see :func:`handover_at`)."""
    return start_position + (at - first) * batch_size


def positioned_copy(dataset: Any, position: int) -> Any:
    """A copy of ``dataset`` whose next ``iter()`` starts at ``position``; ``dataset`` is left as it was."""
    state = stream_state(dataset)
    assert state is not None
    twin = copy.deepcopy(dataset)
    twin.load_state_dict({**state, "position": position})
    return twin


class PositionStream(IterableDataset):
    """An endless (or ``length``-long) stream of ``read(position)``, sharded and resumable by the protocol above.

    Subclasses implement :meth:`read`. ``chunk``: consecutive positions a worker reads
    at a time (a shard's worth keeps each worker on one file).
    """

    def __init__(self, length: int | None = None, chunk: int = 1) -> None:
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
            raise ValueError(f"length={length!r} must be a count >= 0, or None for an endless stream")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk={chunk!r} must be a positive integer; pass chunk=1 to shard item by item")
        self.length, self.chunk, self.position = length, chunk, 0

    def read(self, position: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement read(position)")

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "chunk": self.chunk}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])

    def _positions(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for base in itertools.count(self.position + worker * self.chunk, workers * self.chunk):
            for p in range(base, base + self.chunk):
                if self.length is not None and p >= self.length:
                    return
                yield p

    def __iter__(self) -> Iterator:
        main = get_worker_info() is None
        for p in self._positions():
            item = self.read(p)
            if main:
                self.position = p + 1  # this process iterates: its own state follows (a worker's is its copy's)
            yield item
        if main:
            self.position = 0  # a finite stream read to its end: the next pass starts over
