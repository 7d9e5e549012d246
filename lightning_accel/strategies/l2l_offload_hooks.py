"""What L2L (layer-to-layer) CPU offload adds to a Lightning strategy's hooks.

:class:`L2LOffloadHooks` is combined with ``SingleDeviceStrategy`` in
:class:`~lightning_accel.strategies.L2LOffloadStrategy` (``"l2l_offload"``) and with
``DDPStrategy`` in :class:`~lightning_accel.strategies.L2LOffloadDDPStrategy`
(``"l2l_offload_ddp"``). A thin Lightning adapter over :mod:`lightning_accel.offload`: parameters, gradients and
optimizer state of the model's blocks live in host memory; only the block being computed
(plus ``prefetch_blocks`` blocks on their way) lives on the device. The user's
``configure_optimizers`` is honoured unchanged: the optimizer simply finds the block
parameters on the host, with their fp32 gradients, when it steps.

Two concepts live beside this module: the gradients shown to the user's code as ``param.grad``
(:class:`~lightning_accel.strategies.l2l_offload_grads.L2LGradients`: ``pre_backward``, ``post_backward``,
``on_after_backward``), and the host budget's and NVMe tier's set-up
(:class:`~lightning_accel.strategies.l2l_offload_tier.L2LTierSetup`).

What each hook adds to :class:`SingleDeviceStrategy`:

- ``model_to_device``: plan the units, move block parameters to the host store, keep the
  rest (embeddings, head, norms) on the device, wrap the blocks' forwards;
- ``training_step`` / ``pre_backward`` / ``post_backward``: bracket the passes so the
  executor prefetches in the right direction and lands the gradients on the host; before
  each step (and evaluation step) the executor follows what the user's code changed in the
  parameters since the last one (gradual unfreezing, pruning: :mod:`lightning_accel.offload.replan`),
  said in one line; a quantized weight set to train is refused there, or at setup when
  ``BackboneFinetuning`` declares it;
- ``optimizer_step``: on a step's backward pass, step each block's parameters on the host
  (in a worker thread) as soon as that block's gradients have arrived, overlapping the
  backward of the blocks still running (blocks whose gradients landed together share one
  optimizer call); then expose the remaining host gradients as ``param.grad`` for
  clipping and the final step (resident parameters, and every block when the overlap is
  off), which writes the low-precision shadows in the same pass as the update
  (:mod:`lightning_accel.offload.shadow_fold`). Host parameters step on torch's fused CPU kernel when the user's optimizer has
  one (SGD, Adam, AdamW, Adagrad) and left ``foreach``/``fused`` unset
  (:mod:`lightning_accel.offload.host_step`: 5x torch's default loop for AdamW here);
- ``load_optimizer_state_dict``: keep each state tensor on its parameter's device (host
  for blocks) instead of moving everything to the root device.

Gradient clipping by global norm works (it sees every gradient, host and device), but it
needs all gradients before any parameter may step, so with ``gradient_clip_val`` set (and
likewise under fp16 loss scaling, whose overflow check spans all gradients) the whole
host step runs after the backward pass: the overlap is lost and the step time is added
to the critical path. The overlap also needs a per-parameter optimizer (SGD, Adam(W),
RMSprop, Adagrad, ...), for which stepping blocks one at a time equals one full step.

With ``delayed_update=True`` (ZeRO-Offload's one-step delayed parameter update) the host
step overlaps a whole step instead of part of a backward, clipping or not: step t's host
update runs in a worker thread during step t+1's forward and backward (which waits for it
only if it takes longer), so step t+1 computes on weights without update t.
``optimizer_step`` then lets ``optimizer.step()`` update only the parameters kept on the
device, and hands the host gradients (after Lightning's clipping) to
:class:`~lightning_accel.offload.delayed.DelayedUpdate`; ``on_validation_start``,
``lightning_module_state_dict`` (every checkpoint) and ``on_train_end`` land a pending
update first, so what is validated, saved and left at the end includes every update.
``offload_activations=True`` parks the checkpointed blocks' saved inputs in host memory
between forward and backward.

The host step and the host-side copies run within the rank's CPU budget
(:func:`lightning_accel.cpu_budget.cpu_budget`: affinity, cgroup quota,
``SLURM_CPUS_PER_TASK``, local ranks; not ``os.cpu_count()``): torch's intra-op threads,
in the main thread and in the host-step threads, are lowered to it for the fit and put
back at teardown (:mod:`lightning_accel.offload.host_threads`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Callable

import torch
from lightning.fabric.plugins.io import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import BackboneFinetuning
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.cpu_budget import CpuBudget
from lightning_accel.models.block_policy import BlockPolicy
from lightning_accel.models.side_effects import KVCacheSwitch
from lightning_accel.offload import L2LExecutor, OffloadStats, make_plan
from lightning_accel.offload.host_optimizer import PER_PARAMETER, check_delayed_optimizer, check_delayed_update, check_host_optimizer
from lightning_accel.offload.host_step import HostKernel, choose_host_kernel, host_update, step_params
from lightning_accel.offload.host_store import KEEP_IT_FROZEN, cannot_train
from lightning_accel.offload.host_threads import HostThreads
from lightning_accel.offload.materialize import Materialized
from lightning_accel.offload.optimizer_state import state_bytes
from lightning_accel.offload.tier_plan import TierPlan, parse_bytes, parse_chunk
from lightning_accel.patching import swapped
from lightning_accel.plugins.io.atomic import AtomicCheckpointIO
from lightning_accel.plugins.precision.offload import OffloadPrecision, for_offload
from lightning_accel.strategies.l2l_materialize import kept_on_meta, materialize_meta, settle_in_memory
from lightning_accel.strategies.l2l_offload_grads import L2LGradients
from lightning_accel.strategies.l2l_offload_tier import L2LTierSetup


class L2LOffloadHooks(L2LGradients, L2LTierSetup, Strategy):
    """What L2L offload adds to a Lightning strategy's hooks, for one device
    (:class:`L2LOffloadStrategy`) and data parallel
    (:class:`~lightning_accel.strategies.l2l_offload_ddp.L2LOffloadDDPStrategy`): combined with
    ``SingleDeviceStrategy`` or ``DDPStrategy``, never used alone. The data-parallel strategy
    fills in :meth:`_base_setup`, :meth:`_gradients_ready` and :meth:`_after_update`."""

    _materializes_meta = False  # a model built on meta is materialized unit by unit (:mod:`.l2l_materialize`)

    def _init_offload(
        self,
        blocks: BlockPolicy,
        prefetch_blocks: int,
        offload_resident: bool | None,
        checkpoint_blocks: bool,
        overlap_step: bool | None,
        delayed_update: bool,
        delayed_update_warmup: int | None,
        offload_activations: bool,
        nvme_path: str | None = None,
        host_budget: int | str | None = None,
        nvme_chunk: int | str | None = None,
    ) -> None:
        """Check and keep the offload options (see :class:`L2LOffloadStrategy`'s arguments)."""
        if prefetch_blocks < 0:
            raise ValueError(f"prefetch_blocks must be >= 0, got {prefetch_blocks}; use 1 to overlap copies with compute")
        if delayed_update_warmup is not None and not delayed_update:
            raise ValueError(
                f"delayed_update_warmup={delayed_update_warmup} has no effect with delayed_update=False; "
                "set delayed_update=True, or drop delayed_update_warmup"
            )
        if delayed_update_warmup is not None and delayed_update_warmup < 0:
            raise ValueError(
                f"delayed_update_warmup must be >= 0, got {delayed_update_warmup}; use 0 to delay from the first step"
            )
        if offload_activations and not checkpoint_blocks:
            raise ValueError(
                "offload_activations=True needs checkpoint_blocks=True (without checkpointing every activation inside "
                "every block is saved and would cross the bus); set checkpoint_blocks=True or offload_activations=False"
            )
        if nvme_path is not None and not isinstance(nvme_path, (str, os.PathLike)):
            raise TypeError(f"strategy.nvme_path={nvme_path!r} is not a path; give a directory on a fast local disk")
        if nvme_path is not None and delayed_update:
            raise ValueError("strategy.nvme_path with delayed_update=True is not supported: the delayed update keeps a second "
                             "copy of every host parameter in memory; set delayed_update=False or drop nvme_path")
        self.nvme_path = os.fspath(nvme_path) if nvme_path is not None else None
        self.host_budget = parse_bytes(host_budget) if host_budget is not None else None
        if nvme_chunk is not None and nvme_path is None:
            raise ValueError(f"strategy.nvme_chunk={nvme_chunk!r} sizes the NVMe tier's step buffers, but nvme_path is not set; "
                             "set strategy.nvme_path=DIR, or drop nvme_chunk")
        self.nvme_chunk = parse_chunk(nvme_chunk)
        self._tier_plan: TierPlan | None = None
        self._tier_overlap: bool | None = None  # whether the tier's plan has the blocks step during the backward
        self._stream_resident = False  # the tier's plan streams the resident unit (offload_resident left unset)
        self.blocks = blocks
        self.prefetch_blocks = prefetch_blocks
        self.offload_resident = offload_resident
        self.checkpoint_blocks = checkpoint_blocks
        self.overlap_step = overlap_step
        self.delayed_update = delayed_update
        self.delayed_update_warmup = 10 if delayed_update_warmup is None else delayed_update_warmup
        self.offload_activations = offload_activations
        self._executor: L2LExecutor | None = None
        self._last_stats = OffloadStats()
        self._host_kernels: dict[int, HostKernel] = {}  # id(optimizer) -> how its host parameters step
        self._threads: HostThreads | None = None
        self._kv_cache = KVCacheSwitch("L2LOffloadStrategy", "recomputing")  # use_cache off for fit, restored at teardown
        self._materialized: Materialized | None = None  # a model built on meta, given its tensors unit by unit

    @property
    def offload_stats(self) -> OffloadStats:
        """Bytes moved, copy time, overlap, peak device bytes and resident blocks."""
        if self._executor is None:
            return self._last_stats
        return self._executor.stats

    # Lightning hands the strategy its precision plugin through this setter when the Trainer is
    # built (the accelerator connector's _lazy_init_strategy): Trainer(precision="bf16-mixed")
    # arrives as MixedPrecision and runs as OffloadPrecision("bf16-mixed"); what offload cannot
    # honour is refused here, before anything starts.
    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> Precision:
        plugin = getattr(self, "_precision_plugin", None)
        return plugin if plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        paired = for_offload(plugin, self.strategy_name)
        said = getattr(self, "_precision_said", None)
        if isinstance(paired, OffloadPrecision) and paired is not plugin and said != paired.precision:
            self._precision_said = paired.precision  # say the pairing once
            dtype = str(paired.compute_dtype).removeprefix("torch.")
            rank_zero_info(
                f"strategy={self.strategy_name!r}: precision={paired.precision!r} runs as OffloadPrecision({paired.precision!r}) "
                f"(fp32 masters on the host, device copies in {dtype})"
            )
        self._precision_plugin = paired

    def _compute_dtype(self) -> torch.dtype:
        plugin = self.precision_plugin  # the setter let only these two through
        if isinstance(plugin, OffloadPrecision):
            plugin.set_device(self.root_device.type)
            return plugin.compute_dtype
        return torch.float32

    @override
    def setup_environment(self) -> None:
        # before the accelerator sets up the device: refuse XLA with the reason, not a device error
        from lightning.pytorch.accelerators import XLAAccelerator

        from lightning_accel.accelerators import XLAPJRTAccelerator

        if isinstance(self.accelerator, (XLAAccelerator, XLAPJRTAccelerator)) or self.root_device.type == "xla":
            raise ValueError(
                "L2LOffloadStrategy does not run on XLA devices: it streams one block at a time between host and device "
                "inside the step, and on XLA each such copy ends the traced graph (a recompile or host round trip per block); "
                "on a TPU use strategy='xla_pjrt' with precision='bf16-true', or run L2L on CUDA or the CPU"
            )
        super().setup_environment()

    @override
    def setup(self, trainer: Trainer) -> None:
        self._compute_dtype()  # refuse an unsupported precision before anything moves
        self._base_setup(trainer)
        self._setup_offload()
        if self.delayed_update:
            self._check_delayed_update(trainer)
        self._refuse_declared_unfreezing(trainer)
        self._land_before_on_after_backward()

    def _setup_offload(self) -> None:
        """After the model is placed and the optimizers are known (either front door: the Trainer's ``setup``, Fabric's
        ``setup_module`` / ``setup_optimizers``): each optimizer's host kernel, the tier, the plan said once."""
        kernels = []
        for optimizer in self.optimizers:
            check_host_optimizer(optimizer)
            kernel = self._host_kernels[id(optimizer)] = choose_host_kernel(optimizer)
            kernels.append(kernel.why)
        tier = self._setup_tier()
        settle_in_memory(self._materialized, self._executor, fitting=bool(self.optimizers))
        said = "; ".join([self._plan_text, *kernels, *tier])
        if said != getattr(self, "_plan_said", None):  # fit, then validate, set up again: say the plan once
            self._plan_said = said
            rank_zero_info(said)

    def _refuse_declared_unfreezing(self, trainer: Trainer) -> None:
        """Before the first step: a callback that declares what it will unfreeze (``BackboneFinetuning``: the
        LightningModule's ``backbone``, at its epoch) must not find a quantized weight there, which cannot train; a
        weight unfrozen by other code is refused at the step it was unfrozen (:mod:`lightning_accel.offload.replan`)."""
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = trainer.lightning_module
        backbone = getattr(module, "backbone", None)
        for callback in trainer.callbacks:
            if not isinstance(callback, BackboneFinetuning) or not isinstance(backbone, nn.Module):
                continue  # (without a backbone BackboneFinetuning refuses the fit itself)
            epoch = callback.unfreeze_backbone_at_epoch
            if trainer.max_epochs is not None and 0 <= trainer.max_epochs <= epoch:
                continue  # the fit ends before that epoch
            names = {p: n for n, p in module.named_parameters()}
            for param in backbone.parameters():
                refusal = cannot_train(param)
                if refusal is not None:
                    raise ValueError(
                        f"{type(self).__name__}: BackboneFinetuning(unfreeze_backbone_at_epoch={epoch}) unfreezes the "
                        f"LightningModule's backbone, whose parameter {names[param]} {refusal}; {KEEP_IT_FROZEN}"
                    )

    def _check_delayed_update(self, trainer: Trainer) -> None:
        """Refuse what the delayed update cannot do, before any step (preflight asks the same of the composed config)."""
        module = trainer.lightning_module
        check_delayed_update(fp16_scaling=getattr(self.precision_plugin, "scaler", None) is not None,
                             automatic_optimization=module.automatic_optimization, module_name=type(module).__name__)
        for optimizer in self.optimizers:
            check_delayed_optimizer(optimizer)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if self._executor is not None:
            self._executor.detach()
        resident = bool(self.offload_resident) or self._stream_resident
        materialized = materialize_meta(self.model, self.blocks, self.prefetch_blocks, resident, self.nvme_path,
                                        type(self).__name__, supported=self._materializes_meta)
        self._materialized = materialized or self._materialized
        try:
            plan = make_plan(self.model, self.blocks, self.prefetch_blocks, resident)
        except ValueError as err:
            raise ValueError(f"L2LOffloadStrategy: {err}") from None
        device = self.root_device
        compute_dtype = self._compute_dtype()
        if device.type == "cuda" and plan.blocks:
            _check_fits(plan, device, compute_dtype)
        if self._threads is None:  # the rank's CPU budget for the host step and the copies
            self._threads = HostThreads.plan(self._cpu_budget())
            self._threads.apply()
        self._executor = L2LExecutor(
            self.model, plan, device, compute_dtype, checkpoint_blocks=self.checkpoint_blocks,
            delayed_update=self.delayed_update, offload_activations=self.offload_activations,
            init_worker=self._threads.init_worker, owner=type(self).__name__,
        )
        self._executor.attach()
        # transformers models cache keys and values by default; a recomputed block would append them twice
        if self.checkpoint_blocks and (notice := self._kv_cache.off(self.model)) is not None:
            rank_zero_warn(notice)
        copies = (
            "the device is the host in fp32, so blocks compute on their masters (no copies)"
            if self._executor.streamer.alias
            else f"device copies in {compute_dtype} on {device}"
        )
        stats = self._executor.stats
        frozen = self._executor.store.frozen
        extras = [
            f"host keeps {stats.host_bytes / 2**30:.3f} GiB for {stats.offloaded_params:,} parameters "
            f"({stats.host_bytes_per_param:.2f} B each"
            + (f"; {sum(p.numel() for p in frozen):,} frozen, kept as stored and never written)" if frozen else ")"),
            *([f"host updates one step late after {self.delayed_update_warmup} warm-up steps"] if self.delayed_update else []),
            *(["block-boundary activations parked on the host"] if self.offload_activations else []),
            self._threads.describe(),
        ]
        # said in setup, once the optimizers' host kernels are known: one line per fit
        extras += [materialized.describe()] if materialized is not None else []
        self._plan_text = f"{type(self).__name__}: {plan.describe()}; {copies}" + "".join(f"; {e}" for e in extras)

    def _begin_step(self) -> None:
        """Before a step's forward: the executor follows what the user's code changed in the parameters since the
        last step (a backbone unfrozen at an epoch's start, a weight pruned; :mod:`lightning_accel.offload.replan`),
        after a pending delayed update has landed where the ranks agree on it, and the change is said in one line."""
        executor = self._executor
        assert executor is not None
        changes = executor.find_changes()
        if changes:  # (data parallel: the owners' updates sent before the masters change; every rank calls it)
            self._land_delayed_update()
        if executor.begin_step(changes):
            rank_zero_info(f"{type(self).__name__}: {changes.describe()}{self._after_changes()}")

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._executor is None:  # after teardown (a test driving the loop by hand): the model is an ordinary module
            return super().training_step(*args, **kwargs)
        self._begin_step()
        self._executor.start_delayed_update()  # the previous step's host update, beside this step's compute
        return super().training_step(*args, **kwargs)

    def _land_delayed_update(self) -> None:
        if self._executor is not None:
            self._executor.finish_delayed_update()
            self._after_delayed_landing()

    @override
    def on_validation_start(self) -> None:
        # validate (and let ModelCheckpoint save, right after) the weights with every update
        self._land_delayed_update()
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self._land_delayed_update()
        super().on_train_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._land_delayed_update()  # every checkpoint holds every update
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, torch.Tensor]:
        self._land_delayed_update()
        return super().optimizer_state(optimizer)

    def _eval(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._executor is None:  # (after teardown, as in training_step)
            return step(*args, **kwargs)
        self._begin_step()
        try:
            return step(*args, **kwargs)
        finally:
            self._executor.end_eval()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval(super().predict_step, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        executor = self._executor
        if executor is None:  # (after teardown, as in training_step)
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.delayed_update and trainer is not None and trainer.global_step >= self.delayed_update_warmup:
            return self._delayed_optimizer_step(optimizer, closure, model, **kwargs)
        executor.finish_delayed_update()  # (nothing pending unless delaying was just turned off)

        overlap = self._overlap_wanted() and self._can_overlap(optimizer)
        fuse = self._fuse(optimizer)

        def closure_then_host_grads() -> Any:
            executor.step_blocks_during_backward(functools.partial(step_params, optimizer, fuse=fuse) if overlap else None)
            executor.keep_low_grads(self._reads_low_grads(fuse))
            result = closure()
            self._gradients_ready()
            executor.install_grads()  # clipping and the final step see the host gradients
            return result

        return self._host_step(optimizer, fuse, lambda: super(L2LOffloadHooks, self).optimizer_step(
            optimizer, closure_then_host_grads, model, **kwargs))

    def _host_step(self, optimizer: Optimizer, fuse: bool, step: Callable[[], Any]) -> Any:
        """``step()`` (the optimizer's step, either front door's) as the update of the host parameters: on the fused CPU
        kernel, the low-precision shadows written in the same pass over the masters; then the rest of the shadows."""
        executor = self._executor
        assert executor is not None
        with host_update(optimizer, fuse, executor.shadows_to_write, executor.shadows_written, executor.low_grads_to_read,
                         before_step=executor.step_spilled if executor.tier is not None else None):
            output = step()
        self._after_update(optimizer)
        executor.after_step()  # refreshes the shadows the update did not (a skipped fp16 step: all)
        executor.update_host_bytes(self.host_optimizer_bytes())
        return output

    def _reads_low_grads(self, fuse: bool) -> bool:
        """Whether the update may read the bf16 gradients the host widened to fp32 (the fused update's C
        kernel does: :meth:`.HostStore.add_grad`)."""
        return fuse

    def host_optimizer_bytes(self) -> int:
        """Bytes of optimizer state held for the host parameters (a block frozen again keeps its state, as the
        optimizer does)."""
        if self._executor is None:
            return 0
        tier = self._executor.tier
        host = self._executor.store.master
        return sum(state_bytes(o, host) - (tier.state_bytes_on_disk(o) if tier is not None else 0) for o in self.optimizers)

    def _fuse(self, optimizer: Optimizer) -> bool:
        kernel = self._host_kernels.get(id(optimizer))
        return kernel is not None and kernel.fused

    def _delayed_optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any, **kwargs: Any) -> Any:
        executor = self._executor
        assert executor is not None

        def closure_then_host_grads() -> Any:
            executor.keep_low_grads(False)  # the deferred update reads the fp32 gradients
            executor.start_delayed_update()  # normally already running since training_step
            try:
                result = closure()
            finally:
                executor.finish_delayed_update()  # update t-1 lands; this step's compute is over
            self._gradients_ready()
            self._after_delayed_landing()
            executor.install_grads()  # clipping sees this step's host gradients too
            return result

        # After clipping, before the update: this step's host gradients become the pending
        # update, and optimizer.step() updates only the parameters kept on the device.
        fuse = self._fuse(optimizer)
        with host_update(optimizer, fuse), _after_closure(optimizer, functools.partial(executor.defer_update, optimizer, fuse=fuse)):
            output = super().optimizer_step(optimizer, closure_then_host_grads, model, **kwargs)
        self._after_defer()
        executor.after_step(masters_changed=False)
        executor.update_host_bytes(self.host_optimizer_bytes())
        return output

    def _can_overlap(self, optimizer: Optimizer) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        clipping = bool(trainer is not None and trainer.gradient_clip_val)
        scaling = getattr(self.precision_plugin, "scaler", None) is not None
        # a hook that reads the gradients must see every one of them before any block steps
        hooks = self._reads_gradients("on_after_backward", "on_before_optimizer_step")
        return isinstance(optimizer, PER_PARAMETER) and not clipping and not scaling and not hooks

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # With the tier, a checkpoint is as large as the state it keeps out of memory: written through the page cache it
        # would fill a memory limit (lightning_accel.atomic.CacheBoundedWriter); Lightning's default writer is swapped for
        # ours (atomic, 64 MiB at a time to disk), a CheckpointIO the user chose is kept
        if self.nvme_path is not None and type(self.checkpoint_io) is TorchCheckpointIO and storage_options is None:
            if self.is_global_zero:
                AtomicCheckpointIO().save_checkpoint(checkpoint, filepath)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self.nvme_path is None or not os.path.isfile(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # mapped: the state the tier puts on disk goes there from the file, never all of it in memory at once
        return torch.load(checkpoint_path, map_location="cpu", mmap=True, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        if self._executor is not None:
            self._executor.store.refresh_shadows()
            if self._executor.tier is not None:
                self._executor.tier.sync()  # the weights were written through the tier's maps

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # Optimizer.load_state_dict already puts each state tensor on its parameter's
        # device (host for blocks); the base class would then move all of it to the GPU.
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)
        if self._executor is not None and self._executor.tier is not None:
            self._executor.tier.adopt_state()  # the loaded state goes to the tier's files

    @override
    def teardown(self) -> None:
        self._unpatch_plugin()
        if self._executor is not None:
            self._executor.detach()  # the model computes normally again; stats stay readable
            if self._executor.tier is not None:  # its files go; the module and the optimizer keep reading their maps
                self._executor.tier.close()
            self._last_stats = self._executor.stats
            self._executor = None
        if self._threads is not None:
            self._threads.restore()
            self._threads = None
        self._kv_cache.restore()
        with kept_on_meta(self.lightning_module):  # (a model refused before it was materialized has nothing to move)
            super().teardown()

    def _base_setup(self, trainer: Trainer) -> None:
        """The base strategy's setup (device, model placement, optimizers)."""
        super().setup(trainer)

    def _cpu_budget(self) -> CpuBudget | None:
        """This rank's CPU budget; None: :func:`~lightning_accel.cpu_budget.cpu_budget` from the launcher's environment."""
        return None

    def _gradients_ready(self) -> None:
        """After the step's last backward, before the host gradients become ``param.grad``."""

    def _after_update(self, optimizer: Optimizer) -> None:
        """After the optimizer updated the parameters, before the shadows are refreshed."""

    def _after_defer(self) -> None:
        """After a step whose host update was deferred (``delayed_update``)."""

    def _after_delayed_landing(self) -> None:
        """After a point where a pending host update may have landed (every rank reaches the same ones)."""

    def _after_changes(self) -> str:
        """After the executor followed a change of the parameters (which train, which units hold which), before the
        step; returns what to add to the line that says the change."""
        return ""


@contextmanager
def _after_closure(optimizer: Optimizer, fn: Callable[[], None]) -> Generator[None, None, None]:
    """For the ``optimizer.step(closure)`` calls inside: run ``fn()`` after the closure
    returns and before the update. The precision plugin folds Lightning's
    ``on_before_optimizer_step`` hooks and gradient clipping into the closure it passes, so
    ``fn`` sees the final (clipped) gradients; there is no other hook at that point."""
    step = optimizer.step  # the instance's own wrapper if an LR scheduler put one there

    def step_then(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        def closure_then_fn() -> Any:
            result = closure() if closure is not None else None
            fn()
            return result

        return step(closure=closure_then_fn, **kwargs)

    with swapped(optimizer, "step", step_then):
        yield


def _check_fits(plan: Any, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a block that does not fit on the device by itself, before any step."""
    free, _ = torch.cuda.mem_get_info(device)
    element = torch.tensor([], dtype=dtype).element_size()
    biggest = max(plan.blocks, key=lambda u: u.numel)
    need = biggest.nbytes(element) * (1 + plan.prefetch_blocks)
    if not plan.offload_resident:
        need += plan.resident.nbytes(4)
    if need > free:
        raise ValueError(
            f"block {biggest.name} needs {need / 2**30:.2f} GiB on {device} with prefetch_blocks={plan.prefetch_blocks} "
            f"(plus the resident parameters) but only {free / 2**30:.2f} GiB is free; use smaller blocks "
            "(a finer block policy), prefetch_blocks=0, or offload_resident=True"
        )
