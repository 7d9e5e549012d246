"""A checkpoint write that fails (a full disk, an I/O error, a read-only directory) loses nothing: the previous
checkpoint stays loadable, no temporary file is left, the run ends in one line naming the path and the bytes it
needed (exit 1, ``run.json`` failed), and resuming from the previous checkpoint ends exactly as an uninterrupted run.

The failures are simulated at the file the checkpoint is written to, under torch's zip writer, where a real full disk
hits: torch reports it as "enforce fail at inline_container.cc" and keeps the OSError only as that error's context.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel import cli
from lightning_accel.plugins.io import atomic
from lightning_accel.plugins.io.atomic import AtomicCheckpointIO, CheckpointWriteError, checkpoint_bytes


REAL_ATOMIC_WRITE = atomic.atomic_write


class _FailingFile:
    """The checkpoint's temporary file on a disk that fails after ``room`` bytes."""

    def __init__(self, f: Any, code: int, room: int) -> None:
        self.f, self.code, self.room = f, code, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            raise OSError(self.code, os.strerror(self.code))
        self.room -= len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def fail_write(monkeypatch: pytest.MonkeyPatch, code: int, nth: int = 1, room: int = 4096) -> list[Path]:
    """Make the ``nth`` checkpoint write from now on fail with ``code`` after ``room`` bytes; returns the paths written."""
    real, paths = REAL_ATOMIC_WRITE, []

    def write(path: Any, body: Any, *args: Any, **kwargs: Any) -> Path:
        paths.append(Path(path))
        if len(paths) != nth:
            return real(path, body, *args, **kwargs)
        return real(path, lambda f: body(_FailingFile(f, code, room)), *args, **kwargs)

    monkeypatch.setattr(atomic, "atomic_write", write)
    return paths


@pytest.mark.parametrize(("code", "fix"), [(errno.ENOSPC, r"is free there; free that much"), (errno.EIO, r"check the disk"),
                                           (errno.EROFS, r"make '.*' writable")], ids=["ENOSPC", "EIO", "EROFS"])
def test_a_failed_write_keeps_the_previous_checkpoint_and_says_path_and_bytes(code: int, fix: str, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    io, path = AtomicCheckpointIO(), tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.zeros(10)}, path)
    state = {"step": 2, "w": torch.ones(100_000), "tied": {"a": (t := torch.ones(50_000)), "b": t[:10]}}
    fail_write(monkeypatch, code)
    with pytest.raises(CheckpointWriteError) as caught:
        io.save_checkpoint(state, path)
    err = caught.value
    assert isinstance(err, OSError) and err.errno == code  # still an OSError to code that handles one
    assert checkpoint_bytes(state) == 600_000  # each storage once: t and its view t[:10] share one
    line = str(err)
    assert "\n" not in line and line.startswith(f"cannot write checkpoint '{path}': {os.strerror(code)} ({errno.errorcode[code]})")
    assert "needs about 600,000 bytes (600.0 kB, estimated from its tensors)" in line
    assert re.search(fix, line), line
    assert io.load_checkpoint(path)["step"] == 1
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no temporary file


SMALL = ["trainer.max_steps=2", "trainer.val_check_interval=1", "trainer.limit_val_batches=1", "model.net.dropout=0.1",
         "data.block_size=32", "data.batch_size=4", "trainer.enable_progress_bar=false"]


def _run(args: list[str], run_dir: Path) -> int:
    os.environ.pop(cli.RECIPE_ENV, None)  # set by cmd_run for re-launched DDP ranks; a later call would skip preflight
    try:  # an explicit run directory: two runs in one second would share Hydra's time-stamped one
        return cli.main(["run", "gpt-tiny_cpu", *SMALL, *args, f"hydra.run.dir={run_dir}"])
    finally:
        os.environ.pop(cli.RECIPE_ENV, None)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    status = json.loads((run_dir / "run.json").read_text())
    assert status["status"] == "completed", status
    return torch.load(status["checkpoint"], map_location="cpu", weights_only=False)["state_dict"]


def test_a_full_disk_at_the_second_checkpoint_ends_in_one_line_and_resume_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    recipe_dir = tmp_path / "outputs" / "gpt-tiny_cpu"
    # step 1 writes step000001.ckpt and last.ckpt; the disk is full for step 2's first file
    paths = fail_write(monkeypatch, errno.ENOSPC, nth=3)
    assert _run([], recipe_dir / "failed") == 1
    monkeypatch.setattr(atomic, "atomic_write", REAL_ATOMIC_WRITE)  # the disk has room again
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("lightning-accel: ")]
    assert "Traceback" not in err and "inline_container" not in err, err
    failed = recipe_dir / "failed"
    assert len(lines) == 1 and lines[0].startswith(f"lightning-accel: error: cannot write checkpoint '{paths[2]}': No space left"), lines
    assert "bytes (" in lines[0] and "estimated from its tensors" in lines[0]
    assert lines[0].endswith(f"(traceback: {failed / 'lightning-accel.log'})")  # a checkpoint exists: the run stays
    status = json.loads((failed / "run.json").read_text())
    assert status["status"] == "failed" and status["error"].startswith(f"cannot write checkpoint '{paths[2]}'")
    checkpoints = failed / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step000001.ckpt"]  # no temporary file
    assert torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 1

    assert _run(["ckpt_path=last"], recipe_dir / "resumed") == 0
    assert json.loads((recipe_dir / "resumed" / "run.json").read_text())["resumed_from"] == str(checkpoints / "last.ckpt")
    assert _run([], tmp_path / "reference") == 0  # outside the recipe's directory: ckpt_path=last never sees it
    got, want = _weights(recipe_dir / "resumed"), _weights(tmp_path / "reference")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
