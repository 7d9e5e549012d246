"""DistributedGPipeStrategy: one pipeline stage per process, launched the way Lightning launches DDP.

Why a class of its own and not ``GPipeStrategy(processes=True)``: Lightning decides how to
launch (its subprocess launcher, or nothing under torchrun), how many processes, which
process-group backend (gloo on CPU, nccl on GPU) and whether to add a
``DistributedSampler`` from the strategy's *class* (a ``ParallelStrategy`` with
``parallel_devices``), exactly as ``"ddp"`` and ``"single_device"`` are different classes.
So this is a :class:`~lightning.pytorch.strategies.DDPStrategy` that never wraps the
model in ``DistributedDataParallel``: ``Trainer(accelerator="cpu", devices=2,
strategy=DistributedGPipeStrategy(chunks=4))``, registered as ``"gpipe_distributed"``.

Data parallel across pipeline replicas (DP x PP): ``pipeline_parallel_size`` ranks make
one pipeline (by default ``len(balance)``, halved for ``interleaved_1f1b``, or every rank);
a world size ``pp * dp`` runs ``dp`` replicas of it on a device mesh of dims ``("pp", "dp")``
(:func:`lightning_accel.pipeline.distributed.pipeline_mesh`; ``pp`` outermost, so the ranks
that all-reduce one stage's gradients are adjacent: one host's fast links). The ranks of one
pipeline see the same batch; each replica its own shard (Lightning's ``DistributedSampler``
with ``num_replicas=dp``, ``rank=dp_rank``). After the pipeline's backward, each rank
averages its stage's gradients over its ``dp`` group, as ``DistributedDataParallel`` averages
over its ranks (not while Lightning accumulates gradients over batches: once, before the
optimizer step), so training matches plain training on the global batch (``dp`` times the
DataLoader's). What is logged with ``sync_dist=True`` is reduced over the replicas, and a
torchmetrics ``Metric`` syncs over them too. A world size that is not a multiple of
``pipeline_parallel_size`` fails when the ``Trainer`` is built.

One training step, for ``S`` ranks in a pipeline (one stage each, two for ``interleaved_1f1b``):

- every rank of the pipeline loads the same batch (the ranks are stages of one model, not
  copies) and runs :class:`lightning_accel.pipeline.RankPipeline`'s
  schedule, which sends activations forward and gradients back between ranks;
- every rank runs the user's ``training_step`` on each micro-batch, and with it the
  model's own forward: the blocks (``blocks=``, found by
  :func:`lightning_accel.models.block_policy.find_blocks`) of its stages compute, the
  other ranks' blocks are receive and send points
  (:mod:`lightning_accel.pipeline.boundaries`), and a rank that does not hold the last
  stage stops after its last block. So a transformers or litgpt model, whose forward
  computes masks, position ids and rotary tables before its blocks and passes them to
  each, runs unchanged; the last rank runs ``training_step`` to its end, so the user's
  loss and logging code is unchanged; a transformers ``config.use_cache`` is turned off
  for training (and back on at teardown);
- the last rank broadcasts the batch loss and what ``training_step`` logged (reduced over
  the micro-batches like the loss) to every rank, and every rank returns that loss and
  logs those values: rank 0 owns the progress bar and the loggers, as Lightning expects,
  and ``ModelCheckpoint(monitor=...)`` sees the same value on every rank.

The schedule runs forward and backward together, inside ``training_step``; Lightning
then zeroes gradients and calls ``backward``. So the step's gradients are set aside
until ``backward``, which adds them (divided by ``accumulate_grad_batches``, as
Lightning's own backward would) and runs the ``on_before_backward`` /
``on_after_backward`` hooks; Lightning's ``optimizer_step`` steps each rank's stage.
Clipping by norm (``gradient_clip_val``) uses the norm over every stage (squared norms
summed across the pipeline's ranks, after the replicas' average), so it clips as plain
training does. Mixed precision with a loss scaler (``16-mixed``, a torch ``GradScaler``): the
last rank's loss function hands the schedule the scaled loss, so every stage's gradients
are scaled; Lightning's precision plugin unscales them once per optimizer step, and before
it decides to step, every rank's found-inf flag is summed over all ranks, so every rank
skips the step (and lowers the scale) when any stage overflowed: one scaler step per
batch, the same on every rank, as plain training takes it.

Memory: each rank keeps only its own stages' blocks. At setup, rank 0 sends every other
rank the starting weights of that rank's blocks (through the first rank of each pipeline,
then over the replicas), then each rank moves the other stages' blocks to the ``meta``
device (names and shapes stay, storage is freed) and the optimizer is given only this
rank's parameters, so gradients and optimizer state are split too. Everything outside the
blocks (embeddings, final norm, head, a LightningModule's own parameters) stays on every
rank: each rank's forward uses part of it (the first stage the embedding, the last the
head), their gradients are summed over the pipeline's ranks, and every rank steps them
alike; tied weights (GPT-2's embedding and head) need nothing more. After ``fit`` the module stays split: on each rank it
holds that rank's stages (``trainer.validate``/``test`` and ``trainer.save_checkpoint``
still work on it); load the checkpoint for the whole model. A network built in
``__init__`` exists whole on every rank before setup (rank 0 sends from it), so it must fit
in one host's memory. One built in ``LightningModule.configure_model`` (Lightning's hook for
large models) is built on the ``meta`` device instead, and at setup each rank materializes
only what it keeps (its stages' blocks and what is outside the blocks) and initializes it
there (:func:`lightning_accel.pipeline.deferred_init.materialize`: each module by the model's
own initializer, under a random generator seeded from global rank 0's
``torch.initial_seed()`` and the module's name), so no rank ever holds the whole model and
nothing is sent. The initial weights then equal ``materialize`` of the whole model in one
process, for any number of ranks and any balance (not the weights plain construction would
draw); a checkpoint given to ``fit`` loads after setup, into each rank's part.
``balance="by_time"`` needs the whole model on rank 0 and is refused there.

Balance: a list (blocks per stage), ``"by_size"`` (parameter and buffer bytes), or
``"by_time"``: forward + backward seconds of each block, split as ``GPipeStrategy`` splits
them (:func:`lightning_accel.pipeline.partition.balance_by_cost`). The split happens in
``setup``, before the first batch (the optimizer is built for this rank's parameters right
after), so the sample is Lightning's standard one, the LightningModule's
``example_input_array``, run through its ``forward`` as ``ModelSummary`` runs it (converted
by the precision plugin, under training's autocast); not set: an error saying to set it or
pass a list. (The first training batch, which ``GPipeStrategy`` uses, is not loaded yet at
setup, and drawing it early would move a shuffling sampler's RNG.) Global rank 0 alone
measures, and broadcasts the times, so every rank of every replica splits the same. Where:
the forward runs on the CPU, where the model is at setup, only to capture each block's
input; each block is then moved alone to rank 0's device with its input and timed there
(best of 5 rounds), since the stages will run on that device and relative block costs differ
between a CPU and a GPU, while the whole model need not fit on one device. Lightning's
model summary also runs ``example_input_array``, through the whole module, on every rank
at fit start, which would fail on a split module (the other ranks' stages are on ``meta``):
the strategy makes the Trainer's summary callbacks leave it out (no in/out sizes).

Batches: a batch of another shape (a smaller last batch) gets a schedule of its own;
one whose size is not a multiple of ``chunks`` is left out of the training loader, with
one warning, as ``drop_last=True`` would (equal micro-batches are what make the loss match
plain training; Lightning refuses a step skipped by ``training_step`` under more than one
process); a loader whose ``batch_size`` is not a multiple of ``chunks`` is refused at the
start of training, since every batch would be left out.
The user's ``training_step`` runs once per micro-batch: torch's shape inference, which
would run the loss on micro-batch 0 again, gets a stand-in loss.

Checkpoints: rank 0 gathers every stage's parameters and buffers under the user's names
(loadable into a plain model) from its own pipeline's ranks (the replicas hold the same),
and every rank's optimizer state under the indices plain training would use; loading hands
each rank its own part, in every replica.

Evaluation (validation, test, predict) streams the batch through the stages in up to
``chunks`` micro-batches (any batch size: fewer micro-batches when it is smaller; see
:meth:`lightning_accel.pipeline.RankPipeline.evaluate`), so the ranks compute at once and
a stage holds one micro-batch's activations. Every rank runs the user's step on each
micro-batch up to its stages' end (its logging silenced); the last rank runs it once on
the whole batch, its first block taking the concatenated activations, and broadcasts
what it logged (a torchmetrics ``Metric``: its state, so every rank holds the same metric
and computes it without syncing) and, for predict, what the step returned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics import Metric
from typing_extensions import override

from lightning_accel.models.block_policy import Block, BlockPolicy, find_blocks
from lightning_accel.models.side_effects import CacheSettings, disable_kv_cache
from lightning_accel.pipeline.distributed import RankPipeline, stage_indices
from lightning_accel.pipeline.gradients import agree_found_inf, average_gradients, clip_grad_norm_over
from lightning_accel.pipeline.mesh import hold_mesh, mesh_coordinates, process_mesh
from lightning_accel.pipeline.metric_state import load_metric_state, loggable, metric_state
from lightning_accel.pipeline.microbatch import DropRagged, batch_size, scatter
from lightning_accel.pipeline.partition import (
    balance_by_cost,
    block_bytes,
    check_balance,
    profile_block_times,
    stage_of_block,
)
from lightning_accel.pipeline.reduction import reduce_outputs
from lightning_accel.pipeline.deferred_init import has_meta_tensors, materialize
from lightning_accel.pipeline.checkpoint import gather_model_state, gather_optimizer_state, local_optimizer_state
from lightning_accel.pipeline.options import PipelineOptions
from lightning_accel.pipeline.placement import RankLayout, broadcast_shared, keep_own_parameters, send_initial_weights
from lightning_accel.pipeline.schedule import SCHEDULE_TABLE, check_schedule
from lightning_accel.pipeline.step_result import StepResult, broadcast_step_result, reduce_logs

_LAYOUT = "_gpipe_distributed_layout"  # on a split module: (ranks, interleaved, balance)


def _to_device(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for every tensor but the freed (meta) ones."""
    module._apply(lambda t: t if t.is_meta else t.to(device))


def _example_forward(module: pl.LightningModule, example: Any) -> Callable[[], object]:
    """``module(example_input_array)`` as Lightning runs it (ModelSummary, ``to_onnx``): a tuple or dict unpacked."""
    if isinstance(example, (list, tuple)):
        return lambda: module(*example)
    if isinstance(example, Mapping):
        return lambda: module(**example)
    return lambda: module(example)


def _summaries_without_example(trainer: pl.Trainer) -> None:
    """Lightning's model summary, at fit start on every rank, runs ``example_input_array`` through the whole module to
    show layer sizes; on a split module the other ranks' stages are on ``meta`` and that forward fails. The summary
    callbacks of this Trainer summarize without it (names, types and parameter counts stay; no in/out sizes)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if not isinstance(callback, ModelSummary) or "_summary" in callback.__dict__:
            continue
        summary = callback._summary

        def without_example(trainer: pl.Trainer, module: pl.LightningModule, summary: Callable[..., Any] = summary) -> Any:
            example, module.example_input_array = module.example_input_array, None
            try:
                return summary(trainer, module)
            finally:
                module.example_input_array = example

        callback._summary = without_example  # type: ignore[method-assign]


@contextmanager
def _patched(obj: nn.Module, name: str, fn: Callable[..., Any]) -> Iterator[None]:
    """Shadow ``obj.name`` with ``fn`` (an instance attribute) for the duration of the block."""
    missing = object()
    own = obj.__dict__.get(name, missing)  # an instance attribute the user set themselves comes back
    object.__setattr__(obj, name, fn)
    try:
        yield
    finally:
        if own is missing:
            object.__delattr__(obj, name)
        else:
            object.__setattr__(obj, name, own)


def _shapes(batch: Any) -> tuple:
    """The shapes of a batch's tensors: the same on every rank (every rank loads the same batch)."""
    found: list[tuple[int, ...]] = []
    apply_to_collection(batch, Tensor, lambda t: found.append(tuple(t.shape)))
    return tuple(found)


class DistributedGPipeStrategy(DDPStrategy):
    """Pipeline parallelism over processes: the model's blocks in one stage per rank, batches in ``chunks`` micro-batches.

    Args:
        chunks: micro-batches per batch (M). A training loader's batch_size must be a multiple of it (refused at the
            start of training otherwise); a smaller last batch that is not is skipped with a warning, as
            ``drop_last=True`` would.
        schedule: ``"gpipe"`` (all forwards, then all backwards), ``"1f1b"`` (fewer
            activations alive) or ``"interleaved_1f1b"`` (two stages per rank, smaller bubble;
            needs ``chunks`` >= stages).
        balance: blocks per stage (one entry per rank, two per rank for
            ``interleaved_1f1b``), ``"by_size"`` (parameter and buffer bytes) or ``"by_time"``
            (forward + backward seconds of each block on the LightningModule's
            ``example_input_array``, measured once on rank 0; see the module docstring).
        blocks: which submodules are the blocks that stages split at: a policy for
            :func:`lightning_accel.models.block_policy.find_blocks` (``"auto"``, block classes
            or a callable), as for ``GPipeStrategy`` and ``L2LOffloadStrategy``.
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
            rank with an error naming it, never a hang).
        start_method: as for ``DDPStrategy``: ``"popen"`` re-runs your script per rank.
        deferred_init: a network built in ``configure_model`` is built on the ``meta`` device and each rank
            materializes only its part (see the module docstring); ``False`` builds it whole on every rank, as one
            built in ``__init__`` is (for a module that cannot be initialized again after building).
    """

    strategy_name = "gpipe_distributed"
    # the last step's result signature (_step_signature), the same on every rank of a pipeline
    _step_signature_cache: tuple | None = None

    def __init__(
        self,
        chunks: int = 1,
        schedule: str = "gpipe",
        balance: Sequence[int] | str = "by_size",
        loss_reduction: str = "mean",
        checkpoint: str = "never",
        pipeline_parallel_size: int | None = None,
        timeout: timedelta | float = timedelta(minutes=30),
        start_method: str = "popen",
        blocks: BlockPolicy = "auto",
        deferred_init: bool = True,
        **kwargs: Any,
    ) -> None:
        self.options = PipelineOptions(chunks, balance, checkpoint, loss_reduction)  # validated once, shared with GPipeStrategy
        if schedule not in SCHEDULE_TABLE:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULE_TABLE)}, got {schedule!r}; '1f1b' keeps the fewest activations alive")
        if pipeline_parallel_size is not None and (
            not isinstance(pipeline_parallel_size, int) or isinstance(pipeline_parallel_size, bool) or pipeline_parallel_size < 1
        ):
            raise ValueError(f"pipeline_parallel_size must be a positive int (ranks per pipeline), got {pipeline_parallel_size!r}")
        per_rank = SCHEDULE_TABLE[schedule].stages_per_rank
        if pipeline_parallel_size is not None and not isinstance(balance, str) and len(balance) != per_rank * pipeline_parallel_size:
            raise ValueError(
                f"balance {list(balance)} has {len(balance)} stages but pipeline_parallel_size={pipeline_parallel_size} "
                f"ranks run {per_rank * pipeline_parallel_size} with schedule {schedule!r}; HINT: drop one of the two"
            )
        if not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        super().__init__(timeout=timeout, start_method=start_method, **kwargs)  # type: ignore[arg-type]
        self.chunks, self.schedule, self.loss_reduction, self.checkpoint = chunks, schedule, loss_reduction, checkpoint
        self.balance = balance if isinstance(balance, str) else list(balance)
        self._pp_size = pipeline_parallel_size
        self.blocks = blocks
        self.deferred_init = deferred_init
        self._deferred: bool | None = None  # this run's module was built on meta (decided once per run)
        self._resident_ids: set[int] = set()  # parameters outside the blocks: on every rank of the pipeline
        self._cache_settings: CacheSettings | None = None
        self._mesh: Any = None  # the ("pp", "dp") DeviceMesh, built once the process group is up
        self._sync_grads = True  # False while Lightning accumulates gradients (block_backward_sync)
        self.pipeline: RankPipeline | None = None
        self._owners: list[int] = []  # per entry of _tensors(): the rank whose stage trains it
        self._shared: list[bool] = []  # per entry of _tensors(): outside the stages, so on every rank
        # per optimizer: the whole model's optimizer's param indices per group, and this rank's among them
        self._opt_index: list[tuple[list[list[int]], list[int]]] = []
        self._warned_ragged = False
        self._sync_on_compute: dict[int, tuple[bool, Any]] = {}  # per Metric: what the user set
        self._pending: list[Tensor | None] = []  # this step's gradients, until Lightning's backward
        self._block_times: list[float] | None = None  # balance="by_time": seconds per block, as rank 0 measured

    # -- placement ----------------------------------------------------------------------------

    def _pp(self, world_size: int) -> int:
        if self._pp_size is not None:
            return self._pp_size
        per_rank = SCHEDULE_TABLE[self.schedule].stages_per_rank
        if not isinstance(self.balance, str) and len(self.balance) % per_rank == 0:
            return len(self.balance) // per_rank
        return world_size

    @property
    def pipeline_parallel_size(self) -> int:
        """Ranks per pipeline (pp)."""
        return self._pp(self.world_size)

    @property
    def data_parallel_size(self) -> int:
        """Pipeline replicas training data parallel (dp)."""
        return self.world_size // self.pipeline_parallel_size

    def _check_world_size(self, world_size: int) -> None:
        pp = self._pp(world_size)
        if world_size % pp:
            given = "given" if self._pp_size is not None else f"from len(balance)={len(self.balance)}"
            raise ValueError(
                f"DistributedGPipeStrategy: world size {world_size} is not a multiple of pipeline_parallel_size={pp} "
                f"(ranks per pipeline, {given}); HINT: run a multiple of {pp} processes (devices x num_nodes), or set "
                f"pipeline_parallel_size (and balance) to a divisor of {world_size}"
            )

    @override
    def _configure_launcher(self) -> None:
        if self.num_processes:  # the Trainer is being built: fail before any process starts
            self._check_world_size(self.num_nodes * self.num_processes)
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        self._check_world_size(self.num_nodes * self.num_processes)  # torchrun: before the process group
        super().setup_distributed()
        self._mesh = process_mesh(self.root_device.type, self.world_size, self.pipeline_parallel_size, self._timeout)
        hold_mesh(self)

    @property
    def _coords(self) -> tuple[int, int]:
        """This rank's ``(pp_rank, dp_rank)`` on the mesh."""
        return mesh_coordinates(self.global_rank, self.world_size, self.pipeline_parallel_size)

    def _pp_global(self, pp_rank: int) -> int:
        """The global rank of ``pp_rank`` in this rank's pipeline."""
        return pp_rank * self.data_parallel_size + self._coords[1]

    @property
    def _pp_group(self) -> Any:
        return self._mesh.get_group("pp")

    @property
    def _dp_group(self) -> Any:
        return self._mesh.get_group("dp")

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

    def _tensors(self) -> list[Tensor]:
        """Every parameter and buffer of the LightningModule, in one order all ranks share."""
        assert self.lightning_module is not None
        return [*self.lightning_module.parameters(), *self.lightning_module.buffers()]

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # DDPStrategy.setup would move the whole model to the device and broadcast all of it;
        # here each rank only ever places its own stages there
        module = trainer.lightning_module
        if trainer.state.fn == TrainerFn.FITTING:
            if not module.automatic_optimization:
                raise ValueError(
                    "DistributedGPipeStrategy needs automatic optimization: the pipeline schedule runs forward and "
                    "backward itself. HINT: remove `self.automatic_optimization = False`"
                )
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise ValueError(
                f"DistributedGPipeStrategy needs torch's GradScaler to agree on overflows across ranks, got "
                f"{type(scaler).__name__}. HINT: MixedPrecision('16-mixed', device, scaler=torch.amp.GradScaler(device))"
            )
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self._split()
        _summaries_without_example(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._keep_own_parameters()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        # clipping by norm needs the norm of the whole model's gradient, not of this rank's stage
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        if scaler is not None:  # between the plugin's unscale_ and its scaler.step: one verdict for every rank
            after_closure = type(self.precision_plugin)._after_closure.__get__(self.precision_plugin)

            def agreed(model: pl.LightningModule, optimizer: Optimizer) -> None:
                self._agree_found_inf(scaler, optimizer)
                after_closure(model, optimizer)

            self.precision_plugin._after_closure = agreed  # type: ignore[method-assign]

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``configure_model`` builds on the ``meta`` device; setup materializes this rank's part."""
        if not self.deferred_init or empty_init is False:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """A module built on ``meta`` has nowhere to load weights into until setup has materialized this rank's part."""
        if self._deferred is None:
            module = self.lightning_module
            self._deferred = module is not None and getattr(module, _LAYOUT, None) is None and has_meta_tensors(module)
        return self._deferred

    @override
    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        _to_device(self.lightning_module, self.root_device)  # the meta stages (other ranks') stay meta

    def _balance(self, blocks: list[Block], stages: int) -> list[int]:
        if not isinstance(self.balance, str):
            return list(self.balance)
        if stages > len(blocks):
            raise ValueError(
                f"{self.pipeline_parallel_size} ranks per pipeline run {stages} stages but {type(self._net()).__name__} has "
                f"{len(blocks)} blocks; use at most {len(blocks)} stages (trainer devices)"
            )
        modules = [b.module for b in blocks]
        if self.balance == "by_time" and stages > 1 and has_meta_tensors(self._net()):
            raise ValueError(
                f"balance='by_time' times every block of {type(self._net()).__name__} on rank 0, but a network built in "
                "configure_model is only materialized in part on each rank. HINT: balance='by_size' or a list (blocks "
                "per stage), or DistributedGPipeStrategy(deferred_init=False) to build it whole on every rank"
            )
        if self.balance == "by_size" or stages == 1:  # by_time with one stage: nothing to measure
            return balance_by_cost(block_bytes(modules), stages)
        self._block_times = self._agreed_block_times(modules)
        balance = balance_by_cost(self._block_times, stages)
        rank_zero_info(
            f"DistributedGPipeStrategy: balance='by_time' {balance}: " + ", ".join(f"{t * 1e3:.2f}" for t in self._block_times)
            + f" ms per block, forward + backward on example_input_array on {self.root_device} of rank 0"
        )
        return balance

    def _agreed_block_times(self, blocks: list[nn.Module]) -> list[float]:
        """Global rank 0 times the blocks (:func:`profile_block_times` on its device); every rank gets its list, so every
        rank of every replica splits the same. A failure there is raised on every rank, not left to the timeout."""
        module = self.lightning_module
        assert module is not None
        example = module.example_input_array
        if example is None:  # the same on every rank: raised before any rank waits for another
            raise ValueError(
                f"balance='by_time' times each block before the first batch, on {type(module).__name__}."
                "example_input_array, which is None. HINT: set self.example_input_array to one batch's input to "
                "forward in __init__, or pass balance as a list (blocks per stage) or 'by_size'"
            )
        payload: list[Any] = [None, None]  # times, or the error rank 0 hit
        failure: Exception | None = None
        if self.global_rank == 0:
            try:
                with self.precision_plugin.train_step_context():  # autocast as in training: training's times
                    forward = _example_forward(module, self.precision_plugin.convert_input(example))
                    payload[0] = profile_block_times(self._net(), blocks, forward, device=self.root_device)
            except Exception as err:  # noqa: BLE001  # raised below, once every rank knows
                failure, payload[1] = err, f"{type(err).__name__}: {err}"
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)
        if failure is not None:
            raise failure
        if payload[1] is not None:
            raise RuntimeError(f"balance='by_time': timing the blocks failed on rank 0 ({payload[1]}); its log has the traceback")
        return payload[0]

    def _split(self) -> None:
        """Build this rank's stages; on first use give them rank 0's weights and free the other ranks' blocks."""
        module, net = self.lightning_module, self._net()
        assert module is not None
        blocks = find_blocks(net, self.blocks)
        ranks = self.pipeline_parallel_size
        stages = len(stage_indices(0, ranks, self.schedule)) * ranks
        check_schedule(self.schedule, self.chunks, stages)
        layout = getattr(module, _LAYOUT, None)  # set when an earlier fit split this module
        balance = self._balance(blocks, stages) if layout is None else list(layout[2])
        if layout is not None and layout != (ranks, SCHEDULE_TABLE[self.schedule].stages_per_rank > 1, tuple(balance)):
            raise ValueError(
                f"this module was split for {layout[0]} ranks with balance {list(layout[2])} by an earlier run; it "
                f"cannot be split again for {ranks} ranks and schedule {self.schedule!r}. HINT: build a fresh model "
                "and load the checkpoint into it"
            )
        if not isinstance(self.balance, str) and layout is not None and list(self.balance) != balance:
            raise ValueError(f"balance {self.balance} differs from {balance}, the split of this module by an earlier run")
        if len(balance) != stages:  # before any weights move
            raise ValueError(
                f"schedule {self.schedule!r} on {ranks} ranks runs {stages} stages but balance has {len(balance)} "
                f"({balance}); give {stages} entries"
            )
        check_balance(balance, len(blocks), stages)
        self._cache_settings = disable_kv_cache(net)
        if self._cache_settings:
            rank_zero_info(
                f"DistributedGPipeStrategy: set {', '.join(self._cache_settings)} = False for training (each micro-batch "
                "and stage would write the KV cache again)"
            )
        # each block's parameters and buffers belong to the rank of its stage; everything outside the blocks
        # (embeddings, norms, heads, the LightningModule's own tensors) is on every rank, trained alike there
        stage_of: dict[int, int] = {}
        for k, s in enumerate(stage_of_block(balance)):
            for t in [*blocks[k].module.parameters(), *blocks[k].module.buffers()]:
                stage_of.setdefault(id(t), s)
        tensors = self._tensors()
        self._owners = [stage_of.get(id(t), len(balance) - 1) % ranks for t in tensors]  # pp ranks
        self._shared = [id(t) not in stage_of for t in tensors]  # resident on every rank
        if layout is None and has_meta_tensors(module):  # built in configure_model: each rank initializes its part
            pp_rank = self._coords[0]
            mine = {id(t) for t, o, sh in zip(tensors, self._owners, self._shared) if sh or o == pp_rank}
            materialize(module, self._init_seed(), keep=lambda t: id(t) in mine)
        elif layout is None:
            send_initial_weights(tensors, self._owners, self._shared, self._layout)
        # the other ranks' blocks go to the meta device there (names, shapes and dtypes stay for checkpoints)
        self.pipeline = RankPipeline(
            module, balance, self.chunks, schedule=self.schedule, device=self.root_device, group=self._pp_group,
            scale_grads=self.loss_reduction == "mean", checkpoint=self.checkpoint,
            blocks=[Block(f"{b.name}", b.module) for b in blocks],
        )
        self._resident_ids = {id(p) for p in self.pipeline.resident}
        if layout is None:
            object.__setattr__(module, _LAYOUT, (ranks, SCHEDULE_TABLE[self.schedule].stages_per_rank > 1, tuple(balance)))
        self.model_to_device()

    def _init_seed(self) -> int:
        """Global rank 0's ``torch.initial_seed()`` (what ``seed_everything`` set), the same on every rank."""
        seed = [torch.initial_seed()]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(seed, src=0)
        return int(seed[0])

    @property
    def _layout(self) -> RankLayout:
        """This rank on the mesh, as the placement and checkpoint mechanisms take it."""
        pp_rank, dp_rank = self._coords
        return RankLayout(
            pp_rank, dp_rank, self.pipeline_parallel_size, self.data_parallel_size, self._pp_group, self._dp_group,
            self.root_device,
        )

    def _keep_own_parameters(self) -> None:
        """Give each optimizer only this rank's parameters; remember their indices in the whole model's optimizer."""
        assert self.lightning_module is not None
        owner = {id(t): (o, sh) for t, o, sh in zip(self._tensors(), self._owners, self._shared)}
        default = (self.pipeline_parallel_size - 1, True)
        self._opt_index = [keep_own_parameters(o, owner, self._coords[0], default) for o in self.optimizers]

    def sync_weights(self) -> None:
        """Give every rank the current values of what lives outside the stages (all ranks must call this)."""
        if self._owners and dist.is_initialized():  # also after fit: trainer.save_checkpoint(...)
            broadcast_shared(self._tensors(), self._owners, self._shared, self._layout)

    # -- one training step --------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        module, pipe = self.lightning_module, self.pipeline
        assert module is not None and pipe is not None
        batch, rest = (args[0], args[1:]) if args else (kwargs.pop("batch"), ())
        size = batch_size(batch)
        if size % self.chunks:  # every rank sees the same batch, so every rank skips it
            self._warn_ragged(size)
            if self.world_size > 1:  # Lightning refuses a skipped step there; the loaders we wrap never get here
                raise ValueError(
                    f"DistributedGPipeStrategy got a batch of {size}, not a multiple of chunks={self.chunks}, from a "
                    "training loader it did not wrap (reloaded?). HINT: drop_last=True and a batch_size that is a "
                    f"multiple of {self.chunks}"
                )
            return None
        micro = scatter(batch, self.chunks)
        sizes = [batch_size(mb) for mb in micro]
        outputs: list[Any] = [None] * self.chunks
        logs: list[list[tuple[str, Any, dict]]] = [[] for _ in range(self.chunks)]
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            scaler.scale(torch.zeros((), device=self.root_device))  # ranks without the loss need the scale too

        def forward(i: int) -> Tensor:
            """The user's ``training_step`` on micro-batch ``i``: every rank runs it, up to its stage's end."""
            logs[i] = []  # should torch run a micro-batch's loss twice, keep the last

            def log(name: str, value: Any, *a: Any, **kw: Any) -> None:
                logs[i].append((name, loggable(value), kw))

            with _patched(module, "log", log):
                out = module.training_step(micro[i], *rest, **kwargs)
            if out is None:
                raise ValueError("training_step returned None (skip the batch), but the pipeline has already run it")
            outputs[i] = out
            loss = out["loss"] if isinstance(out, Mapping) else out
            return scaler.scale(loss) if scaler is not None else loss  # the schedule's backward: scaled gradients

        params = pipe.parameters()
        earlier = [p.grad for p in params]  # accumulated batches: the schedule must not rescale them
        for p in params:
            p.grad = None
        with self.precision_plugin.train_step_context():
            pipe.train_step(forward, shape=_shapes(batch))  # a smaller last batch gets a schedule of its own
        self._pending = [p.grad for p in params]
        for p, g in zip(params, earlier):
            p.grad = g
        # the last rank has the loss and the logs: every rank returns and logs the same
        result: StepResult | None = None
        if pipe.holds_last:
            reduced = reduce_outputs(outputs, sizes, self.loss_reduction)
            loss = reduced["loss"] if isinstance(reduced, Mapping) else reduced
            result = (loss.detach().cpu(), reduce_logs(logs, sizes, self.loss_reduction), isinstance(reduced, Mapping))
        (loss, records, as_dict), self._step_signature_cache = broadcast_step_result(
            result, self._step_signature_cache, self._pp_global(self.pipeline_parallel_size - 1), self._pp_group,
            self.root_device,
        )
        for name, value, kw in records:
            module.log(name, value.to(self.root_device) if isinstance(value, Tensor) else value, **kw)
        loss = loss.to(self.root_device)
        return {"loss": loss} if as_dict else loss

    def _warn_ragged(self, size: int) -> None:
        if not self._warned_ragged:
            rank_zero_warn(
                f"DistributedGPipeStrategy skips batches whose size is not a multiple of chunks={self.chunks} "
                f"(got {size}; micro-batches must be equal for the loss to match plain training), as drop_last=True "
                "would. HINT: a DataLoader batch_size that is a multiple of chunks, or drop_last=True"
            )
            self._warned_ragged = True

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """A training loader: refuse a batch_size that is not a multiple of ``chunks`` (every batch would be skipped), and
        leave out a smaller last batch that is not one (as ``drop_last=True``), before the first step; Lightning refuses
        a step skipped by ``training_step`` in distributed training."""
        dataloader = super().process_dataloader(dataloader)
        module = self.lightning_module
        if module is None or module._trainer is None or not module.trainer.training:  # evaluation: any batch size
            return dataloader
        size = getattr(dataloader, "batch_size", None)
        if isinstance(size, int):
            self.options.check_batch_size(size)
        return DropRagged(dataloader, self.chunks, self._warn_ragged)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """The schedule ran backward in ``training_step``: add its gradients now (Lightning has zeroed them)."""
        assert self.lightning_module is not None and self.pipeline is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        scale = self.lightning_module.trainer.accumulate_grad_batches
        for p, g in zip(self.pipeline.parameters(), self._pending):
            if g is None:
                continue
            g = g / scale if scale != 1 else g
            p.grad = g if p.grad is None else p.grad + g
        self._pending = []
        if self._sync_grads and self.data_parallel_size > 1:  # as DDP: the replicas' mean, once per optimizer step
            assert self.optimizers
            mine = [p for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]]
            average_gradients(mine, self._dp_group)
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning accumulates gradients over batches: the replicas average them only at the last one."""
        self._sync_grads = False
        try:
            yield
        finally:
            self._sync_grads = True

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """``self.log(..., sync_dist=True)``: over the replicas (a pipeline's ranks log the same value)."""
        if group is None and self._mesh is not None:
            group = self._dp_group
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # every rank's vote (early stopping, checkpointing), not the replicas' that ``reduce`` sums
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = self.reduce(flag, group=dist.group.WORLD if dist.is_initialized() else None, reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag)

    def _agree_found_inf(self, scaler: torch.amp.GradScaler, optimizer: Optimizer) -> None:
        """After ``scaler.unscale_(optimizer)``: this rank's found-inf flags become 1 if any rank's stage overflowed."""
        agree_found_inf(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"], self.root_device)

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """``torch.nn.utils.clip_grad_norm_`` over every stage: squared norms summed across the pipeline's ranks, what
        every rank holds alike (outside the blocks) counted on the last one (the replicas hold the same averaged
        gradients, so summing over them too would count each stage ``dp`` times)."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        last = self._coords[0] == self.pipeline_parallel_size - 1
        counted = [last or id(p) not in self._resident_ids for p in params]
        clip_grad_norm_over([p.grad for p in params], counted, float(clip_val), self._pp_group, self.root_device)

    # -- evaluation ---------------------------------------------------------------------------

    def _eval_step(self, hook: str, args: tuple, kwargs: dict, return_output: bool = False) -> Any:
        """The batch through the stages in micro-batches; the user's ``hook`` on the whole batch at the last stage (its
        logs replayed on every rank). Every rank runs ``hook`` up to its stages' ends, its logging silenced."""
        module, pipe = self.lightning_module, self.pipeline
        assert module is not None and pipe is not None
        batch, rest = (args[0], args[1:]) if args else (kwargs.pop("batch"), ())
        size = batch_size(batch)
        parts = scatter(batch, pipe.eval_chunks(size))
        payload: list[Any] = [[], None]
        paths = {id(m): n for n, m in module.named_modules()}
        records, real_log = payload[0], module.log

        def log(name: str, value: Any, *a: Any, **kw: Any) -> None:
            real_log(name, value, *a, **kw)
            if isinstance(value, Metric):
                if id(value) not in paths:
                    raise ValueError(
                        f"{hook} logged {name!r}, a Metric that is not a submodule of the LightningModule; the "
                        "pipeline's other ranks cannot log the same one. HINT: assign it as an attribute in __init__"
                    )
                records.append((name, ("metric", paths[id(value)], metric_state(value)), a, kw))
            else:
                records.append((name, loggable(value), a, kw))

        def run(i: int | None) -> Any:
            # i None: the whole batch on the last stage, where the step's logging counts
            with _patched(module, "log", log if i is None else lambda *_, **__: None):
                return getattr(module, hook)(batch if i is None else parts[i], *rest, **kwargs)

        out = pipe.evaluate(size, run)
        if pipe.holds_last and return_output:
            payload[1] = apply_to_collection(out, Tensor, lambda t: t.detach().cpu())
        dist.broadcast_object_list(payload, src=self._pp_global(self.pipeline_parallel_size - 1), group=self._pp_group)
        if pipe.holds_last:
            return out
        for name, value, a, kw in payload[0]:
            if isinstance(value, tuple) and value[:1] == ("metric",):
                metric = module.get_submodule(value[1])
                load_metric_state(metric, value[2], self.root_device)  # type: ignore[arg-type]
                value = metric
            elif isinstance(value, Tensor):
                value = value.to(self.root_device)
            module.log(name, value, *a, **kw)
        return payload[1]

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
            return self._eval_step("predict_step", args, kwargs, return_output=True)

    def _metrics_local(self) -> None:
        """A pipeline's ranks hold the same metric state (broadcast per step): sync it over the replicas only."""
        assert self.lightning_module is not None
        for m in self.lightning_module.modules():
            if isinstance(m, Metric):
                self._sync_on_compute.setdefault(id(m), (m.sync_on_compute, m.process_group))
                if self.data_parallel_size == 1:
                    m.sync_on_compute = False
                else:
                    m.process_group = self._dp_group

    @override
    def on_validation_start(self) -> None:
        self.sync_weights()
        self._metrics_local()

    @override
    def on_test_start(self) -> None:
        self.sync_weights()
        self._metrics_local()

    @override
    def on_predict_start(self) -> None:
        self.sync_weights()

    # -- checkpoints --------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Every stage's tensors under the user's names, gathered on rank 0 from its pipeline (other ranks get their own part)."""
        assert self.lightning_module is not None
        self.sync_weights()
        state = self.lightning_module.state_dict()
        if not self._owners or not dist.is_initialized():
            return state
        return gather_model_state(state, self._layout, self.global_rank)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        freed = {n for n, t in module.state_dict().items() if t.is_meta}
        if not freed:
            return super().load_model_state_dict(checkpoint, strict=strict)
        state = {n: t for n, t in checkpoint["state_dict"].items() if n not in freed}
        result = module.load_state_dict(state, strict=False)
        missing = [n for n in result.missing_keys if n not in freed]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"the checkpoint does not match this rank's part of the model: missing {missing[:5]}, unexpected "
                f"{result.unexpected_keys[:5]}. HINT: load_model_state_dict(..., strict=False) to ignore them"
            )
        return None

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole model's optimizer state: each rank's part under the indices plain training would give it."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        state = optimizer.state_dict()
        index = next((i for i, o in enumerate(self.optimizers) if o is optimizer), None)
        if index is None or index >= len(self._opt_index) or not dist.is_initialized():
            return state
        full, kept = self._opt_index[index]
        return gather_optimizer_state(state, full, kept, self._layout)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each rank takes its own parameters' state from the whole model's optimizer state."""
        for index, (optimizer, whole) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"])):
            if index >= len(self._opt_index):
                optimizer.load_state_dict(whole)
                continue
            full, kept = self._opt_index[index]
            optimizer.load_state_dict(local_optimizer_state(whole, full, kept))
            _optimizers_to_device([optimizer], self.root_device)

    @override
    def on_train_end(self) -> None:
        self.sync_weights()  # after fit, each rank holds its stages and current values of everything else

    @override
    def teardown(self) -> None:
        # _owners and _opt_index stay: trainer.save_checkpoint after fit still gathers the stages, as does the mesh
        # (one per process, see pipeline.mesh.process_mesh: nothing to destroy here)
        self.pipeline, self._pending = None, []
        if self._cache_settings is not None:
            self._cache_settings.restore()
            self._cache_settings = None
        self._step_signature_cache = None  # every rank of the pipeline tears down: the next fit starts afresh
        self._deferred = None
        module = self.lightning_module
        if module is not None:
            for m in module.modules():
                if isinstance(m, Metric) and id(m) in self._sync_on_compute:
                    m.sync_on_compute, m.process_group = self._sync_on_compute[id(m)]
            self._sync_on_compute = {}
            _to_device(module, torch.device("cpu"))
            with _patched(module, "cpu", lambda: module):  # Lightning's teardown would copy the meta stages
                super().teardown()
        else:
            super().teardown()
