"""L2L CPU offload for a loop the user writes: ``Fabric(strategy="l2l_offload")``.

The Trainer's :class:`~lightning_accel.strategies.L2LOffloadStrategy` is this strategy's engine: built from the
same arguments (so the same options, checks and errors), it places the model (``model_to_device``: the units
planned, a model built on meta materialized unit by unit, the blocks' parameters to the host store), chooses each
optimizer's host kernel and the NVMe tier, says the plan in one line, and runs the host update
(``_host_step``). What a Trainer learns from its hooks, a Fabric loop tells through Fabric's strategy methods, and
:class:`~lightning_accel.fabric.offload_adapter.FabricOffload` (shared with ``Fabric(strategy="l2l_offload_ddp")``)
maps one onto the other; ``fabric.no_backward_sync`` is a no-op on one device, as under Fabric's own.

Refused in one line, when the ``Fabric`` is built: ``delayed_update`` (its landing points are the Trainer's hooks:
validation, checkpoints, the end of fit); more than one device, node or process (``l2l_offload_ddp``); a precision
that would change the host masters' dtype. ``overlap_step`` is off unless set: a Fabric loop may clip or
accumulate after ``fabric.backward``, which need every gradient before any block steps; with ``overlap_step=True``
a ``fabric.clip_gradients`` or a second ``fabric.backward`` before ``optimizer.step()`` is refused at its call.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.strategies import SingleDeviceStrategy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.fabric.offload_adapter import FabricOffload, refuse_delayed_update
from lightning_accel.models.block_policy import BlockPolicy
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy as TrainerL2LOffloadStrategy, beyond_one_device

__all__ = ["L2LOffloadStrategy"]

# Why the blocks do not step during ``fabric.backward`` unless ``overlap_step=True`` says they may, and the fix.
OVERLAP_UNKNOWN = ("a Fabric loop may clip (fabric.clip_gradients) or accumulate (a second fabric.backward) after "
                   "fabric.backward, which need every gradient before any block steps",
                   "pass overlap_step=True if the loop does neither")


class _Engine(TrainerL2LOffloadStrategy):
    """The Trainer strategy driven by the Fabric one: what only a Trainer knows (its clipping and accumulation
    settings, the LightningModule's gradient hooks) answered for a Fabric loop."""

    @override
    def _overlap_blocker(self, optimizer: Optimizer) -> tuple[str, str | None] | None:
        blocker = super()._overlap_blocker(optimizer)  # (no Trainer: fp16 loss scaling, the optimizer's kind)
        return blocker if blocker is not None or self.overlap_step else OVERLAP_UNKNOWN

    @override
    def _overlap_wanted(self) -> bool:
        return bool(self.overlap_step)

    @override
    def _reads_gradients(self, *hooks: str) -> bool:
        return False


# The engine's errors and plan lines name the strategy as the user wrote it, at either front door.
_Engine.__name__ = _Engine.__qualname__ = "L2LOffloadStrategy"


class L2LOffloadStrategy(FabricOffload, SingleDeviceStrategy):
    """``Fabric(strategy="l2l_offload")``: train on one device with the model's blocks offloaded to host memory.

    The arguments are the Trainer strategy's (:class:`lightning_accel.strategies.L2LOffloadStrategy`), with the
    same meaning and checks; ``delayed_update`` is refused (see the module docstring) and ``overlap_step`` is off
    unless set.
    """

    strategy_name = "l2l_offload"

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
        self.offload = _Engine(blocks, prefetch_blocks, offload_resident, checkpoint_blocks, overlap_step, delayed_update,
                               delayed_update_warmup, offload_activations, nvme_path, host_budget, nvme_chunk, device)
        if delayed_update:
            raise refuse_delayed_update("l2l_offload", "L2LOffloadStrategy")
        super().__init__(device=device if device is not None else "cpu", **kwargs)
        self._device_given = device is not None
        self._devices: list[torch.device] = []  # what Fabric(devices=...) asked for (see parallel_devices)
        self._num_nodes = 1

    @property
    @override
    def root_device(self) -> torch.device:
        if not self._device_given and self._devices:  # Fabric(accelerator="cuda"): the device it chose
            return self._devices[0]
        return self._root_device

    # Fabric's connector hands a strategy with these attributes the devices and nodes it was asked for; taking them
    # lets _configure_launcher refuse more than one, which a single-device strategy would silently drop.
    @property
    def parallel_devices(self) -> list[torch.device]:
        return self._devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[Any] | None) -> None:
        self._devices = [torch.device(d) for d in devices or []]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @override
    def _configure_launcher(self) -> None:
        asked = beyond_one_device(len(self._devices), self._num_nodes)
        if asked:
            raise ValueError(
                f"Fabric(strategy='l2l_offload') trains on one device in one process, but {' and '.join(asked)} asks for "
                "more; use devices=1, or Fabric(strategy='l2l_offload_ddp') for data parallel offload"
            )
        # the engine computes where Fabric does
        self.offload._root_device, self.offload._device_given = self.root_device, True
