"""The L2L (layer-to-layer) CPU offload strategy on one device: ``Trainer(strategy="l2l_offload")``.

The hooks, and what each adds, are :class:`~lightning_accel.strategies.l2l_offload_hooks.L2LOffloadHooks`'
(shared with the data-parallel :class:`~lightning_accel.strategies.L2LOffloadDDPStrategy`,
``"l2l_offload_ddp"``). This class adds them to ``SingleDeviceStrategy``, picks the device
(``device=``, else the Trainer's: ``devices=[1]`` is cuda:1), and refuses, when the ``Trainer``
is built, ``devices``, ``num_nodes`` or a launcher's ``WORLD_SIZE`` above 1: it would train on
one device and silently drop the rest; the error names the data-parallel strategy. A model built on the meta device
(``trainer.init_module(empty_init=True)``, ``torch.device("meta")`` in ``configure_model``, or
:func:`~lightning_accel.offload.materialize.load_by_block`) is materialized unit by unit in ``setup``
(:mod:`lightning_accel.strategies.l2l_materialize`): with ``nvme_path`` it is never in host memory whole.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_accel.models.block_policy import BlockPolicy
from lightning_accel.strategies.l2l_offload_hooks import L2LOffloadHooks
from lightning_accel.strategies.options_check import check_device_accelerator, check_options

__all__ = ["L2LOffloadHooks", "L2LOffloadStrategy"]


def beyond_one_device(devices: int, num_nodes: int) -> list[str]:
    """What asks for more than one process on one device (``devices``, ``num_nodes``, a launcher's ``WORLD_SIZE``), as
    settings to name in the refusal; empty when nothing does. Both front doors (the Trainer's and Fabric's
    ``l2l_offload``) refuse from this one list."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    asked = [f"devices={devices}"] if devices > 1 else []
    asked += [f"num_nodes={num_nodes}"] if num_nodes > 1 else []
    asked += [f"WORLD_SIZE={world} (a launcher such as torchrun)"] if world > 1 else []
    return asked


class L2LOffloadStrategy(L2LOffloadHooks, SingleDeviceStrategy):
    """Train on one device with the model's blocks offloaded to host memory.

    Args:
        blocks: which submodules stream: ``"auto"`` (the longest ModuleList of one class, or
            each child of a mixed ``nn.Sequential``; a model with neither: each direct child that has parameters; see
            :func:`lightning_accel.models.block_policy.find_blocks`), class names/classes
            (``["GPTBlock"]``), or a callable ``model -> modules``.
        prefetch_blocks: how many blocks ahead to copy while one computes (device memory
            grows by one block per step of depth; 1 hides the copy behind compute).
        offload_resident: also keep the non-block parameters on the host, streamed in for
            each step (saves their device memory, costs their copy every step). None (default): off, except where
            the NVMe tier's plan streams them to keep ``host_budget`` on a CPU device (there they are host memory
            with their gradients and optimizer state; streamed, those go to the tier's files like a block's).
        checkpoint_blocks: recompute each block in backward instead of keeping its
            activations and weights (device memory independent of depth; about one extra
            forward of compute).
        overlap_step: step each block on the host as soon as its gradients arrive, while
            the backward pass continues (off automatically under clipping / fp16). None
            (default): on when the device is an accelerator; off on the CPU, where the
            "host" step would compete with the "device" compute for the same cores
            (measured: 1.58x plain with it, 1.26x without, in ``bench offload``), except with
            ``nvme_path``, or where ``host_budget`` needs it: stepped during the backward only a few
            blocks' gradients are held at once, after it every block's (the plan line says the choice).
            With ``delayed_update`` it applies to the warm-up steps only.
        delayed_update: ZeRO-Offload's one-step delayed parameter update. The host update
            for step t (computed from step t's gradients, clipped by their own global norm
            when ``gradient_clip_val`` is set, with step t's learning rate) runs on the host
            while step t+1's forward and backward run, so step t+1 computes on weights that
            do not yet include update t: one step stale. The host step overlaps the whole
            next step (also under clipping; the step waits only for an update longer than
            itself), at the cost of that staleness and one more copy of the host parameters
            in host memory (the compute snapshot). Parameters
            kept on the device (the resident unit unless ``offload_resident``) are updated
            at once, as usual. A pending update is applied before validation, before every
            checkpoint is written, before a step at which what trains changed (a backbone
            unfrozen) and at the end of fit (waiting for it there); the step
            after such a point computes on fully updated weights, as a resumed run does,
            which keeps resuming exact.
            Needs a per-parameter optimizer and automatic optimization; not with fp16 loss
            scaling (an overflow at step t+1 could not cancel update t, already applied).
        delayed_update_warmup: optimizer steps (counted by ``trainer.global_step``, so a
            resumed run does not repeat them) that update at once before the delay starts,
            as ZeRO-Offload does while the early, fast-changing gradients make staleness
            costly. Default 10; only meaningful with ``delayed_update=True``.
        offload_activations: keep the block-boundary activations that checkpointing saves
            for backward (each block's input) in host memory between the forward and the
            backward pass instead of on the device: device memory no longer grows with depth
            by one activation per block, at the cost of copying each one out and back once
            per step (counted in ``offload_stats.activation_*_bytes``). Needs
            ``checkpoint_blocks=True``. On a CPU device it only costs time.
        nvme_path: a directory on a fast local disk for the NVMe tier: the optimizer state and fp32 masters of the
            blocks that do not fit ``host_budget`` live in files there (a scratch directory of this run, removed at
            the end of fit), streamed through a few reusable host buffers for each block's host step. Without
            ``host_budget`` every block's state and masters go there. See docs/offload.md.
        host_budget: the host memory the offload may keep (bytes, or a string such as ``"32GB"``): masters,
            shadows, frozen weights, gradient buffers, optimizer state and the tier's buffers (on a CPU device the
            resident unit too). Without ``nvme_path`` a model that does not fit it is refused before any work, with
            the figures; a setting that keeps it from being met (``overlap_step=False``, clipping, accumulation) is
            refused naming it.
        nvme_chunk: the NVMe tier's step buffers (three) are each this size (bytes, or ``"64MiB"``; at least 1 MiB):
            each unit's host step streams through them in chunks of it. None (default): the plan's choice, 1/64 of
            ``host_budget`` between 1 and 256 MiB (64 MiB without a budget), capped at the largest unit.
        device: the device to compute on; default: the Trainer's accelerator (cuda:0 or cpu).
    """

    strategy_name = "l2l_offload"
    _materializes_meta = True

    def __init__(
        self,
        blocks: BlockPolicy = "auto",
        prefetch_blocks: int = 1,
        offload_resident: bool | None = None,
        checkpoint_blocks: bool = True,
        overlap_step: bool | None = None,
        delayed_update: bool = False,
        delayed_update_warmup: int | None = None,
        offload_activations: bool = False,
        nvme_path: str | None = None,
        host_budget: int | str | None = None,
        nvme_chunk: int | str | None = None,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        check_options(type(self).__name__, locals())  # each argument by kind, before any is used
        super().__init__(device=device if device is not None else "cpu", **kwargs)
        self._init_offload(blocks, prefetch_blocks, offload_resident, checkpoint_blocks, overlap_step, delayed_update,
                           delayed_update_warmup, offload_activations, nvme_path, host_budget, nvme_chunk)
        self._device_given = device is not None
        self._devices: list[torch.device] = []  # what Trainer(devices=...) asked for (see parallel_devices)
        self._num_nodes = 1

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # trainer.init_module(empty_init=True) builds on meta, as under FSDP: setup materializes it unit by unit
        # (lightning_accel.strategies.l2l_materialize), so a model bigger than host memory is never built whole
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @property
    @override
    def root_device(self) -> torch.device:
        if not self._device_given and self._devices:  # Trainer(devices=[1]): cuda:1, not the current device
            return torch.device(self._devices[0])
        if not self._device_given and isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", torch.cuda.current_device())
        return super().root_device

    # The Trainer hands a strategy with these attributes the devices and nodes it was asked for
    # (``Trainer(devices=..., num_nodes=...)``); a single-device strategy has none and would
    # silently train on one device. Taking them lets ``_configure_launcher`` refuse the rest.
    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[Any] | None) -> None:
        self._devices = [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d) for d in devices or []]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @override
    def _configure_launcher(self) -> None:
        # the Trainer is being built: refuse what one process on one device cannot honour, before anything starts
        asked = beyond_one_device(len(self._devices), self._num_nodes)
        if asked:
            raise ValueError(
                f"strategy='l2l_offload' trains on one device in one process, but {' and '.join(asked)} asks for more; "
                "use strategy='l2l_offload_ddp' (data parallel, the host optimizer partitioned across ranks), "
                "or devices=1"
            )
        check_device_accelerator(type(self).__name__, self._root_device if self._device_given else None, self.accelerator)
        super()._configure_launcher()
