"""cpu_budget against faked sources: affinity, cgroup v2/v1 quota files, SLURM and launcher variables."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from lightning_accel.cpu_budget import CpuBudget, cgroup_quota, cpu_budget, local_ranks
from tests.support.warm_python import python as warm_python


def no_cgroup(tmp_path: Path) -> dict:
    return {"proc_cgroup": tmp_path / "missing", "cgroup_root": tmp_path / "missing-root"}


def cgroup_v2(tmp_path: Path, cpu_max: dict[str, str], rel: str = "/job/step") -> dict:
    """A unified hierarchy; ``cpu_max`` maps a cgroup path (relative to the root) to its cpu.max."""
    root = tmp_path / "cgroup"
    (root / rel.strip("/")).mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    for path, text in cpu_max.items():
        (root / path.strip("/") / "cpu.max").write_text(text + "\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"0::{rel}\n")
    return {"proc_cgroup": proc, "cgroup_root": root}


def cgroup_v1(tmp_path: Path, quota: int, period: int, rel: str = "/docker/abc", mount: str = "cpu,cpuacct") -> dict:
    root = tmp_path / "cgroup"
    d = root / mount / rel.strip("/")
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (d / "cpu.cfs_period_us").write_text(f"{period}\n")
    (root / "memory").mkdir()
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"5:memory:{rel}\n3:{mount}:{rel}\n0::/\n")
    return {"proc_cgroup": proc, "cgroup_root": root}


def test_affinity_alone_decides_and_is_split_between_local_ranks(tmp_path):
    b = cpu_budget(environ={}, affinity=8, **no_cgroup(tmp_path))
    assert (b.cores, b.source, b.local_ranks) == (8, "affinity", 1)
    b = cpu_budget(environ={"LOCAL_WORLD_SIZE": "4"}, affinity=8, **no_cgroup(tmp_path))
    assert (b.cores, b.local_ranks, b.local_ranks_source) == (2, 4, "LOCAL_WORLD_SIZE")
    assert int(b) == 2
    assert str(b) == "2 CPU cores per rank (from affinity; affinity 8 / 4 local ranks (LOCAL_WORLD_SIZE))"


def test_more_ranks_than_cores_still_get_one_core_each(tmp_path):
    # The Megatron-LM report: 8 ranks on 2 cores. Each gets 1, never 0 (and never 2 x 4 = 8 threads).
    b = cpu_budget(8, environ={}, affinity=2, **no_cgroup(tmp_path))
    assert b.cores == 1 and b.local_ranks_source == "given"


def test_given_local_world_size_beats_the_environment(tmp_path):
    b = cpu_budget(2, environ={"LOCAL_WORLD_SIZE": "8"}, affinity=8, **no_cgroup(tmp_path))
    assert (b.cores, b.local_ranks) == (4, 2)


def test_cgroup_v2_quota_tighter_than_affinity(tmp_path):
    b = cpu_budget(environ={}, affinity=16, **cgroup_v2(tmp_path, {"/job/step": "max 100000", "/job": "250000 100000"}))
    # The parent's 2.5-core quota binds the child whose own cpu.max is unlimited; 2.5 cores -> 2 whole ones.
    assert (b.cores, b.source) == (2, "cgroup v2 quota")
    assert b.limits == {"affinity": 16.0, "cgroup v2 quota": 2.5}
    assert "cgroup v2 quota 2.50" in str(b)


def test_cgroup_v2_unlimited_leaves_affinity(tmp_path):
    b = cpu_budget(environ={}, affinity=4, **cgroup_v2(tmp_path, {"/job/step": "max 100000", "/job": "max 100000"}))
    assert (b.cores, b.source) == (4, "affinity")
    assert cgroup_quota(**cgroup_v2(tmp_path / "again", {"/job/step": "max 100000"})) is None


def test_cgroup_v2_quota_at_the_root_of_a_namespaced_container(tmp_path):
    # With a cgroup namespace /proc/self/cgroup says "0::/" and the limit is the mount's own cpu.max.
    b = cpu_budget(environ={}, affinity=64, **cgroup_v2(tmp_path, {"/": "100000 100000"}, rel="/"))
    assert (b.cores, b.source) == (1, "cgroup v2 quota")


def test_cgroup_v1_quota_on_a_hybrid_host(tmp_path):
    b = cpu_budget(environ={}, affinity=8, **cgroup_v1(tmp_path, 300000, 100000))
    assert (b.cores, b.source) == (3, "cgroup v1 quota")
    # -1 means no quota; a mount named plain "cpu" is found too.
    b = cpu_budget(environ={}, affinity=8, **cgroup_v1(tmp_path / "b", -1, 100000, mount="cpu"))
    assert (b.cores, b.source) == (8, "affinity")
    b = cpu_budget(environ={}, affinity=8, **cgroup_v1(tmp_path / "c", 50000, 100000, mount="cpu"))
    assert (b.cores, b.limits["cgroup v1 quota"]) == (1, 0.5)


def test_quota_is_shared_by_local_ranks(tmp_path):
    b = cpu_budget(environ={"SLURM_NTASKS_PER_NODE": "2(x3)"}, affinity=16, **cgroup_v1(tmp_path, 800000, 100000))
    assert (b.cores, b.local_ranks, b.local_ranks_source) == (4, 2, "SLURM_NTASKS_PER_NODE")


def test_slurm_cpus_per_task_is_per_rank_and_not_split_again(tmp_path):
    env = {"SLURM_CPUS_PER_TASK": "4", "SLURM_NTASKS_PER_NODE": "2"}
    b = cpu_budget(environ=env, affinity=8, **no_cgroup(tmp_path))
    assert (b.cores, b.source) == (4, "SLURM_CPUS_PER_TASK")
    # Issue 14: SLURM_CPUS_PER_TASK=1 on a 2-core machine allows 1, not 8.
    b = cpu_budget(environ={"SLURM_CPUS_PER_TASK": "1"}, affinity=2, **no_cgroup(tmp_path))
    assert (b.cores, b.source) == (1, "SLURM_CPUS_PER_TASK")


def test_slurm_capped_by_a_tighter_affinity(tmp_path):
    b = cpu_budget(environ={"SLURM_CPUS_PER_TASK": "8"}, affinity=3, **no_cgroup(tmp_path))
    assert (b.cores, b.source) == (3, "affinity")


def test_nothing_readable_falls_back_to_cpu_count(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # as on macOS
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    b = cpu_budget(environ={}, **no_cgroup(tmp_path))
    assert (b.cores, b.source) == (6, "os.cpu_count()")


def test_real_affinity_and_environment_are_read(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    b = cpu_budget(**no_cgroup(tmp_path))
    assert (b.cores, b.limits["affinity"], b.local_ranks) == (1, 3.0, 3)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux sched_setaffinity")
def test_taskset_one_core_in_a_real_process(tmp_path):
    # Issue 14: under `taskset -c 0` the budget must be 1 on any machine. A warm process (tests/support/warm_python.py:
    # no ~7 s import of Lightning; its affinity is the launcher's, then the script's own)
    script = tmp_path / "one_core.py"
    script.write_text("import os; os.sched_setaffinity(0, {0}); from lightning_accel.cpu_budget import cpu_budget; "
                      "print(cpu_budget().cores)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_CPUS_PER_TASK", "LOCAL_WORLD_SIZE")}
    out = subprocess.run([warm_python(), str(script)], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "1"


def test_local_ranks_sources_in_order():
    assert local_ranks({}) == (1, "default")
    assert local_ranks({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == (4, "OMPI_COMM_WORLD_LOCAL_SIZE")
    assert local_ranks({"LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "8"}) == (2, "LOCAL_WORLD_SIZE")


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"SLURM_CPUS_PER_TASK": "many"}, r"SLURM_CPUS_PER_TASK='many' is not a count.*unset it"),
        ({"SLURM_CPUS_PER_TASK": "0"}, r"SLURM_CPUS_PER_TASK='0' must be >= 1"),
        ({"LOCAL_WORLD_SIZE": "-2"}, r"LOCAL_WORLD_SIZE='-2' must be >= 1"),
    ],
)
def test_bad_environment_values_are_named(tmp_path, env, match):
    with pytest.raises(ValueError, match=match):
        cpu_budget(environ=env, affinity=2, **no_cgroup(tmp_path))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_local_world_size(tmp_path, bad):
    with pytest.raises(ValueError, match=r"local_world_size=.* must be a positive integer"):
        cpu_budget(bad, environ={}, affinity=2, **no_cgroup(tmp_path))


def test_budget_is_plain_data():
    b = CpuBudget(2, "affinity", 1, "default", {"affinity": 2.0})
    assert b == CpuBudget(2, "affinity", 1, "default", {"affinity": 2.0})
    assert str(b) == "2 CPU cores per rank (from affinity; affinity 2)"
