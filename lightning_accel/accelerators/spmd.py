"""Data parallelism over the devices of one host by SPMD: one process, the batch split along dim 0.

``torch_xla``'s older way to use several devices, one replica per device (``xmp.spawn``)
whose gradients meet in ``xm.all_reduce``, cannot run on the CPU PJRT device in torch_xla
2.9: ``xmp.spawn`` drives the CPU devices from threads of one process, each thread compiles
its own copy of the step, the copies number their all-reduce differently (``op_id``), and
XLA's CPU rendezvous waits for peers that never come, then aborts the process after 10 s
(pytorch/xla#5005, #9089: "collective operations are hanging when using XLA:CPU"). SPMD
compiles the step once for all devices: the parameters are replicated, each batch is
sharded along its first dimension over a one-axis mesh ``("data",)``, and the XLA
partitioner inserts the gradient all-reduce. The same code runs on a TPU host, on CUDA
GPUs, and on the CPU (``CPU_NUM_DEVICES=N``), so the multi-device path is tested anywhere.

What that means for a Lightning user: one process and one rank (world size 1), so the
batch size is the *global* batch (each of N devices computes ``batch_size / N`` rows; XLA
pads a batch that does not divide), no ``DistributedSampler`` is needed, and only this
process writes logs and checkpoints. One program is compiled for all the devices, so the
compile count means the same as on one device. On a TPU host ``xmp.spawn`` would work (one
process per chip), but SPMD gives one code path that the CPU lane tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

MESH_AXIS = "data"


@dataclass(frozen=True)
class Placement:
    """Where the model trains: ``index`` of one device, or all ``count`` devices under SPMD."""

    index: int = 0
    count: int = 1

    @property
    def spmd(self) -> bool:
        return self.count > 1


def plan_placement(indices: list[int], available: int, hint: str = "") -> Placement:
    """The placement for the device ``indices`` asked for, out of ``available`` PJRT devices.

    One index: that device alone. Several: SPMD over all of them, which needs every device
    of the host (an SPMD mesh spans all devices the runtime has).
    """
    if not indices:
        raise ValueError("devices=[] names no device; use devices=1, devices=[i], or devices=-1 for all of them")
    if len(indices) == 1:
        return Placement(index=indices[0])
    if sorted(indices) != list(range(available)):
        more = f"; or {hint}" if hint else ""
        raise ValueError(
            f"devices={indices} asks for {len(indices)} of the {available} PJRT devices, but data parallelism "
            f"on XLA (SPMD) spans all the devices of the host; set devices={available} or devices=-1{more}"
        )
    return Placement(count=available)


def enable(count: int) -> Any:
    """Switch this process to SPMD over ``count`` devices; returns the one-axis data mesh.

    torch_xla cannot switch a process back: every later XLA computation in it is SPMD.
    """
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    if not xr.is_spmd() and torch_xla._XLAC._xla_get_spmd_config_is_locked():
        # torch_xla offers to replicate such tensors (use_spmd's warning), then segfaults on the CPU client.
        raise ValueError(
            f"data parallel over {count} devices needs SPMD, which must start before the process uses an XLA device, "
            "but this one already has (torch_xla.device(), an XLA tensor, or a single-device fit); "
            "run the multi-device fit in a fresh process"
        )
    if xr.process_count() > 1:
        raise ValueError(
            f"SPMD over {xr.process_count()} hosts is not supported by strategy 'xla_pjrt' (one host only); "
            "train on the devices of one host"
        )
    if not xr.is_spmd():  # a second fit or trainer.validate in the same process: already SPMD
        xr.use_spmd()
    mesh = xs.Mesh(np.arange(count), (count,), (MESH_AXIS,))
    xs.set_global_mesh(mesh)
    return mesh


def shard_batch(batch: Any, mesh: Any) -> Any:
    """Shard each XLA tensor of ``batch`` along its first dimension over ``mesh`` (in place).

    A tensor with fewer rows than devices (or none: a scalar) stays replicated.
    """
    import torch_xla.distributed.spmd as xs
    from lightning_utilities.core.apply_func import apply_to_collection

    devices = mesh.size()

    def shard(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "xla" and t.dim() >= 1 and t.shape[0] >= devices:
            xs.mark_sharding(t, mesh, (MESH_AXIS,) + (None,) * (t.dim() - 1))
        return t

    return apply_to_collection(batch, torch.Tensor, shard)
