"""GPipe micro-batching for a loop the user writes: ``Fabric(strategy="gpipe")``.

The Trainer's :class:`~lightning_accel.strategies.GPipeStrategy` is this strategy's engine, built from the same
arguments (the same options, checks and errors): it splits the model's blocks into stages over ``devices``
(:class:`~lightning_accel.pipeline.LocalPipeline`, no module wrapped, so checkpoints keep the user's names) and
makes the module's forward, called with grad, run as ``chunks`` micro-batches through the stages, re-materialized
in backward, its outputs joined. The loop's loss and ``fabric.backward(loss)`` therefore see one whole batch, as
under Fabric's own strategies; the optimizer steps once per batch, and clipping, accumulation and precision stay
Fabric's. A forward without grad (evaluation, inference after the loop) runs whole. Where the Trainer strategy
finds the network in the LightningModule (its ``net``), here it is the module given to ``fabric.setup``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.fabric.strategies import SingleDeviceStrategy
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.models.block_policy import BlockPolicy
from lightning_accel.strategies.gpipe import DeviceSpec
from lightning_accel.strategies.gpipe import GPipeStrategy as TrainerGPipeStrategy

__all__ = ["GPipeStrategy"]


class _Engine(TrainerGPipeStrategy):
    """The Trainer strategy driven by the Fabric one: the network is the module Fabric set up, and every forward
    with grad is a training step's (a Fabric loop has no ``training_step`` to bracket it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._training = True

    @override
    def _net(self) -> nn.Module:
        assert self.model is not None
        return self.model

    @override
    def _microbatched(self, forward: Any) -> Any:
        run = super()._microbatched(forward)

        def run_then_finish(*args: Any, **kwargs: Any) -> Any:
            self._called = False
            output = run(*args, **kwargs)
            if self._called and self.pipeline is not None:  # a whole batch went through: deferred BatchNorm statistics
                self.pipeline.finish_batch()
            return output

        return run_then_finish


# The engine's errors and plan lines name the strategy as the user wrote it, at either front door.
_Engine.__name__ = _Engine.__qualname__ = "GPipeStrategy"


class GPipeStrategy(SingleDeviceStrategy):
    """``Fabric(strategy="gpipe")``: the model's blocks in stages over ``devices``, each batch in ``chunks``
    micro-batches. The arguments are the Trainer strategy's (:class:`lightning_accel.strategies.GPipeStrategy`)."""

    strategy_name = "gpipe"

    def __init__(
        self,
        chunks: int = 1,
        balance: Sequence[int] | str = "by_size",
        devices: DeviceSpec = None,
        checkpoint: str = "except_last",
        blocks: BlockPolicy = "auto",
        deferred_batch_norm: bool | None = None,
        **kwargs: Any,
    ) -> None:
        self.engine = _Engine(chunks, balance, devices, checkpoint, blocks, deferred_batch_norm)
        super().__init__(device=self.engine.devices[0], **kwargs)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        self.engine.model = module
        self.engine.check_fit(module)  # what micro-batching would train otherwise, refused before any work
        self.engine.model_to_device()

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if self.engine.model is not module:  # fabric.setup(..., move_to_device=False)
            self.module_to_device(module)
        return module

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None) -> Any:
        module = self.setup_module(module)
        self.engine.optimizers = list(optimizers)  # (balance="by_time" moves their restored state with the parameters)
        return module, optimizers, scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self.engine.optimizers = [*self.engine.optimizers, optimizer]
        return optimizer

    @override
    def teardown(self) -> None:
        self.engine.accelerator = self.accelerator
        self.engine.teardown()  # the module's own forward back, the blocks where they were placed
        super().teardown()

    @property
    def pipeline(self) -> Any:
        """The engine's :class:`~lightning_accel.pipeline.LocalPipeline` (None before set-up)."""
        return self.engine.pipeline
