"""atomic_write leaves the old file or the new one, never half of one."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from lightning_accel.atomic import atomic_write, atomic_write_text


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = atomic_write_text(tmp_path / "a" / "run.json", "old")
    assert stat.S_IMODE(target.stat().st_mode) == 0o644

    def dies(f) -> None:
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, dies)
    assert target.read_text() == "old"
    assert [p.name for p in target.parent.iterdir()] == ["run.json"]
    atomic_write_text(target, "new")
    assert target.read_text() == "new"


def test_a_bounded_cache_write_goes_to_disk_every_few_bytes_and_keeps_every_byte(tmp_path, monkeypatch) -> None:
    import os

    from lightning_accel import atomic

    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(atomic, "FLUSH_EVERY", 10)
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd))[1])
    data = bytes(range(35))
    path = atomic.atomic_write(tmp_path / "ckpt", lambda f: [f.write(data[i:i + 7]) for i in range(0, 35, 7)], bounded_cache=True)
    assert path.read_bytes() == data and len(synced) == 2  # after 14 and 28 bytes (then the last 7 with the final fsync)
