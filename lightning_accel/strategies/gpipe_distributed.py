"""DistributedGPipeStrategy: one pipeline stage per process, launched the way Lightning launches DDP.

Why a class of its own and not ``GPipeStrategy(processes=True)``: Lightning decides how to launch, how many processes,
which process-group backend and whether to add a ``DistributedSampler`` from the strategy's *class*. So this is a
``DDPStrategy`` that never wraps the model (:class:`~lightning_accel.strategies.ddp_without_wrapper.DDPWithoutWrapper`,
shared with ``L2LOffloadDDPStrategy``), registered as ``"gpipe_distributed"``, a thin adapter over
:mod:`lightning_accel.pipeline`, whose mechanisms know no Lightning. It is four files, one concept each:

- this one: the options, the placement (``pipeline_parallel_size`` ranks a pipeline, ``dp`` replicas on a ``("pp",
  "dp")`` mesh: :mod:`~lightning_accel.pipeline.mesh`), the set-up that refuses what cannot be honoured, splits the module
  (each rank keeps its stages, the other blocks on ``meta``: :mod:`~lightning_accel.pipeline.rank_split`) and cuts the
  model's call (:class:`~lightning_accel.pipeline.whole_step.ModelCalls`), and the teardown;
- :mod:`~lightning_accel.strategies.gpipe_distributed_steps`: where the user's steps run and Lightning's ``backward``
  (the route of a step, top to bottom, starts at its ``training_step``);
- :mod:`~lightning_accel.strategies.gpipe_distributed_ranks`: what counts replicas (``world_size``, the sampler,
  torchmetrics) and the collectives (``self.log(sync_dist=True)``, ``self.all_gather``, votes, the gradient norm);
- :mod:`~lightning_accel.strategies.gpipe_split_state`: checkpoints of the whole model and the whole module after a run.

A network built in ``configure_model`` is built on ``meta`` and each rank materializes its part from the user's own build
(:mod:`~lightning_accel.strategies.gpipe_configure_model`); Lightning's callbacks that walk every parameter see what their
rank holds (:mod:`~lightning_accel.strategies.gpipe_callbacks`). docs/pipeline.md says what is honoured, what is
refused, and what was measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_accel.models.block_policy import BlockPolicy, find_blocks
from lightning_accel.models.router_loss import router_loss_notice
from lightning_accel.models.side_effects import KVCacheSwitch
from lightning_accel.patching import Patch, remove_all, swapped
from lightning_accel.pipeline.deferred_init import has_meta_tensors
from lightning_accel.pipeline.distributed import RankPipeline, stage_indices
from lightning_accel.pipeline.mesh import check_ranks_per_pipeline, check_world_size, hold_mesh, mesh_coordinates
from lightning_accel.pipeline.mesh import process_mesh, rank_layout, ranks_per_pipeline
from lightning_accel.pipeline.options import PipelineOptions, ReadsPipelineOptions
from lightning_accel.pipeline.placement import RankLayout, check_split
from lightning_accel.pipeline.rank_balance import choose_balance, example_block_times
from lightning_accel.pipeline.rank_split import RankSplit, split_module
from lightning_accel.pipeline.whole_step import ModelCalls
from lightning_accel.pipeline.schedule import SCHEDULE_TABLE, check_schedule, stage_rank
from lightning_accel.pipeline.auto_schedule import AutoSchedule
from lightning_accel.pipeline.schedule_tuner import ScheduleTuner
from lightning_accel.pipeline.placeholders import placeholders_equal_nothing
from lightning_accel.pipeline.step_report import metrics_over_replicas
from lightning_accel.strategies.ddp_without_wrapper import DEFAULT_TIMEOUT, DDPWithoutWrapper
from lightning_accel.strategies.compiled_modules import compiled_around
from lightning_accel.strategies.gpipe_callbacks import adapt_callbacks, refuse_callbacks
from lightning_accel.strategies.gpipe_configure_model import ConfigureModelReplay
from lightning_accel.strategies.gpipe_distributed_ranks import ReplicaCollectives
from lightning_accel.strategies.gpipe_distributed_steps import PipelineSteps
from lightning_accel.strategies.gpipe_split_state import SplitModuleState
from lightning_accel.strategies.options_check import check_options
from lightning_accel.strategies.pipeline_checks import refuse_closure_optimizers, refuse_gradients_in_evaluation
from lightning_accel.strategies.user_hooks import overrides

_LAYOUT = "_gpipe_distributed_layout"  # on a split module: (ranks, placement, balance)


def _to_device(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for every tensor but the freed (meta) ones."""
    module._apply(lambda t: t if t.is_meta else t.to(device))


class DistributedGPipeStrategy(
    ReadsPipelineOptions, PipelineSteps, ReplicaCollectives, ConfigureModelReplay, SplitModuleState, DDPWithoutWrapper
):
    """Pipeline parallelism over processes: the model's blocks in one stage per rank, batches in ``chunks`` micro-batches.

    Args:
        chunks: micro-batches per batch (M). A batch it does not divide (a smaller last batch, or a batch_size that is
            not a multiple) trains in equal micro-batches of another count: fewer (a divisor of its size), or more where
            the schedule needs them; a size no count fits is refused before the first step.
        schedule: ``"gpipe"`` (all forwards, then all backwards), ``"1f1b"`` (fewer
            activations alive), ``"interleaved_1f1b"`` (two stages per rank, smaller bubble;
            needs ``chunks`` >= stages), or torch's zero-bubble schedules, which split each backward into its
            input- and weight-gradient halves and fill the bubble with the weight halves: ``"interleaved_zb"``
            (looped as ``interleaved_1f1b``), ``"zbv"`` and ``"dualpipev"`` (two stages per rank placed V-wise: rank
            ``r`` holds stages ``r`` and ``2W - 1 - r``, so rank 0 runs the first and the last; ``dualpipev`` needs
            ``chunks`` >= stages). Two stages per rank need at least ``2W`` blocks. ``"auto"`` (or
            :class:`~lightning_accel.pipeline.auto_schedule.AutoSchedule` for its start, steps and
            ``max_activation_bytes``): starts on ``1f1b``, measures each stage over the first steps and switches once
            to the schedule and ``chunks`` its clock predicts fastest, among those of the start's placement
            (:mod:`lightning_accel.pipeline.schedule_tuner`; one line on rank 0 says what and why).
        balance: blocks per stage (one entry per rank, two per rank for
            the two-stage-per-rank schedules), ``"by_size"`` (parameter and buffer bytes) or ``"by_time"``
            (forward + backward seconds of each block on the LightningModule's
            ``example_input_array``, measured once on rank 0; see the module docstring).
        blocks: which submodules are the blocks that stages split at: a policy for
            :func:`lightning_accel.models.block_policy.find_blocks` (``"auto"``, block classes
            or a callable), as for ``GPipeStrategy`` and ``L2LOffloadStrategy``. ``"auto"`` takes every repeated
            stack: an encoder-decoder's encoder blocks, then its decoder's, split over the ranks as one sequence; the
            encoder's last block output travels beside the activations to every later stage
            (:mod:`lightning_accel.pipeline.stack_carry`).
        loss_reduction: how ``training_step``'s loss reduces over samples: ``"mean"`` or ``"sum"``.
        checkpoint: re-materialization per stage and micro-batch, as in ``GPipeStrategy``:
            ``"always"``, ``"except_last"`` or ``"never"`` (the default here: raw
            ``torch.distributed.pipelining`` keeps every micro-batch's activations, and each
            rank already holds only its own stage's; turn it on when those do not fit).
        pipeline_parallel_size: ranks per pipeline (pp); the world size must be a multiple,
            ``world_size // pp`` replicas train data parallel (dp), each on its own shard of the
            data. Default: ``len(balance)`` (half of it for ``interleaved_1f1b``) when balance is a
            list, else every rank (one pipeline, dp = 1).
        timeout: how long a rank waits for a neighbour before failing (a dead rank ends every
            rank with an error naming it, never a hang): 30 minutes by default, as every strategy of
            :class:`~lightning_accel.strategies.ddp_without_wrapper.DDPWithoutWrapper`; a number is seconds.
        start_method: as for ``DDPStrategy``: ``"popen"`` re-runs your script per rank.
        deferred_init: a network built in ``configure_model`` is built on the ``meta`` device and each rank
            materializes only its part, with the values of the user's own build where that fits whole (see the module
            docstring); ``"parts"``: always from per-module seeds (no rank ever holds the whole network, not even
            while setting up; the starting values are not your seed's draws); ``False`` builds it whole on every rank,
            as one built in ``__init__`` is.
        deferred_batch_norm: with ``chunks > 1`` a BatchNorm normalizes each micro-batch with its own statistics, so
            training differs from plain Lightning's: not given (None), that is refused before the first step
            (:mod:`lightning_accel.pipeline.batch_layers`); ``True`` accepts it, and updates the running statistics once
            per batch from the whole batch's (torchgpipe's semantics: ``num_batches_tracked`` counts batches, a
            ``momentum=None`` average weighs batches); ``False``, once per micro-batch. Recomputation and shape
            inference never update them.
    """

    strategy_name = "gpipe_distributed"
    _averaging = "each stage's gradients are averaged over the replicas by the strategy itself"
    _needs_automatic = "the pipeline schedule runs forward and backward itself"

    def __init__(
        self,
        chunks: int = 1,
        schedule: str | AutoSchedule = "gpipe",
        balance: Sequence[int] | str = "by_size",
        loss_reduction: str = "mean",
        checkpoint: str = "never",
        pipeline_parallel_size: int | None = None,
        timeout: timedelta | float | None = DEFAULT_TIMEOUT,
        start_method: str = "popen",
        blocks: BlockPolicy = "auto",
        deferred_init: bool | str = True,
        deferred_batch_norm: bool | None = None,
        **kwargs: Any,
    ) -> None:
        check_options(type(self).__name__, locals())  # each argument by kind, before any is used
        self.options = PipelineOptions(chunks, balance, checkpoint, loss_reduction)  # validated once, shared with GPipeStrategy
        self._auto = AutoSchedule() if schedule == "auto" else schedule if isinstance(schedule, AutoSchedule) else None
        self._tuner: ScheduleTuner | None = None
        if self._auto is not None:  # runs its start first; lightning_accel.pipeline.schedule_tuner switches once
            schedule = self._auto.start
        if schedule not in SCHEDULE_TABLE:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULE_TABLE)}, got {schedule!r}; or 'auto' (chosen by measurement); '1f1b' keeps the fewest activations alive")
        check_ranks_per_pipeline(pipeline_parallel_size, balance, SCHEDULE_TABLE[schedule].stages_per_rank, schedule)
        super().__init__(timeout=timeout, start_method=start_method, **kwargs)
        self.schedule = schedule
        self._pp_size = pipeline_parallel_size
        self.blocks = blocks
        self.deferred_init = deferred_init
        self.deferred_batch_norm = deferred_batch_norm
        self._deferred: bool | None = None  # this run's module was built on meta (decided once per run)
        self._kv_cache = KVCacheSwitch(type(self).__name__, "re-materializing")  # use_cache off for fit, back at teardown
        self._mesh: Any = None  # the ("pp", "dp") DeviceMesh, built once the process group is up
        self.pipeline: RankPipeline | None = None
        self._split_state: RankSplit | None = None  # who holds which tensor; kept after fit for save_checkpoint
        # methods replaced on the precision plugin (DDPWithoutWrapper) and the summary callbacks (objects a later Trainer
        # may be handed): from setup to teardown, which Lightning also calls when the fit raises
        self._patches: list[Patch] = []
        self._pending: list[Tensor | None] = []  # this step's gradients, until Lightning's backward
        self._backward_error: BaseException | None = None  # what this step's backward raised, until Lightning's backward
        self._failed_together = False  # a step failed on every rank of the one pipeline alike (SplitModuleState)
        self._constant_sizes: set[str] = set()  # logged names whose batch_size is a constant, not the batch's (reduce_logs)
        self._block_times: list[float] | None = None  # balance="by_time": seconds per block, as rank 0 measured
        self._undo_equal: Callable[[], None] | None = None  # torch.equal on placeholders, from setup to teardown
        self._whole_at_setup = False  # the module was whole when this run's setup split it (after fit: every rank)

    # -- placement ----------------------------------------------------------------------------

    def _pp(self, world_size: int) -> int:
        return ranks_per_pipeline(self._pp_size, self.balance, SCHEDULE_TABLE[self.schedule].stages_per_rank, world_size)

    @property
    def pipeline_parallel_size(self) -> int:
        """Ranks per pipeline (pp)."""
        return self._pp(self._processes)

    @property
    def data_parallel_size(self) -> int:
        """Pipeline replicas training data parallel (dp)."""
        return max(1, self._processes // self.pipeline_parallel_size)  # 1 until launched

    def check_layout(self, world_size: int) -> int:
        """Refuse a world size the pipeline layout (``pipeline_parallel_size``, or ``len(balance)``) does not divide;
        returns the ranks per pipeline. Called before any process starts (the Trainer's launcher, torchrun's
        ``setup_distributed``) and by ``lightning_accel.config.preflight`` on ``trainer.devices x num_nodes``."""
        given = "given" if self._pp_size is not None else f"from len(balance)={len(self.balance)}"
        check_world_size(world_size, self._pp(world_size), given, type(self).__name__)
        return self._pp(world_size)

    @override
    def _configure_launcher(self) -> None:
        if self.num_processes:  # the Trainer is being built: fail before any process starts
            self.check_layout(self.num_nodes * self.num_processes)
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        self.check_layout(self.num_nodes * self.num_processes)  # torchrun: before the process group
        super().setup_distributed()
        self._mesh = process_mesh(self.root_device.type, self._processes, self.pipeline_parallel_size, self._timeout)
        hold_mesh(self)

    @property
    def _coords(self) -> tuple[int, int]:
        """This rank's ``(pp_rank, dp_rank)`` on the mesh."""
        return mesh_coordinates(self._process_rank, self._processes, self.pipeline_parallel_size)

    @property
    def _layout(self) -> RankLayout:
        """This rank on the mesh, as the placement and checkpoint mechanisms take it."""
        return rank_layout(self._mesh, self._process_rank, self.root_device)

    def _net(self) -> nn.Module:
        module = self.lightning_module
        assert module is not None
        net = getattr(module, "net", None)
        return net if isinstance(net, nn.Module) else module

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """A module built on ``meta`` has nowhere to load weights into until setup has materialized this rank's part."""
        if self._deferred is None:
            module = self.lightning_module
            self._deferred = module is not None and getattr(module, _LAYOUT, None) is None and has_meta_tensors(module)
        return self._deferred

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # DDPStrategy.setup would move the whole model to the device and broadcast all of it;
        # here each rank only ever places its own stages there
        self._refuse_unsupported(trainer)
        refuse_callbacks(trainer, type(self).__name__)
        self.refuse_compiled(trainer.lightning_module)
        refuse_gradients_in_evaluation(type(self).__name__, trainer.lightning_module)

        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self._whole_at_setup = not has_meta_tensors(trainer.lightning_module)
        self._failed_together, self._constant_sizes = False, set()
        self._split()
        self._unpatch()  # a setup without a teardown between (not Lightning's order): patch once, not twice
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            refuse_closure_optimizers(type(self).__name__, self.optimizers)
            assert self._split_state is not None
            self._split_state.keep_own_parameters(trainer.lightning_module, self.optimizers, self._layout)
        assert self._split_state is not None
        self._patches = adapt_callbacks(trainer, trainer.lightning_module, self._split_state, self._layout, self._process_rank)
        self._patches.append(metrics_over_replicas(self._layout.dp_group))  # torchmetrics: a replica's state counted once
        self._undo_equal = placeholders_equal_nothing()  # BaseFinetuning compares every parameter by value
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._replace_plugin_methods()  # clipping by norm and found-inf across ranks (DDPWithoutWrapper)
        if trainer.state.fn == TrainerFn.FITTING and overrides(trainer.lightning_module, "on_after_backward", "on_before_optimizer_step"):
            rank_zero_warn(
                "DistributedGPipeStrategy: in on_after_backward and on_before_optimizer_step each rank holds the gradients "
                "of its own stages (and of the weights outside the blocks its stages use), already averaged over the "
                "replicas; the other stages' parameters have none there. trainer.strategy.grad_norm(2) gives the whole "
                "model's norm (call it on every rank)"
            )

    @override
    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        _to_device(self.lightning_module, self.root_device)  # the meta stages (other ranks') stay meta

    def _balance(self, blocks: list[nn.Module], stages: int) -> list[int]:
        module, net, plugin = self.lightning_module, self._net(), self.precision_plugin
        assert module is not None
        check, measure = example_block_times(module, net, blocks, self.root_device, plugin.convert_input, plugin.train_step_context)
        balance, times = choose_balance(
            self.balance, blocks, stages, self.pipeline_parallel_size, type(net).__name__, measure, has_meta_tensors(net), check
        )
        if times is not None:
            self._block_times = times
            rank_zero_info(
                f"DistributedGPipeStrategy: balance='by_time' {balance}: " + ", ".join(f"{t * 1e3:.2f}" for t in times)
                + f" ms per block, forward + backward on example_input_array on {self.root_device} of rank 0"
            )
        return balance

    def refuse_compiled(self, module: pl.LightningModule) -> None:
        """Before any work: a ``torch.compile`` around the blocks (``net = torch.compile(net)``, ``net.compile()``,
        ``trainer.fit(torch.compile(model))``) is refused in one line; a compiled block is fine (a stage runs it whole).
        Before: the fit ran, Dynamo compiled nothing, and the weights ended elsewhere than DDP's."""
        net = getattr(module, "net", None)
        blocks = find_blocks(net if isinstance(net, nn.Module) else module, self.blocks, stacks="all")
        if (compiled := compiled_around(module, [b.module for b in blocks])) is not None:
            raise ValueError(
                f"{type(self).__name__} cannot run {compiled}: it holds the pipeline's blocks, which each rank runs with "
                "the other ranks' as sends and receives, and Dynamo cannot trace that; compile each block instead "
                "(block.compile()), or remove torch.compile"
            )

    def _split(self) -> None:
        """Build this rank's stages; on first use give them their starting weights and free the other ranks' blocks."""
        module, net = self.lightning_module, self._net()
        assert module is not None
        # every repeated stack (an encoder-decoder's encoder, then its decoder): a stage carries the encoder's output on
        # beside its own to every decoder stage (lightning_accel.pipeline.stack_carry)
        blocks = find_blocks(net, self.blocks, stacks="all")
        ranks = self.pipeline_parallel_size
        placement = SCHEDULE_TABLE[self.schedule].placement
        stages = len(stage_indices(0, ranks, self.schedule)) * ranks
        check_schedule(self.schedule, self.chunks, stages)
        layout = getattr(module, _LAYOUT, None)  # set when an earlier fit split this module
        balance = check_split(
            layout, ranks, placement, self.schedule, self.balance, stages, len(blocks),
            lambda: self._balance([b.module for b in blocks], stages),
        )
        if self._kv_cache.off(net) is not None and self._kv_cache.settings is not None:  # said as an info line, in its own words
            rank_zero_info(
                f"DistributedGPipeStrategy: set {', '.join(self._kv_cache.settings)} = False for training (each micro-batch "
                "and stage would write the KV cache again)"
            )
        if (router := router_loss_notice(type(self).__name__, net, self.chunks)) is not None:
            rank_zero_warn(router)  # each stage carries its routers' sums to the last (lightning_accel.pipeline.router_carry)
        self.pipeline, self._split_state = split_module(
            module, blocks, balance, self._layout, first=layout is None, initial=self._initial_values,
            chunks=self.chunks, schedule=self.schedule,
            scale_grads=self.options.scale_grads, checkpoint=self.checkpoint,
            deferred_batch_norm=self.deferred_batch_norm is not False,  # checked: None only where no BatchNorm trains
            failure_group=None if self.data_parallel_size > 1 else "pipeline",  # every replica stops: none waits in the average
        )
        # the model's call in the user's steps runs the pipeline (lightning_accel.pipeline.whole_step)
        if self._calls is not None:  # split again without a teardown between
            self._calls.restore()
        self._calls = ModelCalls(self.pipeline, self._layout.pp_global(self._last_rank())) if self.pipeline.entry else None
        if layout is None:
            object.__setattr__(module, _LAYOUT, (ranks, placement, tuple(balance)))
        fitting = module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        self._tuner = ScheduleTuner(self.pipeline, self._auto) if self._auto is not None and fitting else None
        self.model_to_device()

    def _last_rank(self) -> int:
        """The pipeline rank of the last stage: the last rank, or rank 0 for a V-shaped schedule (``zbv``, ``dualpipev``)."""
        ranks = self.pipeline_parallel_size
        return stage_rank(len(stage_indices(0, ranks, self.schedule)) * ranks - 1, ranks, self.schedule)

    def sync_weights(self) -> None:
        """Give every rank the current values of what lives outside the stages (all ranks must call this)."""
        if self._split_state is not None and self.lightning_module is not None and dist.is_initialized():
            self._split_state.sync_shared(self.lightning_module, self._layout)  # also after fit: save_checkpoint

    def _unpatch(self) -> None:
        remove_all(self._patches)
        self._remove_plugin_methods()
        if self._undo_equal is not None:
            self._undo_equal()
            self._undo_equal = None

    @override
    def teardown(self) -> None:
        self._whole_after_run()  # every rank's module whole, as after DDP (gpipe_split_state)
        self._unpatch()
        # _split_state stays: trainer.save_checkpoint after fit still gathers the stages, as does the mesh
        # (one per process, see pipeline.mesh.process_mesh: nothing to destroy here)
        if self._calls is not None:
            self._calls.restore()  # the model's call is its own again
        if self.pipeline is not None:
            self.pipeline.restore()  # the blocks get their own forwards back (a later fit or validate splits afresh)
        self.pipeline, self._calls, self._pending = None, None, []
        self._kv_cache.restore()
        self._step_signature_cache = None  # every rank of the pipeline tears down: the next fit starts afresh
        self._deferred = None
        module = self.lightning_module
        if module is None:
            return super().teardown()
        _to_device(module, torch.device("cpu"))
        with swapped(module, "cpu", lambda: module):  # Lightning's teardown would copy the meta stages
            super().teardown()
