"""DistributedGPipeStrategy: one pipeline stage per process, launched the way Lightning launches DDP.

Why a class of its own and not ``GPipeStrategy(processes=True)``: Lightning decides how to
launch (its subprocess launcher, or nothing under torchrun), how many processes, which
process-group backend (gloo on CPU, nccl on GPU) and whether to add a
``DistributedSampler`` from the strategy's *class* (a ``ParallelStrategy`` with
``parallel_devices``), exactly as ``"ddp"`` and ``"single_device"`` are different classes.
So this is a :class:`~lightning.pytorch.strategies.DDPStrategy` that never wraps the
model in ``DistributedDataParallel``: ``Trainer(accelerator="cpu", devices=2,
strategy=DistributedGPipeStrategy(chunks=4))``, registered as ``"gpipe_distributed"``.

One training step, for ``S`` ranks (one stage each, two for ``interleaved_1f1b``):

- every rank loads the same batch (the sampler has one replica: the ranks are stages of
  one model, not copies) and runs :class:`lightning_accel.pipeline.RankPipeline`'s
  schedule, which sends activations forward and gradients back between ranks;
- the first rank feeds its stage what the user's ``training_step`` passes to the network
  (it runs ``training_step`` until the network is called, and stops there);
- the last rank runs the user's ``training_step`` once per micro-batch as the schedule's
  loss function, with the network returning the last stage's output for that
  micro-batch, so the user's loss and logging code is unchanged;
- the last rank broadcasts the batch loss and what ``training_step`` logged (reduced over
  the micro-batches like the loss) to every rank, and every rank returns that loss and
  logs those values: rank 0 owns the progress bar and the loggers, as Lightning expects,
  and ``ModelCheckpoint(monitor=...)`` sees the same value on every rank.

The schedule runs forward and backward together, inside ``training_step``; Lightning
then zeroes gradients and calls ``backward``. So the step's gradients are set aside
until ``backward``, which adds them (divided by ``accumulate_grad_batches``, as
Lightning's own backward would) and runs the ``on_before_backward`` /
``on_after_backward`` hooks; Lightning's ``optimizer_step`` steps each rank's stage.
Every rank holds the whole LightningModule; only its stage's parameters get gradients,
so the optimizer (which skips parameters without gradients) updates only them. Clipping
by norm (``gradient_clip_val``) uses the norm over every stage (squared norms summed
across ranks), so it clips as plain training does. Mixed precision with a loss scaler
(``16-mixed``) is refused: the scaler would have to scale the loss inside the schedule.

Checkpoints and evaluation: before saving and before validation, test and predict,
every parameter and buffer is broadcast from the rank whose stage trains it, so rank 0
saves the user's parameter names with current values (loadable into a plain model) and
evaluation runs the whole, current model on every rank. Optimizer state is gathered the
same way (each rank holds the state of its own parameters, under the same indices).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics import Metric
from typing_extensions import override

from lightning_accel.models.blocks import require_block_network
from lightning_accel.pipeline.distributed import RankPipeline, stage_indices
from lightning_accel.pipeline.microbatch import batch_size, scatter
from lightning_accel.pipeline.partition import balance_by_cost, block_bytes
from lightning_accel.pipeline.reduction import REDUCTIONS, reduce_outputs
from lightning_accel.pipeline.schedule import check_schedule

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


class _NetInput(Exception):
    """Raised by the network's stand-in on the first rank: carries what ``training_step`` fed it."""

    def __init__(self, inputs: Tensor) -> None:
        super().__init__("pipeline input captured")
        self.inputs = inputs


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


def _loggable(value: Any) -> Any:
    """What one ``self.log`` value is worth on another rank: a CPU tensor (a metric: its value on this micro-batch)."""
    if isinstance(value, Metric):
        cache = value._forward_cache
        value = cache if cache is not None else value.compute()
    return value.detach().cpu() if isinstance(value, Tensor) else value


def _reduce_logs(records: Sequence[list[tuple[str, Any, dict]]], sizes: Sequence[int], reduction: str) -> list[tuple[str, Any, dict]]:
    """One ``(name, value, kwargs)`` per logged name: the micro-batch values reduced like the loss."""
    merged: dict[str, tuple[list[Any], list[int], dict]] = {}
    for record, size in zip(records, sizes):
        for name, value, kwargs in record:
            values, weights, _ = merged.setdefault(name, ([], [], kwargs))
            values.append(value)
            weights.append(size)
    out = []
    for name, (values, weights, kwargs) in merged.items():
        if not all(isinstance(v, (int, float, Tensor)) and not isinstance(v, bool) for v in values):
            out.append((name, values[-1], kwargs))  # not a number: the last micro-batch's
            continue
        total = sum(weights)
        value = sum(v * (w / total) for v, w in zip(values, weights)) if reduction == "mean" else sum(values)
        if "batch_size" in kwargs:
            kwargs = {**kwargs, "batch_size": total}  # weighs the epoch mean by the whole batch
        out.append((name, value, kwargs))
    return out


class DistributedGPipeStrategy(DDPStrategy):
    """Pipeline parallelism over processes: the model's blocks in one stage per rank, batches in ``chunks`` micro-batches.

    Args:
        chunks: micro-batches per batch (M); the batch size must be a multiple of it.
        schedule: ``"gpipe"`` (all forwards, then all backwards), ``"1f1b"`` (fewer
            activations alive) or ``"interleaved_1f1b"`` (two stages per rank, smaller bubble;
            needs ``chunks`` >= stages).
        balance: blocks per stage (one entry per rank, two per rank for
            ``interleaved_1f1b``), or ``"by_size"``.
        loss_reduction: how ``training_step``'s loss reduces over samples: ``"mean"`` or ``"sum"``.
        timeout: how long a rank waits for a neighbour before failing (a dead rank ends every
            rank with an error naming it, never a hang).
        start_method: as for ``DDPStrategy``: ``"popen"`` re-runs your script per rank.
    """

    strategy_name = "gpipe_distributed"

    def __init__(
        self,
        chunks: int = 1,
        schedule: str = "gpipe",
        balance: Sequence[int] | str = "by_size",
        loss_reduction: str = "mean",
        timeout: timedelta | float = timedelta(minutes=30),
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError(f"chunks must be a positive int (micro-batches per batch), got {chunks!r}; e.g. chunks=4")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}; '1f1b' keeps the fewest activations alive")
        if loss_reduction not in REDUCTIONS:
            raise ValueError(f"loss_reduction must be 'mean' or 'sum' (how your loss reduces over samples), got {loss_reduction!r}")
        if isinstance(balance, str) and balance != "by_size":
            raise ValueError(f"balance must be a list of blocks per stage or 'by_size', got {balance!r}")
        if not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        super().__init__(timeout=timeout, start_method=start_method, **kwargs)  # type: ignore[arg-type]
        self.chunks, self.schedule, self.loss_reduction = chunks, schedule, loss_reduction
        self.balance = balance if isinstance(balance, str) else list(balance)
        self.pipeline: RankPipeline | None = None
        self._owners: list[int] = []  # per entry of _tensors(): the rank whose stage trains it
        self._pending: list[Tensor | None] = []  # this step's gradients, until Lightning's backward
        self._step_loss: Callable[[Tensor, Tensor], Tensor] | None = None

    # -- placement ----------------------------------------------------------------------------

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # the ranks are the stages of one model: every rank must see the same batch
        return {"num_replicas": 1, "rank": 0}

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
        module = trainer.lightning_module
        if trainer.state.fn == TrainerFn.FITTING:
            if not module.automatic_optimization:
                raise ValueError(
                    "DistributedGPipeStrategy needs automatic optimization: the pipeline schedule runs forward and "
                    "backward itself. HINT: remove `self.automatic_optimization = False`"
                )
        super().setup(trainer)
        # clipping by norm needs the norm of the whole model's gradient, not of this rank's stage
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "DistributedGPipeStrategy cannot use a loss scaler (precision='16-mixed'): the schedule runs backward "
                "itself. HINT: use precision='bf16-mixed', 'bf16-true', '32-true' or '64-true'"
            )

    @override
    def configure_ddp(self) -> None:
        """No DDP wrapper: start every rank from rank 0's weights, then build this rank's stage."""
        self._broadcast_from([0] * len(self._tensors()))
        net = self._net()
        block_net = require_block_network(net, "DistributedGPipeStrategy")
        ranks = self.world_size
        stages = len(stage_indices(0, ranks, self.schedule)) * ranks
        check_schedule(self.schedule, self.chunks, stages)
        if isinstance(self.balance, str):
            if stages > len(block_net.blocks):
                raise ValueError(
                    f"{ranks} ranks run {stages} stages but {type(net).__name__} has {len(block_net.blocks)} blocks; "
                    f"use at most {len(block_net.blocks)} stages (trainer devices)"
                )
            balance = balance_by_cost(block_bytes(list(block_net.blocks)), stages)
        else:
            balance = self.balance
        self.pipeline = RankPipeline(
            net, balance, self.chunks, self._loss_fn, schedule=self.schedule, device=self.root_device,
            scale_grads=self.loss_reduction == "mean",
        )
        # each parameter and buffer belongs to the rank of its stage; what no stage holds
        # (anything outside the network) is used by training_step, which runs on the last rank
        stage_of = {}
        for s, count in enumerate(self.pipeline.balance):
            start = sum(self.pipeline.balance[:s])
            modules = [block_net.blocks[i] for i in range(start, start + count)]
            modules += [block_net.pre] * (s == 0) + [block_net.post] * (s == len(self.pipeline.balance) - 1)
            for m in modules:
                for t in [*m.parameters(), *m.buffers()]:
                    stage_of.setdefault(id(t), s)
        last = len(self.pipeline.balance) - 1
        self._owners = [stage_of.get(id(t), last) % ranks for t in self._tensors()]

    def _broadcast_from(self, owners: Sequence[int]) -> None:
        with torch.no_grad():
            for tensor, owner in zip(self._tensors(), owners):
                dist.broadcast(tensor.data, src=owner)

    def sync_weights(self) -> None:
        """Give every rank every stage's current parameters and buffers (all ranks must call this)."""
        if self._owners and dist.is_initialized():  # also after fit: trainer.save_checkpoint(...)
            self._broadcast_from(self._owners)

    # -- one training step --------------------------------------------------------------------

    def _loss_fn(self, output: Tensor, index: Tensor) -> Tensor:
        assert self._step_loss is not None
        return self._step_loss(output, index)

    def _net_input(self, batch: Any, rest: tuple, kwargs: dict) -> Tensor:
        """Run ``training_step`` until it calls the network; return what it fed it."""
        module, net = self.lightning_module, self._net()
        assert module is not None

        def capture(x: Tensor, *_: Any, **__: Any) -> Tensor:
            raise _NetInput(x)

        try:
            with _patched(net, "forward", capture), _patched(module, "log", lambda *a, **k: None):
                module.training_step(batch, *rest, **kwargs)
        except _NetInput as found:
            return found.inputs
        raise ValueError(
            f"training_step never called the network ({type(net).__name__}); the first pipeline stage runs on what "
            "training_step passes to it. HINT: compute the loss from self.net(x) (or self(x)) in training_step"
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        module, pipe = self.lightning_module, self.pipeline
        assert module is not None and pipe is not None
        batch, rest = (args[0], args[1:]) if args else (kwargs.pop("batch"), ())
        size = batch_size(batch)
        if size % self.chunks:
            raise ValueError(
                f"the batch size {size} is not divisible by chunks={self.chunks}; every micro-batch must have the same "
                "size. HINT: a DataLoader batch_size that is a multiple of chunks, and drop_last=True"
            )
        micro = scatter(batch, self.chunks)
        sizes = [batch_size(mb) for mb in micro]
        outputs: list[Any] = [None] * self.chunks
        logs: list[list[tuple[str, Any, dict]]] = [[] for _ in range(self.chunks)]
        net = self._net()

        def step_loss(output: Tensor, index: Tensor) -> Tensor:
            i = int(index.reshape(-1)[0])
            logs[i] = []  # torch runs micro-batch 0 twice on the first step (shape inference): keep the last

            def log(name: str, value: Any, *a: Any, **kw: Any) -> None:
                logs[i].append((name, _loggable(value), kw))

            with _patched(net, "forward", lambda *_, **__: output), _patched(module, "log", log):
                out = module.training_step(micro[i], *rest, **kwargs)
            if out is None:
                raise ValueError("training_step returned None (skip the batch), but the pipeline has already run it")
            outputs[i] = out
            return out["loss"] if isinstance(out, Mapping) else out

        self._step_loss = step_loss
        inputs = self._net_input(batch, rest, dict(kwargs)) if pipe.holds_first else None
        target = torch.arange(self.chunks, device=self.root_device) if pipe.holds_last else None
        params = pipe.parameters()
        earlier = [p.grad for p in params]  # accumulated batches: the schedule must not rescale them
        for p in params:
            p.grad = None
        with self.precision_plugin.train_step_context():
            pipe.step(inputs, target)
        self._pending = [p.grad for p in params]
        for p, g in zip(params, earlier):
            p.grad = g
        # the last rank has the loss and the logs: every rank returns and logs the same
        payload: list[Any] = [None, None, False]
        if pipe.holds_last:
            reduced = reduce_outputs(outputs, sizes, self.loss_reduction)
            loss = reduced["loss"] if isinstance(reduced, Mapping) else reduced
            payload = [loss.detach().cpu(), _reduce_logs(logs, sizes, self.loss_reduction), isinstance(reduced, Mapping)]
        dist.broadcast_object_list(payload, src=self.world_size - 1)
        loss, records, as_dict = payload
        for name, value, kw in records:
            module.log(name, value.to(self.root_device) if isinstance(value, Tensor) else value, **kw)
        loss = loss.to(self.root_device)
        return {"loss": loss} if as_dict else loss

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
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """``torch.nn.utils.clip_grad_norm_`` over every stage: squared norms summed across ranks."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64, device=self.root_device)
        for g in grads:
            squares += g.detach().double().pow(2).sum()
        dist.all_reduce(squares)  # each parameter has a gradient on exactly one rank
        coef = torch.clamp(clip_val / (squares.sqrt() + 1e-6), max=1.0)
        for g in grads:
            g.detach().mul_(coef.to(g.dtype))

    # -- checkpoints and evaluation -----------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.sync_weights()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        state = optimizer.state_dict()
        if not self._owners or not dist.is_initialized():
            return state
        mine = {i: {k: v.cpu() if isinstance(v, Tensor) else v for k, v in s.items()} for i, s in state["state"].items()}
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        return {**state, "state": {i: s for part in every for i, s in part.items()}}

    @override
    def on_train_end(self) -> None:
        self.sync_weights()  # after fit, the module on every rank holds the whole trained model

    @override
    def on_validation_start(self) -> None:
        self.sync_weights()

    @override
    def on_test_start(self) -> None:
        self.sync_weights()

    @override
    def on_predict_start(self) -> None:
        self.sync_weights()

    @override
    def teardown(self) -> None:
        # _owners stays: trainer.save_checkpoint after fit still gathers the stages
        self.pipeline, self._pending, self._step_loss = None, [], None
        super().teardown()
