"""The ``("pp", "dp")`` device mesh of the multi-process pipeline, and one per process.

``pp`` ranks make one pipeline, ``dp = world_size // pp`` replicas of it train data
parallel; global rank ``pp_rank * dp + dp_rank`` (:func:`mesh_coordinates`). Why ``pp``
outermost (as torchtitan and Megatron order their meshes): the gradient all-reduce moves a
whole stage's gradients at every step, the pipeline only the activations at the stage
boundaries, so the ``dp`` ranks are the adjacent ones (one host's local ranks are
consecutive: its fast links), and a pipeline may cross hosts.

:func:`process_mesh` builds the mesh once per process group and hands every later fit
the same one. :func:`ranks_per_pipeline` says how many ranks make one pipeline, and
:func:`check_world_size` refuses a world size that is not a multiple of it, before any
process starts. No Lightning here.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_accel.pipeline.placement import RankLayout

__all__ = [
    "check_ranks_per_pipeline", "check_world_size", "hold_mesh", "mesh_coordinates", "pipeline_mesh", "process_mesh",
    "rank_layout", "ranks_per_pipeline",
]


def mesh_coordinates(rank: int, world_size: int, pp: int) -> tuple[int, int]:
    """``(pp_rank, dp_rank)`` of global rank ``rank`` on the ``("pp", "dp")`` mesh of ``world_size`` ranks, ``pp`` per pipeline."""
    if pp < 1 or world_size % pp:
        raise ValueError(
            f"world size {world_size} is not a multiple of {pp} pipeline ranks; run a multiple of {pp} processes"
        )
    dp = world_size // pp
    return rank // dp, rank % dp


def check_ranks_per_pipeline(pp: int | None, balance: Sequence[int] | str, stages_per_rank: int, schedule: str) -> None:
    """Refuse a ``pipeline_parallel_size`` that is not a positive int, or one that a balance list contradicts."""
    if pp is not None and (not isinstance(pp, int) or isinstance(pp, bool) or pp < 1):
        raise ValueError(f"pipeline_parallel_size must be a positive int (ranks per pipeline), got {pp!r}")
    if pp is not None and not isinstance(balance, str) and len(balance) != stages_per_rank * pp:
        raise ValueError(
            f"balance {list(balance)} has {len(balance)} stages but pipeline_parallel_size={pp} "
            f"ranks run {stages_per_rank * pp} with schedule {schedule!r}; drop one of the two"
        )


def ranks_per_pipeline(pp: int | None, balance: Sequence[int] | str, stages_per_rank: int, world_size: int) -> int:
    """``pp`` when given; else ``len(balance) // stages_per_rank`` for a balance list; else every rank (dp = 1)."""
    if pp is not None:
        return pp
    if not isinstance(balance, str) and len(balance) % stages_per_rank == 0:
        return len(balance) // stages_per_rank
    return world_size


def check_world_size(world_size: int, pp: int, given: str, who: str) -> None:
    """Refuse a world size that is not a multiple of ``pp`` ranks per pipeline (``given``: where ``pp`` came from)."""
    if world_size % pp:
        raise ValueError(
            f"{who}: world size {world_size} is not a multiple of pipeline_parallel_size={pp} "
            f"(ranks per pipeline, {given}); run a multiple of {pp} processes (devices x num_nodes), or set "
            f"pipeline_parallel_size (and balance) to a divisor of {world_size}"
        )


def rank_layout(mesh: DeviceMesh, rank: int, device: torch.device) -> RankLayout:
    """Global rank ``rank`` on ``mesh`` (:func:`pipeline_mesh`): its coordinates, the sizes, its two groups, its device."""
    pp, dp = mesh.shape
    pp_rank, dp_rank = mesh_coordinates(rank, pp * dp, pp)
    return RankLayout(pp_rank, dp_rank, pp, dp, mesh.get_group("pp"), mesh.get_group("dp"), device)


def pipeline_mesh(device_type: str, world_size: int, pp: int, timeout: timedelta | None = None) -> DeviceMesh:
    """The ``("pp", "dp")`` device mesh of the default process group: ``pp`` ranks per pipeline, ``world_size // pp`` replicas.

    ``timeout``: how long the mesh's groups wait for a rank (gloo and nccl). Without it they get
    torch's default (30 minutes for gloo), not the default group's: a hung peer on a pipeline or
    replica group would outwait the timeout the user set.
    """
    mesh_coordinates(0, world_size, pp)  # the check
    options = None if timeout is None else _group_options(dist.get_backend(), timeout)
    override = None if options is None else {"pp": options, "dp": options}
    return init_device_mesh(device_type, (pp, world_size // pp), mesh_dim_names=("pp", "dp"), backend_override=override)


def _group_options(backend: str, timeout: timedelta) -> Any:
    """Process-group options carrying ``timeout`` for ``backend`` (None for a backend without such options)."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    options._timeout = timeout
    return options


# (device type, world size, pp, timeout) -> the mesh of this process group and its groups; see process_mesh
_MESHES: dict[tuple[str, int, int, Any], tuple[DeviceMesh, tuple[Any, ...]]] = {}
_HOLDERS: weakref.WeakSet[Any] = weakref.WeakSet()  # objects holding a mesh in ``_mesh``, let go of it at exit


def process_mesh(device_type: str, world_size: int, pp: int, timeout: timedelta) -> DeviceMesh:
    """The ``("pp", "dp")`` mesh of the current process group, built once per process and shared by every fit.

    Why one: ``init_device_mesh`` creates new process groups (for ``dp = 1`` too: one of one rank
    per rank), each gloo group with its own threads, and ``destroy_process_group`` does not stop
    those threads; they end only when the last reference to the group goes. A mesh per fit left
    one set per fit alive into interpreter shutdown. A mesh whose groups the process group no
    longer holds (destroyed, then initialized again) is replaced.
    """
    key = (device_type, world_size, pp, timeout)
    found = _MESHES.get(key)
    if found is not None and all(g in dist.distributed_c10d._world.pg_map for g in found[1]):
        return found[0]
    mesh = pipeline_mesh(device_type, world_size, pp, timeout)
    _MESHES[key] = (mesh, (mesh.get_group("pp"), mesh.get_group("dp")))
    return mesh


def hold_mesh(holder: Any) -> None:
    """``holder._mesh`` is set to None at exit (see :func:`_release_meshes`)."""
    _HOLDERS.add(holder)


@atexit.register
def _release_meshes() -> None:
    """At exit, while the interpreter is whole: drop every reference to the meshes (and collect finished Trainers that
    still hold old ones), so once ``destroy_process_group`` has run, their gloo groups are freed and join their threads
    now, not at some point of interpreter teardown."""
    for holder in list(_HOLDERS):
        holder._mesh = None
    if _MESHES:
        _MESHES.clear()
        gc.collect()
