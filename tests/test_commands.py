"""Every ``lightning-accel`` command ends a bad path or argument in one line: exit 2 before any work, exit 1 after it
began with what it wrote removed. In process (``cli.main``), as a user would type them."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from lightning_accel import cli


def _line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("lightning-accel: error: ") and "Traceback" not in err[0] and "; " in err[0], err
    return err[0].removeprefix("lightning-accel: error: ")


def _exit_code(args: list[str]) -> int:
    try:
        return cli.main(args)
    except SystemExit as exit_:  # argparse's usage errors exit
        return int(exit_.code or 0)


def _a_run_dir(root: Path, checkpoint: str | None, status: str = "completed") -> Path:
    run = root / "outputs" / "llama-tiny_lora_cpu" / "2026-01-01_00-00-00"
    (run / "checkpoints").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"status": status, "checkpoint": checkpoint}))
    return run


# (what, arguments with {tmp} for the test's directory, the line's pattern)
BAD = [
    ("cp into a missing directory", ["cp", "gpt-tiny_cpu", "{tmp}/no/such/dir/mine.yaml"],
     r"^destination '.*/no/such/dir/mine.yaml': the directory '.*/no/such/dir' does not exist; create it first"),
    ("cp under a file", ["cp", "gpt-tiny_cpu", "{tmp}/a_file/mine.yaml"], r"^destination '.*/a_file/mine.yaml': '.*/a_file' is a file, not a directory"),
    ("cp onto a file", ["cp", "gpt-tiny_cpu", "{tmp}/a_file"], r"^destination '.*/a_file' must be a directory or a .yaml file"),
    ("cp of a directory as recipe", ["cp", "{tmp}/a_dir.yaml", "{tmp}/mine.yaml"], r"^recipe file '.*/a_dir.yaml' is a directory, not a file; pass a recipe name"),
    ("cp missing its destination", ["cp", "gpt-tiny_cpu"], r"^lightning-accel cp: the following arguments are required: dest; see lightning-accel cp --help$"),
    ("export of a missing run", ["export", "{tmp}/no_run"], r"^run directory '.*/no_run' does not exist; pass one that `lightning-accel run` made"),
    ("export of a file", ["export", "{tmp}/a_file"], r"^run directory '.*/a_file' is a file, not a directory"),
    ("export onto a file", ["export", "{run}", "--out", "{tmp}/a_file"], r"^--out '.*/a_file' is a file; peft writes a directory of files"),
    ("export under a file", ["export", "{run}", "--out", "{tmp}/a_file/adapter"], r"^--out '.*/a_file/adapter': '.*/a_file' is a file, not a directory"),
    ("export of a run whose checkpoint was deleted", ["export", "{run}"],
     r"^'.*' has no checkpoint: run.json names '.*/last.ckpt', which no longer exists, and .*/checkpoints holds no .ckpt"),
    ("ls with an argument", ["ls", "gpt-tiny_cpu"], r"^unrecognized arguments: gpt-tiny_cpu; see lightning-accel --help$"),
    ("validate with an unknown flag", ["validate", "gpt-tiny_cpu", "--fast"], r"unrecognized arguments: --fast"),
    ("validate of a directory", ["validate", "{tmp}/a_dir.yaml"], r"^recipe file '.*/a_dir.yaml' is a directory, not a file"),
    ("run of a file that is not YAML", ["run", "{tmp}/a_file"], r"^recipe file '.*/a_file' is not a .yaml file .*; pass a recipe name"),
    ("validate adding a key that exists", ["validate", "gpt-tiny_cpu", "+trainer.max_steps=5"],
     r"^\+trainer.max_steps=\.\.\. adds a key, but trainer.max_steps is already in the config; set it without the \+: trainer.max_steps=VALUE"),
    ("validate of a text file as checkpoint", ["validate", "gpt-tiny_cpu", "ckpt_path={tmp}/a_file"],
     r"^ckpt_path='.*/a_file' is not a readable checkpoint \(.*\); pass a .ckpt written by a run"),
    ("estimate with a bad size", ["estimate", "gpt-tiny_cpu", "--host-memory", "lots"], r"^size 'lots' is not a number of bytes with a unit"),
    ("estimate with a bad override", ["estimate", "gpt-tiny_cpu", "trainer.max_stepz=4"], r"^unknown key 'trainer.max_stepz'"),
    ("estimate of a bad value", ["estimate", "gpt-tiny_cpu", "model.optimizer.betas=[2,0.9]"], r"^model.optimizer.betas=\[2, 0.9\]: AdamW refuses it"),
    ("bench with a bad value", ["bench", "prefetch", "--steps", "many"],
     r"^lightning-accel bench prefetch: argument --steps: invalid int value: 'many'; see lightning-accel bench prefetch --help$"),
    ("bench with an unknown flag", ["bench", "offload", "--fastest"], r"^lightning-accel bench offload: unrecognized arguments: --fastest"),
]


@pytest.mark.parametrize(("args", "pattern"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_bad_path_or_argument_is_one_line_and_exit_2(args: list[str], pattern: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_dir.yaml").mkdir()
    run = _a_run_dir(tmp_path, str(tmp_path / "gone" / "last.ckpt"))
    before = sorted(tmp_path.rglob("*"))
    assert _exit_code([a.replace("{tmp}", str(tmp_path)).replace("{run}", str(run)) for a in args]) == 2
    assert re.search(pattern, _line(capsys))
    assert sorted(tmp_path.rglob("*")) == before  # nothing made


def test_cp_that_fails_mid_write_is_exit_1_and_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    def full_disk(source: object, target: object) -> None:
        Path(str(target)).write_text("# half a recipe")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", full_disk)
    assert cli.main(["cp", "gpt-tiny_cpu", str(tmp_path / "mine.yaml")]) == 1
    assert re.fullmatch(r"cannot write '.*/mine.yaml': No space left on device \(nothing was left there\); choose another destination.*",
                        _line(capsys))
    assert list(tmp_path.iterdir()) == []


def test_export_that_fails_mid_write_is_exit_1_and_removes_what_it_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_accel.models import export_adapters as module

    def half_written(run_dir: Path, out: Path) -> None:
        out.mkdir(parents=True)
        (out / "adapter_config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "export_adapters", half_written)
    run = _a_run_dir(tmp_path, None)
    before = sorted(tmp_path.rglob("*"))
    for out in (tmp_path / "adapter", tmp_path / "new" / "adapter"):  # the directories it would make, made and removed
        assert cli.main(["export", str(run), "--out", str(out)]) == 1
        assert re.fullmatch(r"cannot export the adapters of .* to '.*/adapter': OSError: \[Errno 28\] No space left on device \(nothing "
                            r"was left there\); fix that and export again", _line(capsys))
        assert sorted(tmp_path.rglob("*")) == before


def test_a_run_with_the_multirun_flag_between_overrides_reaches_hydra_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run RECIPE a=1 -m b=1,2``: Hydra's parser took the two groups of overrides for one list and an unknown
    argument (8 lines of usage); ``-m`` goes first in the arguments Hydra parses."""
    import hydra

    from lightning_accel.config import preflight

    seen: dict[str, list[str]] = {}
    monkeypatch.setattr(preflight, "preflight", lambda *args, **kwargs: __import__("omegaconf").OmegaConf.create({}))

    def fake_main(**kwargs: object):  # type: ignore[no-untyped-def]
        return lambda task: (lambda: seen.setdefault("argv", list(__import__("sys").argv)))

    monkeypatch.setattr(hydra, "main", fake_main)
    monkeypatch.setattr("sys.argv", ["lightning-accel"])
    os.environ.pop(cli.RECIPE_ENV, None)
    try:
        assert cli.main(["run", "gpt-tiny_cpu", "trainer.max_steps=2", "-m", "seed=1,2"]) == 0
    finally:
        os.environ.pop(cli.RECIPE_ENV, None)
    assert seen["argv"][1:4] == ["-m", "trainer.max_steps=2", "seed=1,2"]
