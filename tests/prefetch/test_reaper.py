"""The reaper frees served batches on its own thread, and only the ones nobody else holds."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_accel.prefetch.reaper import Reaper


class Batch:
    freed_on: dict[int, str] = {}

    def __init__(self, i: int) -> None:
        self.i = i

    def __del__(self) -> None:
        Batch.freed_on[self.i] = threading.current_thread().name


def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_batches_older_than_hold_are_freed_on_the_reaper_thread_unless_still_held():
    Batch.freed_on.clear()
    reaper = Reaper(hold=2)
    kept = None
    for i in range(5):
        batch = Batch(i)
        reaper.served(batch)
        if i == 1:
            kept = batch  # the user keeps batch 1: the reaper's reference is not the last
        del batch
    # Served 0..4, holding the last two (3, 4): 0 and 2 are freed by the reaper, 1 is kept.
    _wait_for(lambda: {0, 2} <= set(Batch.freed_on))
    assert Batch.freed_on == {0: "prefetch-reaper", 2: "prefetch-reaper"}
    assert kept is not None and kept.i == 1
    reaper.close()
    assert 3 in Batch.freed_on and 4 in Batch.freed_on  # close lets go of the held ones
    assert Batch.freed_on[3] == threading.current_thread().name


def test_hold_below_one_is_refused():
    with pytest.raises(ValueError, match=r"hold=0 must be at least 1"):
        Reaper(hold=0)
