"""The prefetch cache shared by runs: two writers at once lose no entry (the read-modify-write holds a file lock)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lightning_accel.prefetch import LoaderSettings, cache


def _write_many(path: Path, writer: int, count: int, start: threading.Barrier) -> None:
    start.wait()
    for i in range(count):
        cache.store(path, f"writer{writer}|key{i}", LoaderSettings(num_workers=writer + 1, prefetch_factor=i % 4 + 1))


def test_two_writers_at_once_lose_no_entry(tmp_path: Path) -> None:
    """Two runs tuning at once, each storing its entries while the other stores its own: every entry of both is in the
    file at the end, with its own settings (without the lock, one writer's read-modify-write dropped the other's)."""
    path, count = tmp_path / "tuned.json", 40
    start = threading.Barrier(2)
    writers = [threading.Thread(target=_write_many, args=(path, w, count, start)) for w in (0, 1)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    for writer in (0, 1):
        for i in range(count):
            assert cache.load(path, f"writer{writer}|key{i}") == LoaderSettings(num_workers=writer + 1, prefetch_factor=i % 4 + 1)


def test_a_store_waits_for_another_runs_lock_and_then_keeps_its_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from filelock import FileLock, Timeout

    path = tmp_path / "tuned.json"
    cache.store(path, "first", LoaderSettings(1, 2))
    monkeypatch.setattr(cache, "LOCK_TIMEOUT_S", 0.2)
    with FileLock(f"{path}.lock"), pytest.raises(Timeout):  # another run in the middle of its store holds the lock
        cache.store(path, "second", LoaderSettings(2, 2))
    assert cache.load(path, "second") is None
    cache.store(path, "second", LoaderSettings(2, 2))
    assert cache.load(path, "first") == LoaderSettings(1, 2) and cache.load(path, "second") == LoaderSettings(2, 2)
