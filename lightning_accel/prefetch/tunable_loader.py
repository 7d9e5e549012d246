"""A train loader whose worker settings can change between two batches without losing its place.

For a map-style dataset the epoch's batches are drawn once from the user's (batch)
sampler; each inner ``DataLoader`` serves a segment of them from a plan. ``prepare``
builds the next inner loader in the background over the batches from ``k`` = "now +
lead" on, and starts its workers at once, while the current loader, its plan cut at
``k``, keeps serving the batches before it: training never pauses, and by the time
batch ``k`` is asked for the new workers have had ``lead`` steps to fill their buffers.
Each batch is served by exactly one inner loader, so none is duplicated or lost.
``switch`` is the cold variant: the old workers stop, new ones serve from the next batch
(what a tight memory budget needs: no moment with both loaders' buffers).

An iterable dataset has no list of batches. One that reports and restores its position
(the protocol of :mod:`~lightning_accel.prefetch.stream`) is handed over the same way:
the new loader reads a copy of the dataset positioned at the first item the old one will
not deliver, taking over at the next batch boundary where the old one's delivered items
form an unbroken prefix of the stream. Any other stream cannot be resumed part-way, and
``stream_switch`` decides: ``"next_epoch"`` (the default: nothing lost or repeated, but
an endless epoch keeps its settings forever) or ``"restart"`` (the new loader starts the
stream again from its beginning now: its shards restart, so samples repeat).
Between changes the inner loader lives on, so ``persistent_workers`` keeps its workers
across epochs; a replaced one shuts down on a background thread (joining busy workers
can take a whole item's latency).

When the user's loader is torchdata's ``StatefulDataLoader`` (map-style), the epoch's
batches are drawn through an index twin of it (:mod:`~lightning_accel.prefetch.loader_state`),
and :class:`~lightning_accel.prefetch.stateful_tunable.StatefulTunableLoader` checkpoints
the state that loader would have after the batches served, in its own format: a resumed
run, tuned or not, continues exactly (:func:`~lightning_accel.prefetch.stateful_tunable.tunable_loader`
picks the wrapper).

Every inner loader stamps each batch with the (system-wide monotonic) time its worker
finished it: ``stamps`` holds them for the batches served by the current settings, so
a caller can measure how fast those workers produce, unblurred by the batches they had
buffered before the switch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from lightning_accel.prefetch.inner_loader import _Inner, _Plan
from lightning_accel.prefetch.loader_rebuild import check_rebuildable, is_iterable, settings_of
from lightning_accel.prefetch.loader_state import IndexTwin, is_stateful_loader
from lightning_accel.prefetch.reaper import Reaper
from lightning_accel.prefetch.settings import LoaderSettings
from lightning_accel.prefetch.slow_batch import SlowBatchWatch
from lightning_accel.prefetch.stream import handover_at, handover_position, positioned_copy, stream_state

STREAM_SWITCHES = ("next_epoch", "restart")


def check_stream_switch(stream_switch: str) -> None:
    """Refuse a ``stream_switch`` that is not one of :data:`STREAM_SWITCHES`, in one line naming both."""
    if stream_switch not in STREAM_SWITCHES:
        raise ValueError(
            f"stream_switch={stream_switch!r} is not one of {STREAM_SWITCHES}; pass 'next_epoch' (loses no data) "
            "or 'restart' (switch now, the stream starts again)"
        )


class TunableLoader:
    """Wraps the user's ``DataLoader``; ``prepare`` / ``switch`` change its settings mid-epoch (map-style)."""

    def __init__(self, loader: DataLoader, settings: LoaderSettings | None = None, stream_switch: str = "next_epoch") -> None:
        """``settings``: serve with these from the first batch (e.g. from a cache) instead of the loader's own.

        ``stream_switch``: for an iterable dataset that cannot report its position,
        ``"next_epoch"`` or ``"restart"`` (see the module docstring).
        """
        check_stream_switch(stream_switch)
        check_rebuildable(loader, workers=settings is not None and settings.num_workers > 0)
        self.loader = loader
        self.settings = settings if settings is not None else settings_of(loader)
        self.stream_switch = stream_switch
        # Resumable: a map-style epoch, or a stream following the position protocol.
        self.resumable = not is_iterable(loader) or stream_state(loader.dataset) is not None
        self._twin = IndexTwin(loader) if is_stateful_loader(loader) and not is_iterable(loader) else None
        self.switches = 0  # how many times an inner loader was replaced (for tests and reports)
        self.restarts = 0  # of those, stream restarts from the beginning (stream_switch="restart")
        self.stamps: list[float] = []  # finish times of the batches served under ``settings``
        self.took_over_at = 0.0  # time.monotonic() (the stamps' clock) when ``settings`` began serving
        self.handed_out = 0  # batches handed out since the wrap, all epochs
        self.took_over_after = 0  # of those, how many came before ``settings`` began serving
        self._pending: LoaderSettings | None = None  # for the next epoch (or the next batch, cold)
        self._inner: _Inner | None = None
        self._next: _Inner | None = None  # prepared in the background, takes over at ``_next_at``
        self._next_at = 0
        self._batches: list | None = None  # this epoch's batches while a map-style epoch runs
        self._in_epoch = False
        self._consumed = 0
        self._speculate: tuple[float, Callable[[float], LoaderSettings | None]] | None = None  # armed by speculate
        self.speculated: LoaderSettings | None = None  # what speculate started (from the batch after the slow one)
        self.reaper = Reaper()  # frees served batches off the training thread
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

    @property
    def consumed(self) -> int:
        """Batches handed out so far this epoch."""
        return self._consumed

    @property
    def switches_mid_epoch(self) -> bool:
        """Whether :meth:`prepare` can take effect within this epoch (else: at the next one)."""
        return self.resumable or self.stream_switch == "restart"

    @property
    def preparing(self) -> LoaderSettings | None:
        """Settings prepared in the background that have not taken over yet."""
        return self._next.settings if self._next is not None else (self._pending if self._pending != self.settings else None)

    @property
    def starting(self) -> bool:
        """Whether a prepared loader's workers are being started in the background now (forking them
        holds the interpreter's lock for a moment each, so the training thread's timings are disturbed)."""
        return self._next is not None and self._next.starting

    def switch(self, settings: LoaderSettings) -> None:
        """Use ``settings`` from the next batch (the next round, for a resumable stream) or the next epoch.

        Mid-epoch, the new workers start here, so they fetch while the current step
        finishes instead of after it.
        """
        self.prepare(settings, lead=0)

    def prepare(self, settings: LoaderSettings, lead: int = 1) -> None:
        """Start ``settings``' workers now; they serve from ``lead`` batches on, within this epoch.

        A resumable stream hands over at the first batch boundary from there where the
        delivered items are a prefix of the stream. Between epochs, for a stream that
        cannot be resumed with ``stream_switch="next_epoch"``, or when the epoch ends
        before the hand-over, the change takes effect at the next epoch. A prepared loader
        not yet serving (one :meth:`speculate` started, too) is dropped first.
        """
        check_rebuildable(self.loader, workers=settings.num_workers > 0)
        self._speculate = None
        self._drop_next()
        if settings == self.settings:
            self._pending = None
            return
        self._pending = settings
        if not self._in_epoch or self._inner is None:
            return  # between epochs: at the next one
        built = self._build(settings, self._consumed + max(0, lead))
        if built is None:
            return  # at the next epoch
        self._install(*built)
        assert self._next is not None
        if self._next_at <= self._consumed:
            self._take_over(overlap=False)
        else:
            self._next.start_in_background()

    def _build(self, settings: LoaderSettings, at: int) -> tuple[_Inner, int] | None:
        """An inner loader with ``settings`` serving from batch ``at`` (or the stream's next hand-over
        point from there), not started; ``None`` where it can only serve from the next epoch.

        Reads the loader's state without changing it, so a timer thread may call it while the
        training thread loads a batch (:meth:`speculate`).
        """
        if not is_iterable(self.loader):
            assert self._batches is not None
            if at >= len(self._batches):
                return None  # the epoch ends first
            return _Inner(self.loader, settings, _Plan(self._batches, at), first=at), at
        if self.resumable:
            state = stream_state(self.loader.dataset)
            assert state is not None and self._inner is not None
            inner = self._inner
            at = handover_at(at, inner.first, inner.settings.num_workers, self._items_per_batch, state.get("chunk", 1))
            position = handover_position(inner.position, inner.first, at, self._items_per_batch)
            return _Inner(self.loader, settings, None, positioned_copy(self.loader.dataset, position), at, position), at
        if self.stream_switch == "restart":
            nxt = _Inner(self.loader, settings, None, first=at)  # a fresh iterator: the stream starts again
            nxt.restart = True
            return nxt, at
        return None  # a stream without a position

    def _install(self, nxt: _Inner, at: int) -> None:
        """``nxt`` takes over at batch ``at``; the current loader fetches nothing past it."""
        if not is_iterable(self.loader) and self._inner is not None and self._inner.plan is not None:
            self._inner.plan.stop = at
        self._pending = None
        self._next_at = at  # before _next: the loop reads _next first
        self._next = nxt

    def speculate(self, after_s: float, choose: Callable[[float], LoaderSettings | None]) -> None:
        """Once: if the next batch this process loads itself (no workers) takes longer than ``after_s``,
        start the workers of the settings ``choose(cpu_share)`` names while it loads; they serve from the
        batch after it, unless :meth:`prepare` (e.g. with the current settings) drops them first.

        ``choose`` runs on a timer thread and gets the loading thread's CPU share so far
        (:class:`~lightning_accel.prefetch.slow_batch.SlowBatchWatch` says why, and why then);
        ``speculated`` names the settings once their loader is adopted, at that batch's arrival.
        """
        self._speculate = (after_s, choose)

    def _watch(self) -> SlowBatchWatch | None:
        """The watch over the batch about to be loaded, if :meth:`speculate` armed one for it."""
        # Only where the hand-over loses and repeats nothing (a stream that restarts would repeat its start).
        if self._speculate is None or self.settings.num_workers or self._next is not None or not self.resumable:
            return None
        (after_s, choose), self._speculate = self._speculate, None
        at = self._consumed + 1

        def start(cpu_share: float) -> tuple[_Inner, int] | None:
            settings = choose(cpu_share)
            if settings is None or settings == self.settings:
                return None
            check_rebuildable(self.loader, workers=settings.num_workers > 0)
            built = self._build(settings, at)
            if built is not None:
                built[0].start_in_background()
            return built

        return SlowBatchWatch(after_s, start)

    def _adopt(self, watch: SlowBatchWatch | None) -> None:
        """The watched batch is in: install what the watch started, if anything."""
        built = watch.stop() if watch is not None else None
        if built is not None:
            self._install(*built)
            self.speculated = built[0].settings

    @property
    def _items_per_batch(self) -> int:
        return self.loader.batch_size if self.loader.batch_size is not None else 1

    def _take_over(self, overlap: bool = True) -> None:
        """The prepared loader serves from here; without ``overlap`` the old workers stop before new ones start."""
        assert self._next is not None
        if self._inner is not None:
            self._inner.close(background=overlap)
        self._inner, self._next = self._next, None
        self._inner.started()
        self.settings = self._inner.settings
        self.stamps = []
        self.took_over_at = time.monotonic()
        self.took_over_after = self.handed_out
        self.switches += 1
        self.restarts += self._inner.restart

    def _drop_next(self) -> None:
        if self._next is not None:
            self._next.close(background=True)
            self._next = None
            if self._inner is not None and self._inner.plan is not None and self._batches is not None:
                self._inner.plan.stop = len(self._batches)  # the current loader serves the rest again

    def _apply_pending(self) -> None:
        if self._pending is not None:
            if self._pending != self.settings:
                self.close()
                self.settings = self._pending
                self.stamps = []
                self.took_over_at = time.monotonic()
                self.took_over_after = self.handed_out
                self.switches += 1
            self._pending = None

    def settled_stamps(self) -> list[float]:
        """``stamps`` from the first batch finished after the current settings took over.

        The batches before were made while the loader they replaced still served (sharing the
        cores with it, when items need a CPU) and by workers just started (imports, first file
        opens): measured on JPEG decoding, 2 workers started so made a batch every 79 ms where
        they made one every ~20 ms once settled.
        """
        first = next((i for i, stamp in enumerate(self.stamps) if stamp >= self.took_over_at), len(self.stamps))
        return self.stamps[first:]

    def cpu_busy(self) -> float | None:
        """:meth:`_Inner.cpu_busy` of the loader serving now."""
        return self._inner.cpu_busy() if self._inner is not None else None

    def step_started(self) -> None:
        """The loop started computing on its batch: older served batches may be freed now, off its thread."""
        self.reaper.release()

    def close(self) -> None:
        """Shut down the inner loaders' workers now rather than at garbage collection."""
        for inner in (self._inner, self._next):
            if inner is not None:
                inner.close()
        self._inner = self._next = None
        self.reaper.close()

    def __iter__(self) -> Iterator:
        if self._next is not None:  # an epoch ended before the hand-over: the next one starts with it
            self._pending = self._next.settings
            self._next.close(background=True)
            self._next = None
        self._apply_pending()
        self._consumed = 0
        if is_iterable(self.loader):
            state = stream_state(self.loader.dataset) if self.resumable else None
            if state is not None:
                # Each epoch reads a copy positioned where the user's dataset stands; the original stays put.
                if self._inner is not None:
                    self._inner.close(background=True)
                dataset = positioned_copy(self.loader.dataset, state["position"])
                self._inner = _Inner(self.loader, self.settings, None, dataset, 0, state["position"])
            elif self._inner is None:
                self._inner = _Inner(self.loader, self.settings, None)
            self._inner.first = 0  # this epoch's batches count from here
        else:
            source = self.loader.batch_sampler if self.loader.batch_sampler is not None else self.loader.sampler
            # This epoch's order, drawn from the user's sampler exactly once.
            self._batches = self._twin.draw_epoch() if self._twin is not None else list(source)
            if self._inner is None or self._inner.plan is None:
                self._inner = _Inner(self.loader, self.settings, _Plan())
            assert self._inner.plan is not None
            self._inner.plan.reset(self._batches)  # persistent workers re-read their plan at each epoch
        self._inner.start()
        self._in_epoch = True
        try:
            while True:
                if self._next is not None and self._consumed == self._next_at:
                    self._take_over()  # batch boundary: the prepared workers serve from here on
                assert self._inner is not None
                watch = self._watch()
                try:
                    stamp, batch = next(self._inner.iterator)
                except StopIteration:
                    return
                finally:
                    self._adopt(watch)
                self.stamps.append(stamp)
                self._consumed += 1
                self.handed_out += 1
                self.reaper.served(batch)
                yield batch
        finally:
            self._batches = None
            self._in_epoch = False

