"""L2LOffloadDDPStrategy: L2L offload on N processes, data parallel, the host optimizer partitioned (ZeRO-Offload).

Why a class of its own (registered as ``"l2l_offload_ddp"``) and not ``"l2l_offload"`` with
``devices=N``: Lightning decides how to launch (its subprocess launcher, or nothing under
torchrun), the process-group backend (gloo on CPU, nccl on GPU) and whether to add a
``DistributedSampler`` from the strategy's *class* (a ``DDPStrategy`` with
``parallel_devices``), exactly as ``"ddp"`` and ``"single_device"`` are different classes.
``Trainer(strategy="l2l_offload", devices=2)`` fails when the Trainer is built, naming this one.

Each rank runs today's layer-to-layer streaming (:class:`~lightning_accel.offload.L2LExecutor`)
on its own shard of the data; the model is never wrapped in ``DistributedDataParallel``
(:class:`~lightning_accel.strategies.ddp_without_wrapper.DDPWithoutWrapper`, shared with
``DistributedGPipeStrategy``: timeout, refusals, accumulation, clipping and found-inf across ranks).
What this adds, each mechanism in :mod:`lightning_accel.offload`:

- gradients averaged as blocks finish their backward (:mod:`~lightning_accel.offload.grad_sync`):
  a block's collective is launched on a worker thread as soon as its last gradient has landed
  on the host, and overlaps the backward of the earlier blocks; all are joined before the
  step. The parameters kept on the device (embeddings, head, norms) are averaged with one
  all-reduce after the backward. While Lightning accumulates gradients
  (``accumulate_grad_batches``) nothing is sent: once per optimizer step, on the sum;
- ``host_step="partitioned"`` (default): each block belongs to one rank
  (:mod:`~lightning_accel.offload.partition`, block-granular), which alone receives its averaged
  gradients and keeps its optimizer state, steps it, and sends the updated fp32 weights to every
  rank (:mod:`~lightning_accel.offload.weight_sync`). A node then holds the host optimizer
  state (AdamW: two fp32 moments per parameter) once, not once per rank. The fp32 masters
  themselves are still on every rank (the ranks do not share host memory), and the parameters
  kept on the device are all-reduced and stepped by every rank, as DDP does;
- ``host_step="replicated"``: every block all-reduced and stepped by every rank (the
  comparison point: N copies of the optimizer state);
- clipping by norm uses the norm of the whole averaged gradient: squared norms of each rank's
  blocks summed across ranks, the device parameters' counted once (:mod:`~lightning_accel.comm.gradients`);
- checkpoints hold what DDP would write: the user's parameter names and one plain optimizer
  state over every parameter (rank 0 gathers the shards,
  :mod:`~lightning_accel.offload.optimizer_state`); loading one hands each rank its shard, so a
  checkpoint of this strategy loads into a one-device run or DDP and theirs into this.

What trains can change during the fit (``BaseFinetuning`` unfreezing a backbone, a block frozen again, pruning;
:mod:`~lightning_accel.offload.replan`): every rank follows the change before the same step, the averaging and the
device all-reduce take the parameters that train now, a unit keeps the rank that has stepped it (its optimizer state
is there) and the units that start training are given out around them
(:class:`~lightning_accel.offload.partition.UnitOwners`). torch's DDP does not do this: its reducer keeps the
parameters that required grad when it wrapped the model, so a backbone unfrozen later is not averaged and its ranks
drift apart; here the ranks equal one process on the global batch.

A model built on meta (``configure_model``, ``trainer.init_module(empty_init=True)``, ``hf_causal_lm(load_by_block=True)``)
is materialized unit by unit on every rank, each through its own staging files under ``nvme_path``
(:mod:`~lightning_accel.strategies.l2l_materialize`), as under ``L2LOffloadStrategy``.

At setup rank 0's weights and buffers go to every rank, as DDP does when it wraps the model;
after that each rank keeps its own buffers (DDP's ``broadcast_buffers=False``): BatchNorm
running statistics are per rank.

Where the bytes go: the blocks' gradients and weights are averaged and sent where they live,
in host memory, over a gloo process group of their own (beside nccl on a GPU, which carries only
the device parameters' all-reduce); the GPU path has not been run on a GPU yet.

``delayed_update``: the averaged gradients of step t become each owner's pending update, applied
beside step t+1's compute as on one device; the updated weights go to every rank once it has
landed (after step t+1's backward, or before validation, a checkpoint, the end of fit).

``nvme_path`` / ``host_budget`` (the NVMe tier, :mod:`~lightning_accel.offload.tier`): each rank lays out its own
tier, in a scratch directory of its own under ``nvme_path``, once the owners are known: partitioned, its files hold
the optimizer state of its own units and every unit's masters (and shadows), as its memory would. ``host_budget`` is
per rank (per process), and the plan line said is rank 0's; a budget the ranks could not keep is refused before
Lightning's launcher starts them (:mod:`~lightning_accel.strategies.l2l_offload_ddp_before_ranks`). An owner finishes its tier's writes before it sends the
updated masters; the others write them through their maps. Bit for bit the same run as in memory.

The user's ``on_after_backward`` and ``on_before_optimizer_step`` see DDP's gradients: averaged after the backward
that ends an accumulation (with ``on_after_backward`` overridden the averaging is joined before that hook instead of
at the step), the rank's own inside one; partitioned, a rank holds only its own blocks' averages, says so once, and
:meth:`L2LOffloadDDPStrategy.grad_norm` gives the whole model's norm.

A Fabric loop reaches this strategy as ``Fabric(strategy="l2l_offload_ddp")``
(:class:`lightning_accel.fabric.L2LOffloadDDPStrategy`), which drives it as its engine.

Refused, each with its reason, when the Trainer is built or fit starts: ``overlap_step=True``, manual optimization, ``sync_batchnorm``, DDP-wrapper arguments (there is
no wrapper), ``nvme_path`` with ``delayed_update`` (as on one device). ``OffloadPrecision("bf16-mixed")``, ``offload_activations`` and ``offload_resident``
work as on one device; with ``OffloadPrecision("16-mixed")`` each rank's ``GradScaler`` checks the
gradients that rank steps, and the ranks agree (any overflow: every rank skips the step and
lowers the scale), as DDP's ranks do on their common gradient.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.comm.gradients import clip_grad_norm_over, grad_norm_over
from lightning_accel.cpu_budget import CpuBudget, cpu_budget, local_ranks
from lightning_accel.models.block_policy import BlockPolicy
from lightning_accel.offload.grad_sync import HostGradientSync, PendingMean, launch_mean
from lightning_accel.offload.optimizer_state import gather_state, keep_state, param_indices, state_bytes
from lightning_accel.offload.partition import HostPartition, UnitOwners
from lightning_accel.offload.tier_setup import DATA_PARALLEL_STEP
from lightning_accel.offload.weight_sync import broadcast_units
from lightning_accel.stored import plain_parts
from lightning_accel.strategies.ddp_without_wrapper import DEFAULT_TIMEOUT, DDPWithoutWrapper
from lightning_accel.strategies.l2l_offload_ddp_before_ranks import check_tier_before_ranks
from lightning_accel.strategies.l2l_offload_hooks import L2LOffloadHooks
from lightning_accel.strategies.options_check import check_options

HostStep = Literal["partitioned", "replicated"]


class L2LOffloadDDPStrategy(L2LOffloadHooks, DDPWithoutWrapper):
    """L2L offload on every rank, data parallel, the host optimizer partitioned across ranks.

    Args:
        host_step: ``"partitioned"`` (each rank keeps and steps the optimizer state of its share
            of the blocks, then sends their weights to the others) or ``"replicated"`` (every rank
            steps every block, as DDP does).
        blocks, prefetch_blocks, offload_resident, checkpoint_blocks, offload_activations: as for
            :class:`~lightning_accel.strategies.L2LOffloadStrategy`.
        overlap_step: only ``None``/``False``: the host step runs after the gradients are averaged.
        delayed_update, delayed_update_warmup: as for ``L2LOffloadStrategy``; with the partitioned step
            each owner applies its blocks' update one step late and then sends their weights.
        timeout: as for :class:`~lightning_accel.strategies.ddp_without_wrapper.DDPWithoutWrapper` (30 minutes by
            default, Lightning's; a number is seconds).
        nvme_path, host_budget, nvme_chunk: as for ``L2LOffloadStrategy``, on each rank: its own files under ``nvme_path`` (its own
            units' optimizer state when partitioned), and ``host_budget`` is what each rank (process) may keep.
        process_group_backend, start_method, parallel_devices, cluster_environment,
            checkpoint_io, precision_plugin: as for Lightning's ``DDPStrategy``.
    """

    strategy_name = "l2l_offload_ddp"
    _materializes_meta = True  # every rank fills its own copy unit by unit (each through its own staging files)
    _averaging = "gradients are averaged block by block by the strategy itself"
    _fp16_hint = "OffloadPrecision('16-mixed')"

    def __init__(
        self,
        host_step: HostStep = "partitioned",
        blocks: BlockPolicy = "auto",
        prefetch_blocks: int = 1,
        offload_resident: bool | None = None,
        checkpoint_blocks: bool = True,
        overlap_step: bool | None = None,
        delayed_update: bool = False,
        delayed_update_warmup: int | None = None,
        offload_activations: bool = False,
        timeout: timedelta | float | None = DEFAULT_TIMEOUT,
        nvme_path: str | None = None,
        host_budget: int | str | None = None,
        nvme_chunk: int | str | None = None,
        **kwargs: Any,
    ) -> None:
        check_options(type(self).__name__, locals())  # each argument by kind, before any is used
        if host_step not in ("partitioned", "replicated"):
            raise ValueError(f"L2LOffloadDDPStrategy: host_step={host_step!r} is not one of 'partitioned', 'replicated'")
        if overlap_step:
            raise ValueError(
                "L2LOffloadDDPStrategy(overlap_step=True): a block's host step needs its gradients averaged over the "
                "ranks first, so it runs after the backward (the averaging is what overlaps); leave overlap_step unset"
            )
        super().__init__(timeout=timeout, **kwargs)
        self._init_offload(blocks, prefetch_blocks, offload_resident, checkpoint_blocks, overlap_step, delayed_update,
                           delayed_update_warmup, offload_activations, nvme_path, host_budget, nvme_chunk)
        self.host_step = host_step
        self._host_group: dist.ProcessGroup | None = None  # gloo, host tensors only, used by the sync worker
        self._grad_sync: HostGradientSync | None = None
        self._owners = UnitOwners(1, host_step == "partitioned")  # host parameters per unit, and who steps each
        self._resident: list[nn.Parameter] = []  # parameters kept on the device, all-reduced after backward
        self._resident_pending: PendingMean | None = None
        self._resident_bytes = 0  # the device parameters' share of reduced_bytes
        self._ended_for_hooks = False  # this backward was ended (and averaged) before on_after_backward
        self.reduced_bytes = 0  # gradient payload averaged for the last optimizer step (blocks and device parameters)
        self.gathered_bytes = 0  # weights broadcast after the last step (partitioned)
        self.reduced_in_backward = 0  # blocks whose averaging the last step launched before its backward had ended
        self._weights_pending = False  # delayed_update: owners' updates landing later are still to be sent
        self._owners_moved = False  # the owners changed when the NVMe tier was laid out again, before _after_changes

    # -- set-up ---------------------------------------------------------------------------------

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self._make_host_group()

    def _make_host_group(self) -> None:
        """The gloo group of the host tensors, once the default group exists (either front door's)."""
        if self._host_group is None:
            # host tensors (CPU even beside nccl); the gradient worker is its only user besides the
            # main thread between steps, so its collectives never interleave with Lightning's
            self._host_group = dist.new_group(backend="gloo", timeout=self._timeout)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        assert self._launcher is not None and self.cluster_environment is not None
        launch, environment = self._launcher.launch, self.cluster_environment

        def checked(function: Any, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
            # Lightning's launcher is about to start the ranks (not under torchrun or SLURM, where every rank checks
            # at set-up): a host budget they would refuse is refused here, once (l2l_offload_ddp_before_ranks)
            fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
            if fitting and not environment.creates_processes_externally and args and isinstance(args[0], nn.Module):
                check_tier_before_ranks(self, args[0], trainer)
            return launch(function, *args, trainer=trainer, **kwargs)

        self._launcher.launch = checked  # type: ignore[method-assign]

    @override
    def _base_setup(self, trainer: Trainer) -> None:
        # DDPStrategy.setup without the DistributedDataParallel wrapper (and without its module
        # broadcast, which would send host tensors over nccl on a GPU)
        assert self.accelerator is not None and self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self.host_step == "partitioned" and self._reads_gradients("on_after_backward", "on_before_optimizer_step"):
            rank_zero_warn(PARTITIONED_HOOKS_NOTICE)
        self._refuse_unsupported(trainer)
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._broadcast_initial_weights()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._setup_sync()
        self._replace_plugin_methods()  # clipping by norm (partitioned) and found-inf across ranks (DDPWithoutWrapper)

    def _broadcast_initial_weights(self, module: nn.Module | None = None) -> None:
        """Rank 0's parameters and buffers on every rank, as DDP does when it wraps the model (``module``: the
        LightningModule, or the module a Fabric loop set up)."""
        module = module if module is not None else self.lightning_module
        assert module is not None and self._executor is not None
        tensors = [*module.parameters(), *module.buffers()]
        # a frozen NF4 weight goes as its codes and scalers: sending it dequantized would re-quantize it
        host = [part for t in tensors if t.device.type == "cpu" for part in plain_parts(t.data)]
        device = [part for t in tensors if t.device.type != "cpu" for part in plain_parts(t.data)]
        broadcast_units([host], [0], self._host_group)
        if device:
            broadcast_units([device], [0], None)
        self._executor.store.refresh_shadows()

    def _setup_sync(self) -> None:
        executor = self._executor
        assert executor is not None
        plan = executor.plan
        self._owners = UnitOwners(self.world_size, self.host_step == "partitioned")
        self._plan_units()
        if self._grad_sync is not None:
            self._grad_sync.close()
        self._grad_sync = HostGradientSync(
            self._units, executor.store, self._host_group, owners=self._owners.owners,
            land=executor.streamer.finish_grads, init_worker=self._threads.init_worker if self._threads else None,
            # blocks last first, as the backward finishes them; a streamed resident unit (head and
            # embeddings: its gradients arrive at both ends of the backward) after all of them
            order=[*range(len(plan.blocks) - 1, -1, -1), *range(len(plan.blocks), len(self._units))],
        )
        self._plan_text += f"; {self.world_size} ranks, {self._owners.describe()}"

    def _plan_units(self) -> bool:
        """Each unit's host parameters and who steps it, and the device parameters to all-reduce: at setup, and again
        when what trains changed (:class:`~lightning_accel.offload.partition.UnitOwners`). Returns whether the owners
        changed."""
        assert self._executor is not None
        plan = self._executor.plan
        units = plan.blocks + ([plan.resident] if plan.offload_resident else [])
        self._resident = [] if plan.offload_resident else [p for _, p in plan.resident.params if p.requires_grad]
        return self._owners.update([[p for _, p in unit.params] for unit in units])

    @property
    def _partition(self) -> HostPartition | None:
        return self._owners.partition

    @property
    def _units(self) -> list[list[nn.Parameter]]:
        """The host parameters requiring grad, per unit."""
        return self._owners.units

    @override
    def _retier(self) -> None:
        # the new files hold optimizer state for the units this rank steps from now on: the owners first
        if self._grad_sync is not None:
            self._owners_moved = self._plan_units() or self._owners_moved
        super()._retier()

    @override
    def _after_changes(self) -> str:
        # which parameters train changed between steps: the averaging, the owners and the device all-reduce follow
        if self._grad_sync is None:  # (not fitting)
            return ""
        moved = self._plan_units() or self._owners_moved
        self._owners_moved = False
        self._grad_sync.set_units(self._units, self._owners.owners)
        for optimizer in self.optimizers:  # state another rank holds (a checkpoint's, kept until the owner was known)
            for param in self._owners.others(self.global_rank):
                optimizer.state.pop(param, None)
        return f"; {self._owners.describe()}" if moved else ""

    # -- gradients ------------------------------------------------------------------------------

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        assert self._executor is not None
        self._ended_for_hooks = False
        if self._sync_grads and self._grad_sync is not None:
            self._grad_sync.begin()
            self._executor.grads_landed = self._grad_sync.ready
        super().pre_backward(closure_loss)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self._ended_for_hooks:  # ended before on_after_backward (:meth:`_gradients_for_hooks`)
            self._ended_for_hooks = False
            return
        self._end_backward(closure_loss)

    @override
    def _gradients_for_hooks(self, closure_loss: torch.Tensor) -> None:
        # What DDP shows in on_after_backward: after the backward that ends an accumulation, the gradients averaged
        # over the ranks (the backward is ended and the averaging joined here, right before the hooks, instead of at
        # the optimizer step right after them: partitioned, a rank receives the means of its own blocks only); after
        # the backwards inside an accumulation, this rank's own sums.
        assert self._executor is not None
        if self._executor.grads_landed is not None:
            self._end_backward(closure_loss)
            self._ended_for_hooks = True
            self._gradients_ready()
        super()._gradients_for_hooks(closure_loss)

    def _end_backward(self, closure_loss: torch.Tensor) -> None:
        """Land the host gradients and launch the averaging of the ones not launched during the backward."""
        assert self._executor is not None
        syncing = self._executor.grads_landed is not None
        if syncing:
            assert self._grad_sync is not None
            self._grad_sync.drain()  # the worker has read what it launched before the rest lands here
        super().post_backward(closure_loss)
        self._executor.grads_landed = None
        if syncing:
            assert self._grad_sync is not None
            self._grad_sync.flush()
            self._resident_bytes = 0
            if self._resident:
                self._resident_pending = launch_mean(self._resident, [p.grad for p in self._resident], None)

    @override
    def _show_grads(self) -> None:
        # a backward that averages hands its buffers to the averaging (a rank keeps only its own blocks' means when
        # the host step is partitioned): they are shown once joined, in the hooks and at the step, not before
        pass

    @override
    def _gradients_ready(self) -> None:
        # (twice per step when on_after_backward was shown the means: the second call finds everything joined)
        if self._grad_sync is not None:
            self.reduced_in_backward = self._grad_sync.launched_in_backward
            self._grad_sync.wait()
        if self._resident_pending is not None:
            self._resident_bytes = self._resident_pending.nbytes
            for param, grad in self._resident_pending.result():
                param.grad = grad
            self._resident_pending = None
        self.reduced_bytes = (self._grad_sync.bytes_reduced if self._grad_sync is not None else 0) + self._resident_bytes

    @override
    def _tier_stepped(self) -> set[nn.Parameter] | None:
        return set(self.owned_parameters()) if self._partition is not None else None

    @override
    def _tier_label(self) -> str:
        return f"NVMe tier of rank {self.global_rank} (its own files; host_budget is per rank)"

    @override
    def _cpu_budget(self) -> CpuBudget | None:
        # Lightning's launcher does not export the ranks per host; a launcher that does (torchrun, SLURM) is believed
        return cpu_budget(self.num_processes if local_ranks()[1] == "default" else None)

    @override
    def _can_overlap(self, optimizer: Optimizer) -> bool:
        return False

    @override
    def _overlap_blocker(self, optimizer: Optimizer) -> tuple[str, str | None] | None:
        return DATA_PARALLEL_STEP

    @override
    def _may_stream_resident(self) -> bool:
        return False  # the units' owners are given out at set-up, before the tier's plan

    @override
    def _reads_low_grads(self, fuse: bool) -> bool:
        return False  # the averaged gradients are new fp32 tensors: no bf16 one they are the widening of

    @override
    def _clips_across(self) -> bool:
        return self._partition is not None  # replicated: every rank holds the whole averaged gradient, as under DDP

    @override
    def _found_inf_group(self) -> tuple[dist.ProcessGroup | None, torch.device]:
        return self._host_group, torch.device("cpu")

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The whole model's gradient norm (in ``on_after_backward`` or ``on_before_optimizer_step``): what
        ``lightning.pytorch.utilities.grad_norm(module, norm_type)`` reports as its total under DDP: of the averaged
        gradients, or inside an accumulation (where DDP has not averaged yet) of this rank's own. With the host step
        partitioned each rank holds only its own blocks' averaged gradients, so the norm is taken across the ranks: a
        collective, call it on every rank."""
        assert self._executor is not None
        host = self._executor.store.master
        params = [p for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # a host gradient here is one this rank owns; the device parameters' are alike on every rank: counted on rank 0
        counted = [self._partition is None or p in host or self.global_rank == 0 for p in params]
        group = self._host_group if self._partition is not None and self._sync_grads else None
        if group is None:  # replicated, or inside an accumulation: this rank holds every gradient it is to show
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.detach().double(), norm_type).cpu() for p in params]), norm_type)
        return grad_norm_over([p.grad for p in params], counted, float(norm_type), group, torch.device("cpu"))

    def held_grads(self, optimizer: Optimizer) -> tuple[list[torch.Tensor], list[bool]]:
        """The gradients of ``optimizer``'s parameters this rank holds, and whether each is counted here in a norm
        across the ranks (partitioned: a host gradient here is one this rank owns; the device parameters' are alike
        on every rank, counted on rank 0)."""
        assert self._executor is not None
        host = self._executor.store.master
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return [p.grad for p in params], [p in host or self.global_rank == 0 for p in params]

    @override
    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        grads, counted = self.held_grads(optimizer)
        clip_grad_norm_over(grads, counted, float(clip_val), self._host_group, torch.device("cpu"))

    @override
    def _after_update(self, optimizer: Optimizer) -> None:
        self._share_updated_weights()

    @override
    def _after_defer(self) -> None:
        # the owners' deferred updates land during the next step (or at validation, a checkpoint, the end)
        self._weights_pending = self._partition is not None

    @override
    def _after_delayed_landing(self) -> None:
        if self._weights_pending:
            self._weights_pending = False
            self._share_updated_weights()

    def _share_updated_weights(self) -> None:
        """Partitioned: every unit's masters from its owner, who alone stepped it (the worker is idle here)."""
        if self._partition is None:
            return
        assert self._executor is not None
        store, tier = self._executor.store, self._executor.tier
        if tier is not None:  # the owner's masters are views of its files: what they send is what its step wrote
            tier.finish_step()
        received, self.gathered_bytes = broadcast_units(
            [[store.master[p] for p in unit] for unit in self._units], self._partition.owners, self._host_group
        )
        params = [p for i in received for p in self._units[i]]
        if params:
            self._executor.refresh_shadows(params)
        if tier is not None and params:  # written through the maps: to the files, and no weights read before kept
            tier.sync()

    # -- what each rank holds, and checkpoints ----------------------------------------------------

    def owned_parameters(self) -> list[nn.Parameter]:
        """The host parameters this rank steps (all of them when replicated)."""
        return self._owners.stepped_by(self.global_rank)

    def host_optimizer_bytes(self) -> int:
        """Bytes of optimizer state this rank holds in host memory for host parameters (1/N of all when partitioned;
        what the NVMe tier keeps in its files not counted)."""
        host = [p for unit in self._owners.held for p in unit]
        tier = self._executor.tier if self._executor is not None else None
        return sum(state_bytes(o, host) - (tier.state_bytes_on_disk(o) if tier is not None else 0) for o in self.optimizers)

    def host_weight_bytes(self) -> int:
        """Bytes of host weights this rank holds (fp32 masters, low-precision copies, frozen tensors as stored; not partitioned)."""
        return self._executor.store.weight_bytes() if self._executor is not None else 0

    def _kept_indices(self, optimizer: Optimizer) -> set[int]:
        """Indices of ``optimizer.state_dict()`` whose state this rank keeps: its own units' parameters and every
        parameter of no unit that has trained yet (the device's, a frozen backbone's: its owner is not known yet)."""
        decided, mine = self._owners.state_ids(self.global_rank)
        return {i for pid, i in param_indices(optimizer).items() if pid in mine or pid not in decided}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        if self._partition is None:
            return state
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        _, mine = self._owners.state_ids(self.global_rank)
        send = {i for pid, i in param_indices(inner).items() if pid in mine}
        return gather_state(state, send, self._host_group, dst=0)

    def optimizer_shard(self, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """Of a plain optimizer state (a checkpoint's, over every parameter), what this rank keeps: its shard when
        partitioned, all of it when replicated."""
        return keep_state(state, self._kept_indices(optimizer)) if self._partition is not None else state

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._partition is not None:  # this rank's shard (then, with the tier, into its files)
            states = [self.optimizer_shard(o, s) for o, s in zip(self.optimizers, checkpoint["optimizer_states"])]
            checkpoint = {**checkpoint, "optimizer_states": states}
        super().load_optimizer_state_dict(checkpoint)

    @override
    def teardown(self) -> None:
        if self._grad_sync is not None:
            self._grad_sync.close()
            self._grad_sync = None
        self._resident_pending = None
        super().teardown()


# Said once (rank 0) when the user's code reads gradients and the host step is partitioned.
PARTITIONED_HOOKS_NOTICE = (
    "L2LOffloadDDPStrategy(host_step='partitioned'): in on_after_backward and on_before_optimizer_step each rank holds "
    "the averaged gradients of its own blocks and of the parameters kept on the device; the other ranks' blocks have "
    "no .grad there. trainer.strategy.grad_norm(2), called on every rank, is the whole model's norm (host_step="
    "'replicated' shows every averaged gradient, as DDP)"
)
