"""A built wheel carries conf/ and recipes/, and an installed copy finds and runs them."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("conf/train.yaml", "conf/trainer/default.yaml", "recipes/gpt-tiny_cpu.yaml",
           "offload/shadow_kernel.c")  # the C source: built at first use by the installed copy


def _installed_from_a_wheel() -> Path | None:
    """This interpreter's site directory when it holds lightning_accel installed from a wheel (CI's
    ``pip install ".[test]"`` of this tree builds one and installs it), None for an editable install (its files
    stay in the checkout). Whether the tests themselves import that copy or the tree does not matter here."""
    site = Path(sysconfig.get_paths()["purelib"])
    return site if (site / "lightning_accel" / "__init__.py").is_file() else None


def _check_installed(site: Path, env: dict[str, str], cwd: Path) -> None:
    """``site`` holds an installed lightning_accel: it finds its conf/ and every recipe, and validates one, run from
    a directory with no checkout in it."""
    probe = subprocess.run(
        [sys.executable, "-c", "import lightning_accel.config.locate as l; print(l.conf_dir()); print(l.recipes_dir()); "
                               "from lightning_accel.config.compose import recipe_names; print(len(recipe_names()))"],
        cwd=cwd, env=env, capture_output=True, text=True, check=True,
    )
    conf, recipes, found = probe.stdout.split()
    assert Path(conf) == site / "lightning_accel" / "conf"
    assert Path(recipes) == site / "lightning_accel" / "recipes"
    assert int(found) == len(list((site / "lightning_accel" / "recipes").glob("*.yaml"))) == len(list((REPO / "recipes").glob("*.yaml")))
    # one recipe composed and checked by the installed copy; every recipe's validation is tests/test_cli.py's
    # (in process: `validate --all` here cost a minute, most of it the estimates of the GPU recipes)
    validated = subprocess.run([sys.executable, "-m", "lightning_accel", "validate", "gpt-tiny_cpu"],
                               cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert validated.returncode == 0, validated.stderr
    assert validated.stdout.splitlines() == ["ok  gpt-tiny_cpu"]


@pytest.mark.slow
def test_installed_wheel_finds_configs_and_recipes(tmp_path: Path) -> None:
    site = _installed_from_a_wheel()
    if site is not None:
        # CI installs this tree with `pip install ".[test]"`: pip built the wheel and installed it, so the copy under
        # test is that wheel's (building and installing a second one cost a minute of CI)
        for name in SHIPPED:
            assert (site / "lightning_accel" / name).is_file(), f"the installed wheel lacks lightning_accel/{name}"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed copy, not a tree on the path
        _check_installed(site, env, tmp_path)
        return
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = wheels.glob("lightning_accel-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in SHIPPED:
        assert f"lightning_accel/{name}" in names
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # run from a directory with no checkout in it, importing only the installed copy
    _check_installed(site, {**os.environ, "PYTHONPATH": str(site)}, tmp_path)
