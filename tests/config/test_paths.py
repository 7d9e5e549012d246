"""Every path a run reads or writes, and every environment variable that names one, by class: each path-valued key of
the shipped recipes (found from the constructors' signatures, :func:`lightning_accel.config.paths.path_keys`, not a
hand list) gets every kind of bad value, and each refusal is one line naming the key, the value, the problem and a
fix; the fix it suggests, applied, passes. One case goes through ``lightning-accel run`` end to end per variable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_accel import cli
from lightning_accel.config.errors import UserError
from lightning_accel.config.paths import ENV_PATHS, PathRule, check_config_paths, check_env_paths, path_keys
from tests.support.edited_configs import composed, edited

# between them every path-valued parameter of a shipped recipe: the outputs and cache, data files, checkpoints'
# directory, the logger's, the NVMe tier's scratch, a pretrained directory, the prefetch cache file
RECIPES = ("gpt-tiny_cpu", "gpt-tiny_l2l-nvme_cpu", "llama-tiny_cpu", "resnet-small_io-bound_cpu")


def _keys() -> list[tuple[str, str, PathRule]]:
    seen: dict[str, tuple[str, str, PathRule]] = {}
    for recipe in RECIPES:
        for key, rule in path_keys(composed(recipe)):
            seen.setdefault(key, (recipe, key, rule))
    return list(seen.values())


KEYS = _keys()


def _bad_values(rule: PathRule, tmp: Path) -> dict[str, str]:
    """Every kind of bad value for a path of ``rule``: the problem it must be refused with, by value."""
    file, folder = tmp / "a-file", tmp / "a-dir"
    file.write_text("x")
    folder.mkdir(exist_ok=True)
    bad = {"": "is empty", "   ": "is empty", str(file / "under"): "a file" if not rule.read else "does not exist"}
    if rule.kind == "dir":
        bad[str(file)] = "is a file, not a directory"
    if rule.kind == "file":
        bad[str(folder)] = "is a directory, not a file"
    if rule.read:
        bad[str(tmp / "missing" / "thing")] = "does not exist"
    return bad


def _good_value(rule: PathRule, tmp: Path) -> str:
    """What the message's fix asks for: a directory (made if missing) or file we can write; one that exists to read."""
    if rule.read:
        target = tmp / "exists"
        if rule.kind == "file":
            target.write_text("x")
        else:
            target.mkdir(exist_ok=True)
        return str(target)
    return str(tmp / "new" / ("dir" if rule.kind == "dir" else "file.json"))


def test_the_keys_come_from_the_schema_and_cover_every_kind() -> None:
    keys = {key for _, key, _ in KEYS}
    assert {"paths.root_dir", "paths.cache_dir", "trainer.default_root_dir", "data.path", "data.cache_dir", "strategy.nvme_path",
            "callbacks.model_checkpoint.dirpath", "logger.csv.save_dir", "model.net.pretrained_path",
            "callbacks.prefetch_tuner.cache_path"} <= keys, keys
    assert {(rule.kind, rule.read) for _, _, rule in KEYS} == {("dir", False), ("file", False), ("file", True), ("any", True)}


@pytest.mark.parametrize(("recipe", "key", "rule"), KEYS, ids=[key for _, key, _ in KEYS])
def test_every_bad_value_of_every_path_key_is_one_line_and_its_fix_passes(recipe: str, key: str, rule: PathRule,
                                                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_PATHS:  # the keys themselves, not the variables that set them
        monkeypatch.delenv(name, raising=False)
    for value, problem in _bad_values(rule, tmp_path).items():
        cfg = edited(composed(recipe), [f"{key}='{value}'"])
        with pytest.raises(UserError) as raised:
            check_config_paths(cfg)
        line = str(raised.value)
        assert "\n" not in line and line.startswith(f"{key}={value!r} ") and problem in line and "; " in line, line
        fix = line.split("; ", 1)[1]
        assert key in fix and (("read" in fix) if rule.read else ("write" in fix)), line
    cfg = edited(composed(recipe), [f"{key}='{_good_value(rule, tmp_path)}'"])  # the fix, applied
    check_config_paths(cfg)


@pytest.mark.parametrize("name", list(ENV_PATHS))
def test_every_path_variable_refuses_each_bad_value_and_unsetting_it_passes(name: str, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for value, problem in _bad_values(PathRule("dir", write=True), tmp_path).items():
        monkeypatch.setenv(name, value)
        with pytest.raises(UserError) as raised:
            check_env_paths()
        line = str(raised.value)
        assert "\n" not in line and line.startswith(f"{name}={value!r} ") and problem in line, line
        assert f"or unset it to use {ENV_PATHS[name][1]}" in line, line
    monkeypatch.delenv(name)  # the fix the line offers
    check_env_paths()
    monkeypatch.setenv(name, str(tmp_path / "made" / "later"))  # or a directory made if missing
    check_env_paths()


@pytest.mark.parametrize(("name", "value", "problem"), [
    ("LIGHTNING_ACCEL_OUTPUTS", "", "is empty"),  # was: trained and wrote its run at the file system's root
    ("LIGHTNING_ACCEL_CACHE", "FILE", "is a file, not a directory"),
])
def test_run_refuses_a_bad_variable_in_one_line_before_any_work(name: str, value: str, problem: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "FILE").write_text("x")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, value)
    assert cli.main(["run", "gpt-tiny_cpu", "trainer.max_steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lightning-accel: error: {name}={value!r} {problem}; "), err
    assert not Path("/gpt-tiny_cpu").exists() and sorted(os.listdir(tmp_path)) == ["FILE"]


def test_a_scratch_directory_under_a_file_is_refused_by_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "disk").write_text("x")
    outputs = Path(os.environ["LIGHTNING_ACCEL_OUTPUTS"])
    assert cli.main(["run", "gpt-tiny_l2l-nvme_cpu", "trainer.max_steps=1", f"strategy.nvme_path={tmp_path / 'disk' / 'nvme'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lightning-accel: error: strategy.nvme_path=") and "on its way is a file" in err[0], err
    assert not outputs.exists() or not any(outputs.rglob("run.json"))
