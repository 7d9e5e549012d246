"""The CPU cores one rank may use: affinity, cgroup quota, SLURM and the ranks sharing the host.

``os.cpu_count()`` counts the machine's cores, not the ones this process may run on:
under ``taskset -c 0``, in a container with a CPU quota, in a SLURM job with
``--cpus-per-task=1`` or with eight ranks on one host it overstates what a rank has,
and threads or loader workers sized from it oversubscribe the cores (eight ranks on two
cores have been reported 10x slower). Every sizing decision (loader workers, host
optimizer threads, copy threads) asks :func:`cpu_budget` instead.

The rule, in order:

1. the cores this process may run on: the smallest of its affinity mask
   (``os.sched_getaffinity``) and the cgroup CPU quota (v2 ``cpu.max`` or v1
   ``cpu.cfs_quota_us / cpu.cfs_period_us``, the tightest along the cgroup's path),
   ``os.cpu_count()`` where neither can be read;
2. split between the local ranks: those limits belong to the launcher's process group,
   which torchrun or Lightning's launcher shares between all ranks on the host;
3. where ``SLURM_CPUS_PER_TASK`` is set, SLURM has already sized each task (= rank):
   that count is the rank's share, capped by (1) but not split again;
4. at least one core.

Plain data in and out, no Lightning or torch import: the offload strategy's host step
and the prefetch tuner both use it, and it is tested by faking each source.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# Environment variables that carry the number of ranks on this host, first found wins:
# torchrun/torchelastic, SLURM (Lightning's SLURMEnvironment reads it too), Open MPI, MPICH/Intel MPI.
LOCAL_RANKS_ENV = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


@dataclass(frozen=True)
class CpuBudget:
    """How many cores a rank may use, and where that number came from.

    ``cores``: the budget (an integer >= 1). ``source``: the limit that decided it
    (``"affinity"``, ``"cgroup v2 quota"``, ``"cgroup v1 quota"``, ``"SLURM_CPUS_PER_TASK"``
    or ``"os.cpu_count()"``). ``local_ranks``: the ranks sharing the host's limits, and
    ``local_ranks_source`` where that count came from. ``limits``: every limit that was
    found, in cores (a quota may be fractional).
    """

    cores: int
    source: str
    local_ranks: int
    local_ranks_source: str
    limits: Mapping[str, float] = field(default_factory=dict)

    def __int__(self) -> int:
        return self.cores

    def __str__(self) -> str:
        found = ", ".join(f"{k} {_fmt(v)}" for k, v in self.limits.items())
        split = f" / {self.local_ranks} local ranks ({self.local_ranks_source})" if self.local_ranks > 1 else ""
        return f"{self.cores} CPU core{'s' if self.cores != 1 else ''} per rank (from {self.source}; {found}{split})"


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.2f}"


def _positive_int(name: str, raw: str) -> int:
    """The leading integer of an env value; SLURM writes per-node counts as ``2(x3)`` or ``2,1``."""
    head = raw.strip().split("(")[0].split(",")[0]
    try:
        value = int(head)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a count of CPUs/ranks; unset it or set a positive integer") from None
    if value < 1:
        raise ValueError(f"{name}={raw!r} must be >= 1; unset it or set a positive integer")
    return value


def local_ranks(environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The number of ranks on this host from the launcher's environment, and the variable it came from."""
    env = os.environ if environ is None else environ
    for name in LOCAL_RANKS_ENV:
        if env.get(name, "").strip():
            return _positive_int(name, env[name]), name
    return 1, "default"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _along(root: Path, rel: str) -> list[Path]:
    """``root/rel`` and its parents up to ``root``, deepest first, those that exist.

    A limit set on a parent cgroup binds its children too; in a container that does not
    namespace cgroups the path from ``/proc/self/cgroup`` is not visible and only the
    mount's root is found.
    """
    parts = [p for p in rel.strip("/").split("/") if p and p != ".."]
    dirs = [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _v2_quota(root: Path, rel: str) -> float | None:
    quotas = []
    for d in _along(root, rel):
        text = _read(d / "cpu.max")  # "max 100000" or "150000 100000"
        if text:
            quota, _, period = text.partition(" ")
            if quota != "max" and period:
                quotas.append(int(quota) / int(period))
    return min(quotas) if quotas else None


def _v1_quota(root: Path, rel: str) -> float | None:
    quotas = []
    for d in _along(root, rel):
        quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if quota and period and int(quota) > 0 and int(period) > 0:
            quotas.append(int(quota) / int(period))
    return min(quotas) if quotas else None


def cgroup_quota(
    proc_cgroup: str | Path = "/proc/self/cgroup", cgroup_root: str | Path = "/sys/fs/cgroup"
) -> tuple[float, str] | None:
    """The tightest CPU quota (in cores) over this process's cgroups, v2 and v1; ``None`` when unlimited."""
    text = _read(Path(proc_cgroup))
    root = Path(cgroup_root)
    if text is None or not root.is_dir():
        return None
    found: list[tuple[float, str]] = []
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            # cgroup v2: the unified hierarchy at the root, or at root/unified on hybrid hosts.
            for base in (root, root / "unified"):
                q = _v2_quota(base, rel)
                if q is not None:
                    found.append((q, "cgroup v2 quota"))
                    break
        elif "cpu" in controllers.split(","):
            # cgroup v1: the cpu controller is mounted as root/cpu or root/cpu,cpuacct.
            for d in sorted(root.iterdir()) if root.is_dir() else []:
                if "cpu" in d.name.split(",") and d.is_dir():
                    q = _v1_quota(d, rel)
                    if q is not None:
                        found.append((q, "cgroup v1 quota"))
                        break
    return min(found) if found else None


def _affinity() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        return None


def cpu_budget(
    local_world_size: int | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    affinity: int | None = None,
    proc_cgroup: str | Path = "/proc/self/cgroup",
    cgroup_root: str | Path = "/sys/fs/cgroup",
) -> CpuBudget:
    """The cores this rank may use; see the module docstring for the rule.

    ``local_world_size``: the ranks on this host when the caller knows it (a Lightning
    ``Trainer``'s ``num_devices``; Lightning's launcher does not export it); otherwise it is
    read from the launcher's environment (``LOCAL_WORLD_SIZE``, ``SLURM_NTASKS_PER_NODE``,
    ...), 1 where none is set. ``environ``, ``affinity``, ``proc_cgroup`` and
    ``cgroup_root`` stand in for the real sources in tests.
    """
    env = os.environ if environ is None else environ
    if local_world_size is not None:
        if isinstance(local_world_size, bool) or not isinstance(local_world_size, int) or local_world_size < 1:
            raise ValueError(
                f"local_world_size={local_world_size!r} must be a positive integer (the ranks on this host); "
                "pass None to read it from the launcher's environment"
            )
        ranks, ranks_source = local_world_size, "given"
    else:
        ranks, ranks_source = local_ranks(env)

    limits: dict[str, float] = {}
    aff = _affinity() if affinity is None else affinity
    if aff:
        limits["affinity"] = float(aff)
    quota = cgroup_quota(proc_cgroup, cgroup_root)
    if quota is not None:
        limits[quota[1]] = quota[0]
    if not limits:
        limits["os.cpu_count()"] = float(os.cpu_count() or 1)
    host_source = min(limits, key=lambda k: limits[k])
    host = limits[host_source]

    slurm = env.get("SLURM_CPUS_PER_TASK", "").strip()
    if slurm:
        per_task = _positive_int("SLURM_CPUS_PER_TASK", slurm)
        limits["SLURM_CPUS_PER_TASK"] = float(per_task)
        if per_task <= host:
            return CpuBudget(per_task, "SLURM_CPUS_PER_TASK", ranks, ranks_source, limits)
        # The host allows less than SLURM promised a task (a tighter taskset/quota inside the job).
        return CpuBudget(max(1, math.floor(host)), host_source, ranks, ranks_source, limits)
    return CpuBudget(max(1, math.floor(host / ranks)), host_source, ranks, ranks_source, limits)
