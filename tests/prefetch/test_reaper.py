"""The reaper frees served batches on its own thread, only once released, and only the ones nobody else holds."""

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


def test_batches_older_than_hold_are_freed_on_the_reaper_thread_after_release_unless_still_held():
    Batch.freed_on.clear()
    reaper = Reaper(hold=2)
    kept = None
    for i in range(4):
        batch = Batch(i)
        reaper.served(batch)
        if i == 1:
            kept = batch  # the user keeps batch 1: the reaper's reference is not the last
        del batch
    time.sleep(0.05)
    assert Batch.freed_on == {}  # served but not released: all four still held (hold + 2)
    reaper.release()  # a step started: all but the last two may go
    _wait_for(lambda: 0 in Batch.freed_on)
    assert Batch.freed_on == {0: "prefetch-reaper"}  # 1 is the user's, 2 and 3 are held
    assert kept is not None and kept.i == 1
    reaper.close()
    assert Batch.freed_on[2] == Batch.freed_on[3] == threading.current_thread().name  # close lets go


def test_without_release_batches_go_at_hold_plus_two():
    Batch.freed_on.clear()
    reaper = Reaper(hold=1)
    for i in range(5):
        reaper.served(Batch(i))
    _wait_for(lambda: {0, 1} <= set(Batch.freed_on))
    assert Batch.freed_on == {0: "prefetch-reaper", 1: "prefetch-reaper"}  # 3 held: 2, 3, 4
    reaper.close()


def test_hold_below_one_is_refused():
    with pytest.raises(ValueError, match=r"hold=0 must be at least 1"):
        Reaper(hold=0)
