"""Where L2L offload's host state lives and when its blocks step: the host budget and the NVMe tier, set up for a fit.

With ``host_budget`` or ``nvme_path`` the tier's plan (:mod:`lightning_accel.offload.tier_setup`) chooses, where the
user left it open, whether the blocks step during the backward and whether the resident unit streams, refuses a budget
that cannot be met (with the figures), and moves what does not fit to files; it is planned again when the trained
parameters change during fit. :class:`L2LTierSetup` is a part of
:class:`~lightning_accel.strategies.l2l_offload_hooks.L2LOffloadHooks`; the data-parallel strategy fills in whose plan it
is (:meth:`L2LTierSetup._tier_label`, :meth:`L2LTierSetup._tier_stepped`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.optim import Optimizer

from lightning_accel.offload.tier_plan import TierPlan
from lightning_accel.offload.tier_setup import (BLOCKS_IN_FLIGHT, TierChoice, check_tier_optimizers, compute_reads, make_tier,
                                                overlap_blocker, plan_tier_for, tier_options)

if TYPE_CHECKING:
    from lightning_accel.offload import L2LExecutor


class L2LTierSetup(Strategy):
    """The host budget's and the NVMe tier's set-up (see the module doc)."""

    _executor: L2LExecutor | None
    nvme_path: str | None
    host_budget: int | None

    def _setup_tier(self, rebuild: bool = True) -> list[str]:
        """With ``host_budget`` or ``nvme_path``: plan what stays in host memory (choosing when the blocks step and where
        the resident unit lives where the user left it open, refusing a budget that cannot be met, with the figures)
        and move what does not fit to disk. ``rebuild``: the executor may be made again to stream the resident unit
        (at set-up; not while a fit runs). Returns the plan line's part."""
        executor = self._executor
        if executor is None or (self.nvme_path is None and self.host_budget is None) or not self.optimizers:
            return []  # (validate/test/predict alone: nothing steps, nothing to stream)
        label = self._tier_label()
        if executor.tier is not None:  # fit, then validate: set up once per placement
            return [f"{label}: {executor.tier.plan.describe()}"]
        if self.nvme_path is not None:
            check_tier_optimizers(self.optimizers, type(self).__name__)
        optimizer = self.optimizers[0]
        try:
            tier_plan, choice = self._plan_tier(executor, optimizer, rebuild)
            if choice.stream_resident and not executor.plan.offload_resident:
                self._stream_resident = True  # the plan's choice: the executor is made again, the resident unit streamed
                self.model_to_device()
                executor = self._executor
                assert executor is not None
                tier_plan, choice = self._plan_tier(executor, optimizer, rebuild)
            tier_plan, tier = make_tier(executor.tier_units(), executor.store, optimizer, self.host_budget, self.nvme_path,
                                        pin=executor.streamer.memory, reads=executor.compute_reads(),
                                        prefetch_blocks=executor.plan.prefetch_blocks, stepped=self._tier_stepped(),
                                        tier_plan=tier_plan)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: {err}") from None
        self._tier_plan = tier_plan
        if executor.streamer.staged:  # the pinned rings' slots, as the plan counts them
            executor.streamer.size_staging(tier_plan.staging_slot)
        self._tier_overlap = choice.in_backward
        # the backward holds back so that no more gradients wait than the plan counted (a block arriving, the rest landed)
        executor.max_unstepped = BLOCKS_IN_FLIGHT - 2 if choice.in_backward else None
        executor.retier = self._retier
        if tier is not None:
            executor.attach_tier(tier)
            return [f"{label}: {tier_plan.describe()} under {tier.directory}"]
        return [f"{label}: {tier_plan.describe()}"]

    def _plan_tier(self, executor: L2LExecutor, optimizer: Optimizer, rebuild: bool) -> tuple[TierPlan, TierChoice]:
        """The tier's plan for ``executor`` and what it chose (:mod:`lightning_accel.offload.tier_choice`)."""
        options = tier_options(overlap_step=self.overlap_step, offload_resident=self.offload_resident,
                               may_stream_resident=rebuild and self._may_stream_resident(), cpu=self.root_device.type == "cpu",
                               compute_dtype=executor.store.compute_dtype, nvme_path=self.nvme_path, nvme_chunk=self.nvme_chunk,
                               offload_activations=self.offload_activations, cannot_overlap=self._overlap_blocker(optimizer),
                               device_memory=self._device_memory())
        blocks = len(executor.plan.blocks)

        def reads_of(streamed: bool) -> list[int]:
            return compute_reads(blocks, streamed, self.checkpoint_blocks, self.offload_activations)

        tier_plan, choice, _ = plan_tier_for(executor.plan, executor.store, optimizer, self.host_budget, options, reads_of,
                                             pin=executor.streamer.staged, prefetch_blocks=executor.plan.prefetch_blocks,
                                             stepped=self._tier_stepped())
        return tier_plan, choice

    def _device_memory(self) -> int | None:
        """The device's memory, where the plan can know it (a CUDA device's total; None on the CPU device, whose memory the
        host budget bounds): the plan streams the resident unit where it would not fit (``offload_resident`` unset)."""
        if self.root_device.type != "cuda":
            return None
        return torch.cuda.get_device_properties(self.root_device).total_memory

    def _may_stream_resident(self) -> bool:
        """Whether the tier's plan may stream the resident unit where ``offload_resident`` is unset."""
        return True

    def _overlap_blocker(self, optimizer: Optimizer) -> tuple[str, str | None] | None:
        """Why the blocks cannot step during the backward in this fit, and the fix (None: nothing stops it)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return overlap_blocker(optimizer, accumulate=trainer.accumulate_grad_batches if trainer is not None else 1,
                               clip=trainer.gradient_clip_val if trainer is not None else None,
                               fp16_scaling=getattr(self.precision_plugin, "scaler", None) is not None,
                               reads_gradients=self._reads_gradients("on_after_backward", "on_before_optimizer_step"))

    def _overlap_wanted(self) -> bool:
        """Whether the blocks should step during the backward: ``overlap_step`` as given; unset, the tier plan's choice,
        else on an accelerator only (on the CPU the host step would compete with the compute for the same cores)."""
        if self.overlap_step is not None:
            return self.overlap_step
        if self._tier_overlap is not None:
            return self._tier_overlap
        return self.root_device.type != "cpu"

    def _tier_label(self) -> str:
        """What the plan line calls the tier's part (data parallel: whose plan it is)."""
        return "NVMe tier"

    def _tier_stepped(self) -> set[nn.Parameter] | None:
        """The host parameters this process steps, the only ones whose optimizer state the tier lays out; None: all."""
        return None

    def _retier(self) -> None:
        """The parameters changed during fit (unfrozen, frozen again, replaced): the tier is planned and laid out again from
        them and their state as they are now (read from the old files' views, written to new ones), and says so."""
        said = self._setup_tier(rebuild=False)
        rank_zero_info(f"{type(self).__name__}: the trained parameters changed; " + "; ".join(said))
