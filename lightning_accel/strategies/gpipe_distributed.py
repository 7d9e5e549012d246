"""DistributedGPipeStrategy: one pipeline stage per process, launched the way Lightning launches DDP.

Why a class of its own and not ``GPipeStrategy(processes=True)``: Lightning decides how to
launch (its subprocess launcher, or nothing under torchrun), how many processes, which
process-group backend and whether to add a ``DistributedSampler`` from the strategy's
*class*, exactly as ``"ddp"`` and ``"single_device"`` are different classes. So this is a
:class:`~lightning.pytorch.strategies.DDPStrategy` that never wraps the model in
``DistributedDataParallel`` (:class:`~lightning_accel.strategies.ddp_without_wrapper.DDPWithoutWrapper`,
which it shares with ``L2LOffloadDDPStrategy``): ``Trainer(accelerator="cpu", devices=2,
strategy=DistributedGPipeStrategy(chunks=4))``, registered as ``"gpipe_distributed"``. It
is a thin adapter over :mod:`lightning_accel.pipeline`, whose mechanisms know no Lightning.

Data parallel across pipeline replicas (DP x PP): ``pipeline_parallel_size`` ranks make one
pipeline (default ``len(balance)``, halved for ``interleaved_1f1b``, or every rank); a world
size ``pp * dp`` runs ``dp`` replicas on a ``("pp", "dp")`` mesh (:mod:`~lightning_accel.pipeline.mesh`),
each on its own shard of the data (Lightning's ``DistributedSampler`` with ``num_replicas=dp``),
each stage's gradients averaged over the replicas once per optimizer step, so training matches
plain training on the global batch. ``sync_dist=True`` logs and torchmetrics reduce over the
replicas. A world size that is not a multiple of ``pp`` fails when the ``Trainer`` is built
(:meth:`DistributedGPipeStrategy.check_layout`; preflight asks it of ``trainer.devices`` first).

A training step: every rank of a pipeline loads the same batch and runs
:class:`~lightning_accel.pipeline.RankPipeline`'s schedule over the model's own forward: under ``schedule="gpipe"``
the user's ``training_step`` once per batch on every rank, the call of the module that runs the blocks split into the
micro-batches (:mod:`~lightning_accel.pipeline.whole_step`); under the other schedules once per micro-batch on the last
stage's rank. Its stages' blocks
(``blocks=``) compute, the other ranks' blocks are receive and send points
(:mod:`~lightning_accel.pipeline.boundaries`), so transformers and litgpt models run
unchanged (their ``config.use_cache`` off for training). The last rank's loss and logs,
reduced over the micro-batches, reach every rank (:mod:`~lightning_accel.pipeline.rank_step`),
so rank 0's loggers and every rank's callbacks see the same. The schedule's gradients wait
for Lightning's ``backward``; clipping by norm uses every stage's norm and a ``GradScaler``'s
overflow verdict is every rank's (:mod:`~lightning_accel.comm.gradients`).

Memory: each rank keeps its stages' blocks and what is outside the blocks (embeddings, norms,
head, the LightningModule's own tensors); the other blocks are on ``meta`` and the optimizer
holds only this rank's parameters (:mod:`~lightning_accel.pipeline.placement`). Outside the
blocks, only the ranks whose part of the forward uses a weight get its gradient and step it (an
untied embedding on the first rank, norm and head on the last; their gradients are never sent),
and a weight two stages use (a tied embedding and head) is summed between those two only;
checkpoints and the clip norm take each from a rank that uses it (``RankPipeline._sum_shared``).
The unused copies stay allocated (not yet freed: a later rank's forward still runs the
embedding, and e.g. Llama takes its rotary tables' device from its output). A network built
in ``__init__`` exists whole on every rank before setup (rank 0 sends each rank its starting
weights). One built in ``configure_model`` (Lightning's hook for large models) is built on
``meta`` and each rank keeps only its part: its starting values are those of the user's own build
(``configure_model`` run once more on a copy, whole, from the random state it started from:
:mod:`~lightning_accel.pipeline.build_replay`), so they equal plain Lightning's and DDP's, where every rank's
copy fits its free memory; where not (one warning), each rank materializes and initializes its part alone
(:func:`~lightning_accel.pipeline.deferred_init.materialize`, seeded from global rank 0's
``torch.initial_seed()`` and each module's name: ``materialize`` of the whole model in one process, for any
layout); a checkpoint given to ``fit`` loads after setup. After ``fit`` every rank's module is the whole trained model (the other stages gathered onto the CPU, as a
module is after DDP, when they fit the hosts' free memory; otherwise one warning on each rank names
``trainer.strategy.gather_module()``: :mod:`~lightning_accel.strategies.gpipe_split_state`); ``validate``, ``test``,
``predict`` and another ``fit`` split it again (an evaluation leaves it whole again).

Lightning's features that see every parameter or every rank's outputs behave as under DDP: callbacks that walk the
parameters (``BaseFinetuning``'s unfreezing into a new param group, ``StochasticWeightAveraging``'s averaged copy) see
real tensors for what their rank holds and leave the placeholders (:mod:`~lightning_accel.strategies.gpipe_callbacks`;
``ModelPruning`` is refused before the first step); what ``training_step`` or ``validation_step`` appends to the
module's lists (Lightning 2's epoch-end outputs) is the last rank's, one item per batch, on every rank
(:mod:`~lightning_accel.pipeline.kept_outputs`); ``self.all_gather`` gathers over the replicas (in a ``training_step``
that micro-batches run it is refused before the first step); a stage's own error (``detect_anomaly``'s included, raised
in Lightning's ``backward`` as plain Lightning raises it) ends the step on every rank as that error, so ``on_exception``
runs everywhere and the module is whole after the failed fit (:mod:`~lightning_accel.pipeline.step_failure`).

Balance: a list, ``"by_size"``, or ``"by_time"`` (each block timed on global rank 0 on the
LightningModule's ``example_input_array`` before the first batch;
:mod:`~lightning_accel.pipeline.rank_balance`). Every batch trains: one whose size ``chunks``
does not divide runs in equal micro-batches of another count (torch's stages take one shape per
step); a ``batch_size`` or last batch that no count the schedule runs divides is refused before
the first step, naming ``drop_last=True`` or the batch size that works. Checkpoints hold the whole model under the user's
names and plain training's optimizer indices (:mod:`~lightning_accel.pipeline.state_gather`).
Evaluation streams the batch through the stages (:mod:`~lightning_accel.pipeline.evaluation`);
the last rank runs the user's step once on the whole batch and every rank logs what it logged.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.comm.gradients import clip_grad_norm_over, grad_norm_over
from lightning_accel.models.block_policy import BlockPolicy, find_blocks
from lightning_accel.models.router_loss import router_loss_notice
from lightning_accel.models.side_effects import KVCacheSwitch
from lightning_accel.patching import Patch, remove_all, swapped
from lightning_accel.pipeline.deferred_init import has_meta_tensors
from lightning_accel.pipeline.distributed import RankPipeline, stage_indices
from lightning_accel.pipeline.gradients import add_gradients, average_gradients
from lightning_accel.pipeline.mesh import check_ranks_per_pipeline, check_world_size, hold_mesh, mesh_coordinates
from lightning_accel.pipeline.mesh import process_mesh, rank_layout, ranks_per_pipeline
from lightning_accel.pipeline.microbatch import batch_size
from lightning_accel.pipeline.options import PipelineOptions, ReadsPipelineOptions
from lightning_accel.pipeline.placement import RankLayout, check_split
from lightning_accel.pipeline.rank_balance import choose_balance, example_block_times
from lightning_accel.pipeline.rank_split import RankSplit, split_module
from lightning_accel.pipeline.rank_step import eval_step, kept_on_cpu, train_step
from lightning_accel.pipeline.schedule import SCHEDULE_TABLE, check_schedule, stage_rank
from lightning_accel.pipeline.auto_schedule import AutoSchedule
from lightning_accel.pipeline.schedule_tuner import ScheduleTuner
from lightning_accel.pipeline.placeholders import placeholders_equal_nothing
from lightning_accel.pipeline.step_report import broadcast_step_result, metrics_over_replicas, restore_metric_sync
from lightning_accel.strategies.ddp_without_wrapper import DEFAULT_TIMEOUT, DDPWithoutWrapper
from lightning_accel.strategies.gpipe_callbacks import adapt_callbacks, refuse_callbacks
from lightning_accel.strategies.gpipe_configure_model import ConfigureModelReplay
from lightning_accel.strategies.gpipe_split_state import SplitModuleState
from lightning_accel.strategies.options_check import check_options
from lightning_accel.strategies.user_hooks import calls_in, overrides

_LAYOUT = "_gpipe_distributed_layout"  # on a split module: (ranks, placement, balance)


def _to_device(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for every tensor but the freed (meta) ones."""
    module._apply(lambda t: t if t.is_meta else t.to(device))


def _shapes(batch: Any) -> tuple:
    """The shapes of a batch's tensors: the same on every rank (every rank loads the same batch)."""
    found: list[tuple[int, ...]] = []
    apply_to_collection(batch, Tensor, lambda t: found.append(tuple(t.shape)))
    return tuple(found)


class DistributedGPipeStrategy(ReadsPipelineOptions, ConfigureModelReplay, SplitModuleState, DDPWithoutWrapper):
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
        deferred_batch_norm: update BatchNorm running statistics once per batch, from the whole batch's statistics,
            as plain training does (the default, as ``GPipeStrategy``'s: ``num_batches_tracked`` counts batches, and a
            ``momentum=None`` average weighs batches); each micro-batch is still normalized by its own. ``False``: once
            per micro-batch. Recomputation and shape inference never update them.
    """

    strategy_name = "gpipe_distributed"
    _averaging = "each stage's gradients are averaged over the replicas by the strategy itself"
    _needs_automatic = "the pipeline schedule runs forward and backward itself"
    # the last step's result signature (_step_signature), the same on every rank of a pipeline
    _step_signature_cache: tuple | None = None

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
        deferred_batch_norm: bool = True,
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
        self._sync_on_compute: dict[int, tuple[bool, Any]] = {}  # per Metric: what the user set
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
        return self._pp(self.world_size)

    @property
    def data_parallel_size(self) -> int:
        """Pipeline replicas training data parallel (dp)."""
        return self.world_size // self.pipeline_parallel_size

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
        self._mesh = process_mesh(self.root_device.type, self.world_size, self.pipeline_parallel_size, self._timeout)
        hold_mesh(self)

    @property
    def _coords(self) -> tuple[int, int]:
        """This rank's ``(pp_rank, dp_rank)`` on the mesh."""
        return mesh_coordinates(self.global_rank, self.world_size, self.pipeline_parallel_size)

    @property
    def _layout(self) -> RankLayout:
        """This rank on the mesh, as the placement and checkpoint mechanisms take it."""
        return rank_layout(self._mesh, self.global_rank, self.root_device)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # the ranks of one pipeline are the stages of one model: they see the same batch; each replica its own shard
        return {"num_replicas": self.data_parallel_size, "rank": self._coords[1]}

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
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self._whole_at_setup = not has_meta_tensors(trainer.lightning_module)
        self._failed_together, self._constant_sizes = False, set()
        self._split()
        self._unpatch()  # a setup without a teardown between (not Lightning's order): patch once, not twice
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            assert self._split_state is not None
            self._split_state.keep_own_parameters(trainer.lightning_module, self.optimizers, self._layout)
        assert self._split_state is not None
        self._patches = adapt_callbacks(trainer, trainer.lightning_module, self._split_state, self._layout, self.global_rank)
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
            deferred_batch_norm=self.deferred_batch_norm,
            failure_group=None if self.data_parallel_size > 1 else "pipeline",  # every replica stops: none waits in the average
        )
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

    # -- one training step --------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        module, pipe = self.lightning_module, self.pipeline
        assert module is not None and pipe is not None
        batch, rest = (args[0], args[1:]) if args else (kwargs.pop("batch"), ())
        assert self._split_state is not None
        self._split_state.follow_param_groups(self.optimizers, self._layout)  # a group a callback added: this rank's share
        tuner = self._tuner if self._tuner is not None and not self._tuner.done else None
        if tuner is not None:
            tuner.before_step(batch_size(batch))
        start = time.perf_counter()
        try:
            with self.precision_plugin.train_step_context():
                result, self._pending, kept, appended = train_step(
                    pipe, module, lambda mb: module.training_step(mb, *rest, **kwargs), batch, _shapes(batch),
                    self.loss_reduction, getattr(self.precision_plugin, "scaler", None), self._constant_sizes,
                )
        except Exception as err:
            # every rank of the pipeline raises it and reaches teardown: the module is made whole there, as after DDP
            self._failed_together = pipe.failure.settled and self.data_parallel_size == 1
            if not pipe.failure.in_backward:
                raise  # training_step's own error: raised where Lightning's training_step raises it
            # a backward's (detect_anomaly's NaN gradient): raised where plain Lightning raises it, in backward, after
            # on_before_backward; the step's logs are dropped there too (the batch never ends)
            self._backward_error = err
            return torch.zeros((), device=self.root_device)
        choice = tuner.after_step(time.perf_counter() - start) if tuner is not None else None
        if choice is not None:  # the next step runs the choice (its placement is this one's)
            self.schedule, chunks = choice.chosen
            self.options = dataclasses.replace(self.options, chunks=chunks)
            rank_zero_info(f"DistributedGPipeStrategy: {choice.report()}")
        # the last rank has the loss and the logs: every rank returns and logs the same
        layout = self._layout
        (loss, records, as_dict), self._step_signature_cache, appended = broadcast_step_result(
            result, self._step_signature_cache, layout.pp_global(self._last_rank()), layout.pp_group, self.root_device,
            kept_on_cpu(appended),
        )
        kept.settle(appended or {}, self.root_device)  # what the step appended to the module's lists: one item a batch
        for name, value, kw in records:
            module.log(name, value.to(self.root_device) if isinstance(value, Tensor) else value, **kw)
        loss = loss.to(self.root_device)
        return {"loss": loss} if as_dict else loss

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """A training loader: its batches' sizes are checked before the first step (:meth:`_check_batch_sizes`)."""
        dataloader = super().process_dataloader(dataloader)
        module = self.lightning_module
        if module is not None and module._trainer is not None and module.trainer.training:  # evaluation: any size
            self._check_batch_sizes(dataloader)
        return dataloader

    def _check_batch_sizes(self, loader: object) -> None:
        """Every batch trains (none is left out): one ``chunks`` does not divide runs in equal micro-batches of another
        count (fewer when it is smaller; :func:`~lightning_accel.pipeline.schedule.equal_microbatches`). Refused here,
        before the first step, is a batch size (``batch_size``, or the last batch's, from the sampler's length) that no
        count the schedule runs divides; said once is a ``batch_size`` that ``chunks`` does not divide (every step then
        runs fewer micro-batches than asked)."""
        size = getattr(loader, "batch_size", None)
        if not isinstance(size, int):
            return  # a batch sampler of its own: sizes are known only as batches come (RankPipeline.microbatches checks)
        stages = len(stage_indices(0, self.pipeline_parallel_size, self.schedule)) * self.pipeline_parallel_size
        count = self.options.check_batch_size(size, self.schedule, stages)
        sampler = getattr(loader, "sampler", None)
        samples = len(sampler) if sampler is not None and hasattr(sampler, "__len__") else None
        if samples is not None and samples % size and not getattr(loader, "drop_last", False):
            self.options.check_batch_size(samples % size, self.schedule, stages, what="last batch")
        if count != self.chunks:
            rank_zero_warn(
                f"DistributedGPipeStrategy: the training batch_size={size} is not a multiple of chunks={self.chunks}; "
                f"each batch runs as {count} equal micro-batches of {size // count} (torch's stages take one shape per "
                f"step); a batch_size that is a multiple of {self.chunks} pipelines {self.chunks}"
            )

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """The schedule ran backward in ``training_step``: add its gradients now (Lightning has zeroed them)."""
        assert self.lightning_module is not None and self.pipeline is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        if self._backward_error is not None:  # what the schedule's backward raised, on every rank (training_step)
            err, self._backward_error, self._pending = self._backward_error, None, []
            raise err
        add_gradients(self.pipeline.parameters(), self._pending, self.lightning_module.trainer.accumulate_grad_batches)
        self._pending = []
        if self._sync_grads and self.data_parallel_size > 1:  # as DDP: the replicas' mean, once per optimizer step
            assert self.optimizers
            mine = [p for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]]
            average_gradients(mine, self._layout.dp_group)
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """``self.log(..., sync_dist=True)``: over the replicas (a pipeline's ranks log the same value)."""
        if group is None and self._mesh is not None:
            group = self._mesh.get_group("dp")
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def _gather_in_step(self) -> str:
        """Why ``self.all_gather`` in ``training_step`` is refused when micro-batches run it (one line, with the fixes)."""
        schedule = "schedule='auto'" if self._auto is not None else f"schedule={self.schedule!r}"
        return (
            f"{type(self).__name__}(chunks={self.chunks}, {schedule}) runs training_step once per micro-batch on the last "
            "stage's rank: self.all_gather there would gather one micro-batch's values, not the batch's as under DDP; "
            "gather in on_train_batch_end or validation_step, use schedule='gpipe' (training_step once per batch), or "
            "chunks=1"
        )

    def _whole_steps(self) -> bool:
        """Whether ``training_step`` runs once per batch (:mod:`~lightning_accel.pipeline.whole_step`): GPipe, not tuned to
        another schedule during the fit."""
        return self._auto is None and self.schedule == "gpipe"

    @override
    def check_fit(self, module: Any, sync_batchnorm: bool) -> None:
        """Also: ``self.all_gather`` in a ``training_step`` that micro-batches run (read from its source; a call the source
        does not show is refused when it is made, :meth:`all_gather`). Under GPipe the step runs once per batch, and a
        gather there is the replicas' whole batches, as under DDP."""
        super().check_fit(module, sync_batchnorm)
        if self.chunks > 1 and not self._whole_steps() and calls_in(module, "training_step", "all_gather"):
            raise ValueError(self._gather_in_step())

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """``self.all_gather(...)``: over the replicas, each on its own shard, as DDP's ranks are (a pipeline's ranks hold
        one step; its last rank alone reaches the end of the user's step, so a gather over every rank would wait). The
        LightningModule passes ``group.WORLD`` when the user names none: that means the replicas too. Inside a training
        micro-batch of several: refused (:meth:`check_fit` refuses it before the first step where the source shows it)."""
        pipe = self.pipeline
        if pipe is not None and pipe._forwarding and pipe.step_chunks > 1:
            raise ValueError(self._gather_in_step())
        if (group is None or group is dist.group.WORLD) and self._mesh is not None:
            group = self._mesh.get_group("dp")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # every rank's vote (early stopping, checkpointing), not the replicas' that ``reduce`` sums
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = self.reduce(flag, group=dist.group.WORLD if dist.is_initialized() else None, reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag)

    def grad_norm(self, norm_type: float = 2.0) -> Tensor:
        """The whole model's gradient norm, from every stage: what ``lightning.pytorch.utilities.grad_norm(module,
        norm_type)`` reports as its total under DDP (each rank here holds only its own stages' gradients). A collective
        over the pipeline's ranks: call it on every rank, e.g. in ``on_before_optimizer_step``."""
        params = [p for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        split, layout = self._split_state, self._layout
        assert split is not None
        counted = [split.counted_here(p, layout) for p in params]
        return grad_norm_over([p.grad for p in params], counted, float(norm_type), layout.pp_group, self.root_device)

    @override
    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """``torch.nn.utils.clip_grad_norm_`` over every stage: squared norms summed across the pipeline's ranks, what
        is outside the blocks counted once, on a rank that uses it (a tied weight's gradient, summed between its users,
        on the first of them; the replicas hold the same averaged gradients, so summing over them too would count each
        stage ``dp`` times)."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        split, layout = self._split_state, self._layout
        assert split is not None
        counted = [split.counted_here(p, layout) for p in params]  # a tied weight's summed gradient: on one user
        clip_grad_norm_over([p.grad for p in params], counted, float(clip_val), layout.pp_group, self.root_device)

    # -- evaluation ---------------------------------------------------------------------------

    def _eval_step(self, hook: str, args: tuple, kwargs: dict) -> Any:
        """The batch through the stages in micro-batches; the user's ``hook`` on the whole batch at the last stage (its
        logs replayed and its output returned on every rank). Every rank runs ``hook`` up to its stages' ends, its
        logging silenced."""
        module, pipe = self.lightning_module, self.pipeline
        assert module is not None and pipe is not None
        batch, rest = (args[0], args[1:]) if args else (kwargs.pop("batch"), ())
        layout = self._layout
        try:
            return eval_step(
                pipe, module, hook, batch, lambda b: getattr(module, hook)(b, *rest, **kwargs),
                layout.pp_global(self._last_rank()), self.root_device,
            )
        except Exception:
            self._failed_together = pipe.failure.settled and self.data_parallel_size == 1  # every rank raised it
            raise

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.val_step_context():
            return self._eval_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.test_step_context():
            return self._eval_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._eval_step("predict_step", args, kwargs)

    @override
    def on_validation_start(self) -> None:
        self.sync_weights()
        assert self.lightning_module is not None
        dp_group = self._mesh.get_group("dp") if self.data_parallel_size > 1 else None
        metrics_over_replicas(self.lightning_module, dp_group, self.data_parallel_size, self._sync_on_compute)

    on_test_start = on_validation_start  # the same: weights current, metrics synced over the replicas only

    @override
    def on_predict_start(self) -> None:
        self.sync_weights()

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
        if self.pipeline is not None:
            self.pipeline.restore()  # the blocks get their own forwards back (a later fit or validate splits afresh)
        self.pipeline, self._pending = None, []
        self._kv_cache.restore()
        self._step_signature_cache = None  # every rank of the pipeline tears down: the next fit starts afresh
        self._deferred = None
        module = self.lightning_module
        if module is None:
            return super().teardown()
        restore_metric_sync(module, self._sync_on_compute)
        self._sync_on_compute = {}
        _to_device(module, torch.device("cpu"))
        with swapped(module, "cpu", lambda: module):  # Lightning's teardown would copy the meta stages
            super().teardown()
