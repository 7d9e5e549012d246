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
