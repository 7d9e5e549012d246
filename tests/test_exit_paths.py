"""What gets past preflight ends in one line too: exit 1, the traceback in the run's log, ``run.json`` failed, and no
run directory left behind by a run that never wrote a checkpoint (unless ``keep_failed=true``).

In process (an interpreter start costs ~10 s of imports): each case is a real ``lightning-accel run`` of the tiny GPT
for at most 2 steps, failing in the first step, with an input preflight cannot know (a network whose forward raises).
What a strategy checks at set-up (a block class the model lacks, chunks against the batch, a closure-based optimizer, a
world size against the pipeline layout) and what shapes tell (the data's sequence length against the model's positions)
preflight now asks first: exit 2 before any work, in tests/test_cli.py's PREFLIGHT_BAD and
tests/config/test_values_before_work.py.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from lightning_accel import cli

TINY = ["trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "data.block_size=32",
        "data.batch_size=4", "trainer.enable_progress_bar=false"]

# (kind, overrides, what the one line says)
ESCAPES = [
    ("first step", ["model.net._target_=tests.support.failing_nets.GPTFailingInForward"],
     r"ValueError: GPTFailingInForward got a batch of shape \(4, 32\) it was written to refuse; fix the network's forward"),
]


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """``lightning-accel run gpt-tiny_cpu ARGS`` in this process: exit status and the stderr lines that are not
    Lightning's start-up info (``GPU available: ...``)."""
    os.environ.pop(cli.RECIPE_ENV, None)  # set by cmd_run for re-launched DDP ranks; a later call would skip preflight
    try:
        code = cli.main(["run", "gpt-tiny_cpu", *TINY, *args])
    finally:
        os.environ.pop(cli.RECIPE_ENV, None)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, [line for line in err.splitlines() if line.startswith("lightning-accel: ")]


@pytest.mark.parametrize(("overrides", "message"), [c[1:] for c in ESCAPES], ids=[c[0] for c in ESCAPES])
def test_an_error_after_preflight_is_one_line_exit_1_and_leaves_no_run(overrides: list[str], message: str, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run(overrides, capsys)
    assert code == 1
    assert len(lines) == 1 and lines[0].startswith("lightning-accel: error: "), lines
    assert re.search(message, lines[0]), lines[0]
    assert "keep_failed=true keeps it" in lines[0]
    recipe_dir = tmp_path / "outputs" / "gpt-tiny_cpu"
    assert not recipe_dir.exists() or not list(recipe_dir.iterdir())  # nothing was checkpointed: nothing stale stays


def test_keep_failed_keeps_the_run_with_its_traceback_and_a_failed_run_json(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    _, overrides, message = ESCAPES[-1]
    code, lines = run([*overrides, "keep_failed=true"], capsys)
    assert code == 1 and len(lines) == 1, lines
    assert re.search(message, lines[0]), lines[0]
    (run_dir,) = (tmp_path / "outputs" / "gpt-tiny_cpu").iterdir()
    log = run_dir / "lightning-accel.log"
    assert lines[0].endswith(f"(traceback: {log})")
    status = json.loads((run_dir / "run.json").read_text())
    assert status["status"] == "failed"
    assert status["error"] == lines[0].removeprefix("lightning-accel: error: ").removesuffix(f" (traceback: {log})")
    text = log.read_text()
    assert f"lightning-accel: run failed: {status['error']}" in text
    assert "Traceback (most recent call last)" in text and "trainer.fit(" in text  # the whole trace, from the runner down


def test_an_unexpected_error_in_the_checks_is_one_line_exit_1(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A check that raises what it should have explained (a bug of ours) still ends in one line, in run and validate."""
    from lightning_accel.config import preflight

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("stage_devices")

    monkeypatch.setattr(preflight, "preflight", broken)
    monkeypatch.setattr(preflight, "preflight_built", broken)  # (validate asks for the module it built too)
    for command in ("run", "validate"):
        assert cli.main([command, "gpt-tiny_cpu"]) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines == ["lightning-accel: error: KeyError: 'stage_devices' (unexpected; HYDRA_FULL_ERROR=1 shows the traceback)"]
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(KeyError):
        cli.main(["validate", "gpt-tiny_cpu"])
