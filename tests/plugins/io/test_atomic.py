"""A failed checkpoint write leaves the previous checkpoint intact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_accel.plugins.io import AtomicCheckpointIO


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    io.save_checkpoint({"w": torch.arange(4.0)}, tmp_path / "a" / "last.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "a" / "last.ckpt")["w"], torch.arange(4.0))


def test_interrupted_write_keeps_the_good_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)
    good = path.read_bytes()

    def torch_save_dies_halfway(obj, f):  # writes some bytes, then the disk fills up
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", torch_save_dies_halfway)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"step": 2}, path)
    assert path.read_bytes() == good
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_storage_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="does not take storage_options"):
        AtomicCheckpointIO().save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})
