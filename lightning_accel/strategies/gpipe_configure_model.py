"""A network built in ``configure_model`` under a pipeline that splits it: built on ``meta``, started from the user's own
build.

:class:`ConfigureModelReplay` is the part of :class:`~lightning_accel.strategies.gpipe_distributed.DistributedGPipeStrategy`
around Lightning's ``configure_model`` hook: the hook runs under ``torch.device("meta")`` (no rank ever builds tensors it
will not keep), and what its values must be is decided at setup: where every rank's copy of the whole network fits its
free memory, the hook runs once more on a copy of the module, from the random state it started from, under the device and
dtype Lightning builds it under (:mod:`lightning_accel.pipeline.build_replay`), so the starting weights equal plain
Lightning's and DDP's (the user's ``torch.manual_seed(0); Net()``); where not, each rank initializes its part from
per-module seeds (:func:`lightning_accel.pipeline.deferred_init.materialize`; one warning says so).
``deferred_init="parts"`` asks for the per-module scheme always, ``False`` for no meta at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_accel.host_memory import available_host_bytes
from lightning_accel.pipeline.build_replay import BuildReplay
from lightning_accel.pipeline.whole_module import fits_every_host, placeholder_bytes

__all__ = ["ConfigureModelReplay"]


class ConfigureModelReplay(DDPStrategy):
    """``configure_model`` on ``meta``, and the starting values of what it built (:meth:`_initial_values`, which the
    strategy hands the split)."""

    deferred_init: bool | str = True
    _replay: BuildReplay | None = None  # configure_model's start, to run it again whole

    @contextmanager
    @override
    def model_sharded_context(self) -> Iterator[None]:
        """Around ``configure_model`` only (not ``trainer.init_module``): build on the ``meta`` device; setup materializes
        this rank's part (with the values of the user's build run again, :meth:`_initial_values`, where it fits whole)."""
        module = self.lightning_module
        if self.deferred_init is True and module is not None:
            self._replay = BuildReplay(module, "configure_model")
        with torch.device("meta") if self.deferred_init else nullcontext():
            yield

    def _initial_values(self) -> dict[str, Tensor] | None:
        """The starting values of a network built on ``meta`` in ``configure_model``: the user's ``configure_model`` run
        again on a copy, whole, from the random state it started from, on the device and in the dtype Lightning builds it
        under (:mod:`~lightning_accel.pipeline.build_replay`), so they equal plain Lightning's and DDP's; None (each rank's
        part from per-module seeds, said once) where every rank's copy would not fit its free memory. Every rank calls it."""
        replay, module, self._replay = self._replay, self.lightning_module, None
        if replay is None or module is None or module._trainer is None:
            return None
        needed = placeholder_bytes([*module.parameters(), *module.buffers()])
        if self.root_device.type == "cpu":
            fits = fits_every_host(needed, available_host_bytes())
        else:  # each rank's own accelerator: every rank must agree
            free = torch.cuda.mem_get_info(self.root_device)[0] if self.root_device.type == "cuda" else 0
            flag = torch.tensor([int(needed < free)], device=self.root_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            fits = bool(flag.item())
        if not fits:
            rank_zero_warn(
                f"DistributedGPipeStrategy: the network built in configure_model ({needed / 2**30:.1f} GiB) does not fit "
                "whole beside the other ranks' copies, so each rank initializes its own part from per-module seeds, not "
                "from your seed's draws; build it in __init__ or load a checkpoint for exactly your starting values"
            )
            return None
        trainer = module.trainer

        @contextmanager
        def building() -> Iterator[None]:
            with self.tensor_init_context(), trainer.precision_plugin.module_init_context():
                yield

        return replay.values(building)
