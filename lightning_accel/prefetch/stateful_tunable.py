"""The tuned wrapper for a torchdata ``StatefulDataLoader``, and the function that picks the wrapper.

Lightning checkpoints a train loader's ``state_dict()`` and loads it on resume. Over a
map-style ``StatefulDataLoader`` the tuned loader draws each epoch through an index twin
of it (:mod:`~lightning_accel.prefetch.loader_state`), so it can report the state the
user's loader would have after the batches served, in that loader's own format: a run
resumed mid-epoch, tuned or not, continues with the same samples.
"""

from __future__ import annotations

from typing import Any

from lightning_accel.prefetch.loader_rebuild import RebuildError, is_iterable
from lightning_accel.prefetch.loader_state import is_stateful_loader
from lightning_accel.prefetch.settings import LoaderSettings
from lightning_accel.prefetch.tunable_loader import TunableLoader

__all__ = ["StatefulTunableLoader", "tunable_loader"]


class StatefulTunableLoader(TunableLoader):
    """A :class:`TunableLoader` over a map-style ``StatefulDataLoader``: checkpoints that loader's state.

    Lightning saves ``state_dict()`` with each checkpoint and loads it on resume; the
    state is the user's loader's own format after the batches served this epoch, so it
    loads into the user's loader (an untuned run) as well as into this one.
    """

    def __init__(self, loader: Any, settings: LoaderSettings | None = None, stream_switch: str = "next_epoch") -> None:
        super().__init__(loader, settings, stream_switch)
        pending = getattr(loader, "next_iter_state", None)
        if pending:  # a state loaded into the user's loader before fit: its next epoch starts there, as the loader's would
            self.load_state_dict(pending)

    def state_dict(self) -> dict[str, Any]:
        assert self._twin is not None
        return self._twin.state_after(self._consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next epoch continues from ``state``; must come between epochs."""
        assert self._twin is not None
        if self._in_epoch:
            raise RuntimeError("load_state_dict mid-epoch: load the state before iterating the loader")
        self._twin.load_state_dict(state)


def tunable_loader(loader: Any, settings: LoaderSettings | None = None, stream_switch: str = "next_epoch") -> TunableLoader:
    """The wrapper for ``loader``: :class:`StatefulTunableLoader` for a map-style ``StatefulDataLoader``.

    A ``StatefulDataLoader`` over an iterable dataset is refused (:class:`RebuildError`):
    its per-worker state cannot be carried across re-built loaders yet, and dropping it
    would silently lose the exact resume its user asked for.
    """
    if is_stateful_loader(loader):
        if is_iterable(loader):
            raise RebuildError(
                "a StatefulDataLoader over an iterable dataset keeps per-worker state that re-built loaders cannot "
                "carry yet; keep it untuned, or use a plain DataLoader over a stream with a 'position' state"
            )
        return StatefulTunableLoader(loader, settings, stream_switch)
    return TunableLoader(loader, settings, stream_switch)
