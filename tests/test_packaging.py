"""A built wheel carries conf/ and recipes/, and an installed copy finds and runs them."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_installed_wheel_finds_configs_and_recipes(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = wheels.glob("lightning_accel-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "lightning_accel/conf/train.yaml" in names
    assert "lightning_accel/conf/trainer/default.yaml" in names
    assert "lightning_accel/recipes/gpt-tiny_cpu.yaml" in names
    assert "lightning_accel/offload/shadow_kernel.c" in names  # built at first use by the installed copy

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # Run from a directory with no checkout in it, importing only the installed copy.
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = subprocess.run(
        [sys.executable, "-c", "import lightning_accel.config.locate as l; print(l.conf_dir()); print(l.recipes_dir()); "
                               "from lightning_accel.config.compose import recipe_names; print(len(recipe_names()))"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
    )
    conf, recipes, found = probe.stdout.split()
    assert Path(conf) == site / "lightning_accel" / "conf"
    assert Path(recipes) == site / "lightning_accel" / "recipes"
    assert int(found) == len(list((site / "lightning_accel" / "recipes").glob("*.yaml"))) == len(list((REPO / "recipes").glob("*.yaml")))
    # one recipe composed and checked by the installed copy; every recipe's validation is tests/test_cli.py's
    # (in process: `validate --all` here cost a minute, most of it the estimates of the GPU recipes)
    validated = subprocess.run([sys.executable, "-m", "lightning_accel", "validate", "gpt-tiny_cpu"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert validated.returncode == 0, validated.stderr
    assert validated.stdout.splitlines() == ["ok  gpt-tiny_cpu"]
