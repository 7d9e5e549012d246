"""Shared fixtures: a seed, and a cache/output location that never touches $HOME."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One corpus cache for the whole session: the stdlib corpus is built once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, cache_dir: Path, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("LIGHTNING_ACCEL_CACHE", str(cache_dir))
    monkeypatch.setenv("LIGHTNING_ACCEL_OUTPUTS", str(tmp_path / "outputs"))
    yield
    # seed_everything (the seed fixture, an in-process run) exports PL_GLOBAL_SEED and PL_SEED_WORKERS: dropped after
    # each test, or every later multi-process test's ranks inherit them and Lightning's DistributedSampler shuffles by
    # that seed, not the reference's 0
    for var in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        os.environ.pop(var, None)


@pytest.fixture
def seed() -> int:
    import lightning

    lightning.seed_everything(1234, verbose=False)
    return 1234


@pytest.fixture
def cli_env(cache_dir: Path, tmp_path: Path) -> dict[str, str]:
    """Environment for running the CLI in a subprocess."""
    env = dict(os.environ)
    env.update(
        LIGHTNING_ACCEL_CACHE=str(cache_dir),
        LIGHTNING_ACCEL_OUTPUTS=str(tmp_path / "outputs"),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "2"),
    )
    env.pop("HYDRA_FULL_ERROR", None)
    env.pop("LIGHTNING_ACCEL_RECIPE", None)  # set only in DDP ranks re-launched by Lightning
    # An in-process Lightning process group (some strategy tests) leaves these behind; a
    # child that inherits LOCAL_RANK believes it was launched and never starts its peers.
    for var in ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        env.pop(var, None)
    return env


class CliProcesses:
    """``python -m lightning_accel ARGS`` started now and collected later, so that two runs can go side by side:
    most of a short run is importing Lightning, on one core."""

    def start(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "lightning_accel", *args], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def finish(self, proc: subprocess.Popen[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"{' '.join(map(str, proc.args))} ran past {timeout} s:\n{err[-3000:]}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def cli_processes() -> CliProcesses:
    return CliProcesses()
