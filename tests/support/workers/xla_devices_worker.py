"""Fits on several CPU PJRT devices, in a process of their own (started with CPU_NUM_DEVICES=2).

Run as ``python xla_devices_worker.py MODE STEPS OUT``. The device count is read once,
when the PJRT runtime starts, and SPMD cannot be switched off again, so each mode needs a
fresh process:

- ``spmd``: the regression on plain CPU, then with ``devices=2`` (SPMD data parallel) over
  the same global batches; then ``trainer.save_checkpoint`` of the SPMD fit.
- ``index``: the regression on plain CPU, then with ``devices=[1]`` (``xla:1`` alone); then
  a ``devices=2`` fit, which must be refused: this process has used an XLA device.

``OUT`` gets a ``torch.save`` of both runs' losses and final weights, the SPMD fit's
compile counts, and where its batches and parameters were.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime

from tests.support.xla_regression import fit, losses, register


class WhereBatchesAre(pl.Callback):
    """For the first train batches after Lightning moved them: device, sharding, per-device shards.

    At the end of training, each parameter's copy on each device (``replicas``): SPMD keeps
    the parameters replicated, and only all-reduced gradients keep the copies equal.
    """

    def __init__(self, first: int = 3) -> None:
        self.first = first
        self.seen: list[dict[str, Any]] = []
        self.replicas: dict[str, list[tuple[str, torch.Tensor]]] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not torch_xla.runtime.is_spmd():
            return
        # _get_local_shards reads the device buffers directly, without waiting for the step
        # still executing asynchronously (unlike .cpu()): wait for it first.
        xm.wait_device_ops()
        for name, p in pl_module.named_parameters():
            self.replicas[name] = [(d, t.cpu()) for t, d in torch_xla._XLAC._get_local_shards([p])[0]]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if len(self.seen) >= self.first:
            return
        x = batch[0]
        seen = {"device": str(x.device), "sharding": torch_xla._XLAC._get_xla_sharding_spec(x)}
        if seen["sharding"]:
            seen["shards"] = [(tuple(t.shape), d) for t, d in torch_xla._XLAC._get_local_shards([x])[0]]
        else:
            seen["runtime_device"] = xm.xla_real_devices([x.device])[0]  # e.g. CPU:1 for xla:1
        self.seen.append(seen)


def main(mode: str, steps: int, out: str) -> None:
    # Start the runtime before the first (CPU) backward (see the xla fixture in tests/accelerators/conftest.py), without
    # torch_xla.device(): once a device is used, torch_xla 2.9 cannot switch to SPMD.
    torch_xla.runtime.addressable_runtime_device_count()
    register()
    cpu, _ = fit("cpu", steps)
    where = WhereBatchesAre()
    devices: Any = 2 if mode == "spmd" else [1]
    dev, trainer = fit("xla_pjrt", steps, devices=devices, callbacks=[where])
    result: dict[str, Any] = {
        "cpu_losses": losses(cpu),
        "xla_losses": losses(dev),
        "cpu_weights": {k: v.detach().cpu() for k, v in cpu.state_dict().items()},
        "xla_weights": {k: v.detach().cpu() for k, v in dev.state_dict().items()},
        "root_device": str(trainer.strategy.root_device),
        "batches": where.seen,
        "replicas": where.replicas,
        "compilations": list(trainer.strategy.compilations.counts),
        "summary": trainer.strategy.compilations.summary(),
        "world_size": trainer.world_size,
        "global_zero": trainer.is_global_zero,
    }
    if mode == "spmd":
        result["spmd_count"] = trainer.strategy.placement.count
        path = os.path.join(os.path.dirname(out), "spmd.ckpt")
        trainer.save_checkpoint(path)
        result["checkpoint"] = torch.load(path, weights_only=False)["state_dict"]
    else:
        try:
            fit("xla_pjrt", 2, devices=2)
        except ValueError as err:
            result["refusal"] = str(err)
    torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
