"""What a module split across a pipeline's ranks shows outside the pipeline: checkpoints of the whole model, and the
whole module on every rank after a run.

:class:`SplitModuleState` is the part of :class:`~lightning_accel.strategies.gpipe_distributed.DistributedGPipeStrategy`
that Lightning asks for state (the rest trains): a checkpoint holds every stage's tensors under the user's names and
the optimizer state under plain training's indices, gathered from the pipeline's ranks
(:mod:`lightning_accel.pipeline.state_gather`), and each rank loads its own part of one. After ``fit`` every rank's
module is whole again, as after DDP: the stages' tensors sent by the ranks that hold them, on the CPU
(:mod:`lightning_accel.pipeline.whole_module`), where the hosts' free memory holds them; where it does not, each rank
says so once and :meth:`SplitModuleState.gather_module` does it on request. An evaluation (``validate``, ``test``,
``predict``) that split a whole module leaves it whole again.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.host_memory import available_host_bytes
from lightning_accel.models.finetune_checkpoint import left_out_of_checkpoint
from lightning_accel.pipeline.placement import RankLayout
from lightning_accel.pipeline.rank_split import RankSplit
from lightning_accel.pipeline.state_gather import gather_model_state, load_own_state
from lightning_accel.strategies.gpipe_callbacks import averaged_copies

__all__ = ["SplitModuleState"]

_STAGES = {TrainerFn.FITTING: "fit", TrainerFn.VALIDATING: "validate", TrainerFn.TESTING: "test", TrainerFn.PREDICTING: "predict"}


class SplitModuleState(DDPStrategy):
    """Checkpoints and the module after a run, for a strategy whose module is split (``_split_state``) over the ranks of
    a pipeline (``_layout``); the strategy gives ``sync_weights`` (what is outside the blocks, current on every rank)."""

    _split_state: RankSplit | None = None
    _whole_at_setup = False  # the module was whole when this run's setup split it
    _failed_together = False  # the run ended by a step's exception that every rank of the pipeline raised

    @property
    def _layout(self) -> RankLayout:
        raise NotImplementedError

    @property
    def _process_rank(self) -> int:
        """This process's rank among every process of the run (the strategy's ``global_rank`` may count replicas)."""
        return self.cluster_environment.global_rank() if self.cluster_environment is not None else 0

    def sync_weights(self) -> None:
        raise NotImplementedError

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Every stage's tensors under the user's names, gathered on rank 0 from its pipeline (other ranks get their own part)
        while the module is split;
        a fine-tune's frozen base is left out (:func:`~lightning_accel.models.finetune_checkpoint.left_out_of_checkpoint`):
        its checkpoint does not hold it, so it is not gathered."""
        assert self.lightning_module is not None
        self.sync_weights()
        state = self.lightning_module.state_dict()
        if self._split_state is None or not dist.is_initialized():
            return state
        left_out = left_out_of_checkpoint(self.lightning_module)
        state = {n: t for n, t in state.items() if n not in left_out}
        if not any(t.is_meta for t in state.values()):
            return state  # whole on every rank (after fit, as every rank's module is then): nothing to gather
        return gather_model_state(state, self._layout, self._process_rank)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        if not load_own_state(self.lightning_module, checkpoint["state_dict"], strict):
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole model's optimizer state: each rank's part under the indices plain training would give it."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self._split_state is not None:
            self._split_state.follow_param_groups(self.optimizers, self._layout)
        state = optimizer.state_dict()
        index = next((i for i, o in enumerate(self.optimizers) if o is optimizer), None)
        if index is None or self._split_state is None or not dist.is_initialized():
            return state
        return self._split_state.optimizer_state(index, state, self._layout)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each rank takes its own parameters' state from the whole model's optimizer state."""
        if self._split_state is not None:  # BaseFinetuning put back the groups it had added, whole
            self._split_state.follow_param_groups(self.optimizers, self._layout)
        for index, (optimizer, whole) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"])):
            if self._split_state is None:
                optimizer.load_state_dict(whole)
                continue
            optimizer.load_state_dict(self._split_state.local_optimizer_state(index, whole))
            _optimizers_to_device([optimizer], self.root_device)

    def _whole_after_run(self) -> None:
        """At teardown after a run that ended normally, or by an exception that a pipelined step raised on every rank of
        the pipeline alike (``_failed_together``; after another exception the ranks may not all be here): every rank's
        module whole again, as after DDP. After ``fit``, also one that stopped before training began
        (``Timer(duration=0)``, ``should_stop`` at fit start: no ``on_train_end``), when it fits the hosts' free memory
        (one warning on each rank otherwise); after an evaluation, where it split a module that was whole."""
        module = self.lightning_module
        if module is None or module._trainer is None:
            return
        if module.trainer.state.status != TrainerStatus.RUNNING and not self._failed_together:
            return
        stage = _STAGES.get(module.trainer.state.fn)
        if stage is not None:
            self._whole_after(stage)

    def _whole_after(self, stage: str) -> None:
        """Every rank's module whole again, as after DDP: after ``fit`` (when it fits the hosts' free memory; one warning on
        each rank otherwise), and after an evaluation that split a module that was whole."""
        module = self.lightning_module
        if self._split_state is None or module is None or not dist.is_initialized():
            return
        if stage != "fit" and not self._whole_at_setup:
            return
        if stage == "fit":
            self.sync_weights()  # what is outside the blocks: each rank's copy from a rank that steps it
        needed = self._split_state.gather_whole(module, self._layout, available_host_bytes(), copies=self._copies())
        if needed is not None:
            warnings.warn(
                f"{type(self).__name__}: after {stage} rank {self._process_rank}'s module holds only its own stages: the "
                f"others ({needed / 2**30:.1f} GiB) do not fit the free host memory beside the other ranks'; "
                "trainer.strategy.gather_module() on every rank gathers them, trainer.save_checkpoint(path) saves the "
                "whole model", UserWarning, stacklevel=2,
            )

    def gather_module(self) -> None:
        """Give this rank's module every stage's parameters and buffers, on the CPU, from the ranks that hold them,
        whether or not they fit the free host memory (after ``fit`` this happens by itself where they do). A collective:
        call it on every rank, after ``fit``, ``validate``, ``test`` or ``predict``."""
        module = self.lightning_module
        if self._split_state is None or module is None:
            raise RuntimeError(f"{type(self).__name__}.gather_module(): this strategy has not split a module; call it after trainer.fit(...)")
        self._split_state.gather_whole(module, self._layout, None, check=False, copies=self._copies())

    def _copies(self) -> list[nn.Module]:
        module = self.lightning_module
        return averaged_copies(module.trainer, module) if module is not None and module._trainer is not None else []

