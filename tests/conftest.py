"""Shared fixtures: a seed, and a cache/output location that never touches $HOME."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support.warm_python import python as warm_python

# One intra-op thread for the tests and every process they start (unless OMP_NUM_THREADS is set): the models here are
# tiny, so a kernel gains nothing from a second thread, while on CI's two shared cores every process's second thread
# spin-waits at each kernel's barrier (side-by-side runs: 4 processes, 8 threads). A CLI run of gpt-tiny_cpu, 8 steps,
# at load 10 on this 2-core machine: 35.5 s of CPU with 2 threads, 18.2 s with 1. Tests of how threads are chosen set
# their own count (tests/offload/test_host_threads.py, test_l2l_host_step.py's budget test).
os.environ.setdefault("OMP_NUM_THREADS", "1")
if os.environ["OMP_NUM_THREADS"].isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One corpus cache for the whole session: the stdlib corpus is built once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, cache_dir: Path, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("LIGHTNING_ACCEL_CACHE", str(cache_dir))
    monkeypatch.setenv("LIGHTNING_ACCEL_OUTPUTS", str(tmp_path / "outputs"))
    # a strategy set up in-process as rank r (DDPStrategy._set_world_ranks) sets Lightning's rank_zero_only.rank to r
    # for the whole process: put back after each test, or every later rank_zero_warn/rank_zero_info is silent and
    # pytest.warns/caplog in tests far away see nothing (CI on 2026-12-02: 14 tests after test_gpipe_ranks.py)
    ranks = [(holder, holder.rank) for holder in _rank_zero_holders()]
    yield
    for holder, rank in ranks:
        holder.rank = rank
    # seed_everything (the seed fixture, an in-process run) exports PL_GLOBAL_SEED and PL_SEED_WORKERS: dropped after
    # each test, or every later multi-process test's ranks inherit them and Lightning's DistributedSampler shuffles by
    # that seed, not the reference's 0
    for var in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        os.environ.pop(var, None)


def _rank_zero_holders() -> list[object]:
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.utilities.rank_zero import rank_zero_only as pytorch_rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    return [fabric_rank_zero_only, pytorch_rank_zero_only, utils_rank_zero_only]


@pytest.fixture
def group_of_one() -> Iterator[dist.ProcessGroup]:
    """A gloo process group of one rank in this process (the world's own, then a new group over it, as a strategy
    makes one), destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: in-memory, no port
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


@pytest.fixture
def seed() -> int:
    import lightning

    lightning.seed_everything(1234, verbose=False)
    return 1234


def cli_env_with(cache_dir: Path, outputs: Path) -> dict[str, str]:
    """Environment for running the CLI in a subprocess: this process's, with the cache and the outputs given,
    unbuffered output, and nothing left over from an in-process run."""
    env = dict(os.environ)
    env.update(
        LIGHTNING_ACCEL_CACHE=str(cache_dir),
        LIGHTNING_ACCEL_OUTPUTS=str(outputs),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    env.pop("HYDRA_FULL_ERROR", None)
    env.pop("LIGHTNING_ACCEL_RECIPE", None)  # set only in DDP ranks re-launched by Lightning
    # An in-process Lightning process group (some strategy tests) leaves these behind; a
    # child that inherits LOCAL_RANK believes it was launched and never starts its peers.
    for var in ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        env.pop(var, None)
    return env


@pytest.fixture
def cli_env(cache_dir: Path, tmp_path: Path) -> dict[str, str]:
    """Environment for running the CLI in a subprocess."""
    return cli_env_with(cache_dir, tmp_path / "outputs")


@pytest.fixture(scope="session")
def make_cli_env(cache_dir: Path) -> Callable[[Path], dict[str, str]]:
    """:func:`cli_env_with` for a module-scoped fixture: the outputs directory is the caller's."""
    return lambda outputs: cli_env_with(cache_dir, outputs)


@dataclass
class CliJob:
    """One ``python -m lightning_accel ARGS`` for :meth:`CliProcesses.side_by_side`: ``processes`` it runs at once
    (a 2-rank run: 2), and the job whose end it waits for (``after``: a resume waits for its killed run)."""

    args: list[str]
    env: dict[str, str]
    processes: int = 1
    after: str | None = None


class CliProcesses:
    """``python -m lightning_accel ARGS`` started now and collected later, so that two runs can go side by side:
    most of a short run is importing Lightning, on one core."""

    def start(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        return subprocess.Popen([warm_python(), "-m", "lightning_accel", *args], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def finish(self, proc: subprocess.Popen[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"{' '.join(map(str, proc.args))} ran past {timeout} s:\n{err[-3000:]}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def job(self, args: list[str], env: dict[str, str], processes: int = 1, after: str | None = None) -> CliJob:
        return CliJob(args, env, processes, after)

    def side_by_side(self, jobs: dict[str, CliJob], slots: int = 4, timeout: float = 900) -> dict[str, subprocess.CompletedProcess[str]]:
        """Every job run, in the order given as far as ``after`` allows, with at most ``slots`` processes alive
        at once (one job at least): two per core keeps both of this machine's cores busy while a run imports or
        a launched rank waits for its peer, where every run at once (14 processes) slowed one of them to minutes.
        Output goes to files, so that no job blocks on a full pipe while another is awaited."""
        pending, running, done = dict(jobs), {}, {}
        with tempfile.TemporaryDirectory() as logs:
            while pending or running:
                for name, job in list(pending.items()):
                    busy = sum(jobs[n].processes for n in running)
                    if (job.after is None or job.after in done) and (not running or busy + job.processes <= slots):
                        stem = Path(logs, str(len(done) + len(running)))
                        out, err = open(f"{stem}.out", "w+"), open(f"{stem}.err", "w+")
                        proc = subprocess.Popen([warm_python(), "-m", "lightning_accel", *job.args], env=job.env, stdout=out,
                                                stderr=err, text=True)
                        running[name] = (proc, out, err, time.monotonic())
                        del pending[name]
                if pending and not running:  # nothing can start: an `after` names a job that is not in `jobs`
                    missing = sorted({str(j.after) for j in pending.values()})
                    raise ValueError(f"jobs {sorted(pending)} wait for jobs that are not given: {missing}")
                for name, (proc, out, err, started) in list(running.items()):
                    overran = proc.poll() is None
                    if overran and time.monotonic() - started < timeout:
                        continue
                    if overran:
                        proc.kill()
                        proc.wait()
                    out.seek(0), err.seek(0)
                    stdout, stderr = out.read(), err.read()
                    out.close(), err.close()
                    if overran:
                        stderr += f"\n[ran past {timeout} s: killed by the test]"
                    done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
                    del running[name]
                time.sleep(0.1)
        return done


@pytest.fixture(scope="session")
def cli_processes() -> CliProcesses:
    return CliProcesses()


@pytest.fixture(scope="session")
def ls_output() -> tuple[int, str]:
    """``lightning-accel ls`` run once in this process, its exit status and what it printed: it composes every recipe
    and builds its network on the meta device (a 70B Llama's included), seconds each time the tests that read its
    rows ran it."""
    import contextlib
    import io

    from lightning_accel import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(["ls"])
    return status, out.getvalue()
