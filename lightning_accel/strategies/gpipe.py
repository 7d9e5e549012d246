"""GPipeStrategy: GPipe micro-batching inside a plain Lightning ``Trainer``.

How it hooks into Lightning: the user's ``training_step`` runs once per batch, as under any
Lightning strategy, so its logging, torchmetrics and manual optimization see the whole batch.
What is micro-batched is the network's forward: while ``training_step`` runs, a call of the
network (the LightningModule's ``net``, or the module itself) is split into ``chunks``
micro-batches along the batch dimension of its tensor arguments, each runs through the stages
(:meth:`lightning_accel.pipeline.LocalPipeline.run_microbatches`), and the outputs are
concatenated back, so the user's loss is computed on the whole batch's output, as in plain
training (torchgpipe's ``GPipe.forward`` does the same). Lightning's own ``backward`` then
runs one backward pass through all micro-batches, and its ``optimizer_step`` steps once:
precision, clipping, loss scaling and ``accumulate_grad_batches`` stay Lightning's. A batch
smaller than ``chunks`` after the first (an epoch's last batch, ``drop_last=False``) runs as
that many micro-batches; a first batch smaller than ``chunks`` is refused (the setting could
never be honoured).

Placement is ``model_to_device``: the blocks (``blocks`` policy, as for L2L offload: every
repeated stack, so an encoder-decoder's encoder blocks, then its decoder's) are split into
stages (``balance``) and placed on ``devices`` by :class:`lightning_accel.pipeline.LocalPipeline`
(a model with no block container under ``"auto"``: its children with parameters, where its forward is shown to run them
as a chain, :mod:`lightning_accel.pipeline.child_chain`; refused in one line where it is not),
which wraps no module, so checkpoints keep the user's parameter names. The model's own forward
runs on every micro-batch, so what it computes once and hands to later blocks (the encoder's
output, T5's position bias, attention masks) reaches each block, moved to its stage's device. ``balance="by_time"`` needs a sample, and the one that
costs nothing and is surely representative is the first training batch: the model stays
whole on the first device through setup (and any sanity check), and the first training
call of the network times every block on its first micro-batch
(:func:`lightning_accel.pipeline.partition.profile_block_times`, which leaves weights,
gradients, BatchNorm statistics and the RNG untouched, and runs no loss or logging), splits,
and places, before any gradient is computed. Optimizer state restored from a checkpoint
follows its parameters.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from lightning_accel.models.block_policy import Block, BlockPolicy, find_blocks
from lightning_accel.models.router_loss import router_loss_notice
from lightning_accel.models.side_effects import KVCacheSwitch
from lightning_accel.pipeline.batch_layers import check_batch_layers
from lightning_accel.pipeline.child_chain import chained_children
from lightning_accel.pipeline.local import LocalPipeline, checkpoint_stop
from lightning_accel.patching import Patch, patch
from lightning_accel.pipeline.microbatch import call_batch_size, check_chunks, scatter_call
from lightning_accel.pipeline.options import PipelineOptions, ReadsPipelineOptions
from lightning_accel.pipeline.partition import balance_by_cost, block_bytes, check_balance, profile_block_times
from lightning_accel.strategies.options_check import check_options

DeviceSpec = Union[int, Sequence[Union[str, torch.device]], None]



def _devices(devices: DeviceSpec) -> list[torch.device]:
    """One device per stage from the user's spec, refusing CUDA devices this machine lacks before any work."""
    if devices is None:
        n = torch.cuda.device_count()
        return [torch.device("cuda", i) for i in range(n)] if n else [torch.device("cpu")]
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"devices must be >= 1 (one per stage), got {devices}")
        if torch.cuda.is_available():
            if devices > torch.cuda.device_count():
                raise ValueError(
                    f"devices={devices} but this machine has {torch.cuda.device_count()} CUDA devices; "
                    f"use at most {torch.cuda.device_count()} stages, or list devices explicitly (e.g. ['cpu', 'cpu'])"
                )
            return [torch.device("cuda", i) for i in range(devices)]
        return [torch.device("cpu")] * devices
    if isinstance(devices, str) or not devices:
        raise ValueError(f"devices must be an int or a list with one device per stage, got {devices!r}; e.g. devices=['cpu', 'cpu']")
    out = [torch.device(d) for d in devices]
    if any(d.type == "xla" for d in out):
        raise ValueError(
            f"GPipeStrategy does not run on XLA devices (devices={[str(d) for d in out]}): its re-materialization uses "
            "torch.utils.checkpoint, which torch_xla replaces with its own, and it has no per-step graph boundary yet; "
            "on a TPU use strategy='xla_pjrt', or pipeline on CUDA or CPU devices"
        )
    count = torch.cuda.device_count()
    missing = [str(d) for d in out if d.type == "cuda" and (d.index or 0) >= count]
    if missing:
        raise ValueError(
            f"devices lists {', '.join(missing)} but this machine has {count} CUDA device(s); run on a machine with "
            "them, or list existing devices (e.g. devices=['cpu', 'cpu'] runs the stages on the CPU)"
        )
    return out


class GPipeStrategy(ReadsPipelineOptions, SingleDeviceStrategy):
    """Split the model's blocks into stages over ``devices`` and each batch into ``chunks`` micro-batches.

    Args:
        chunks: micro-batches per batch (M). More cuts the pipeline bubble and the
            activation memory of one micro-batch, at more per-micro-batch overhead.
        balance: blocks per stage as a list, ``"by_size"`` (parameter and buffer bytes, one
            stage per device) or ``"by_time"`` (forward + backward seconds of each block,
            measured on the first training batch's first micro-batch, one stage per device).
        devices: one device per stage: a list (``["cuda:0", "cuda:1"]``, ``["cpu", "cpu"]``),
            an int (that many CUDA devices, or CPU stages where there is no GPU), or
            ``None`` for every visible GPU (the CPU when there is none).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``: which micro-batches keep
            only each stage's input and recompute the rest in backward (memory for time).
        blocks: the block policy of :func:`lightning_accel.models.block_policy.find_blocks`.
        deferred_batch_norm: with ``chunks > 1`` a BatchNorm normalizes each micro-batch with its own statistics, so
            training differs from plain Lightning's: not given (None), that is refused before the first step
            (:mod:`lightning_accel.pipeline.batch_layers`); ``True`` accepts it and updates the running statistics once
            per batch, from the whole batch (torchgpipe's ``deferred_batch_norm=True``); ``False``, once per
            micro-batch, from its own.
    """

    strategy_name = "gpipe"

    def __init__(
        self,
        chunks: int = 1,
        balance: Sequence[int] | str = "by_size",
        devices: DeviceSpec = None,
        checkpoint: str = "except_last",
        blocks: BlockPolicy = "auto",
        deferred_batch_norm: bool | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        check_options(type(self).__name__, locals())  # each argument by kind, before any is used
        self.options = PipelineOptions(chunks, balance, checkpoint)  # validated once, shared with gpipe_distributed
        self.devices = _devices(devices)
        if not isinstance(balance, str) and len(list(balance)) > len(self.devices):
            raise ValueError(
                f"balance {list(balance)} has {len(list(balance))} stages but only {len(self.devices)} devices were "
                f"given; list one device per stage (devices of length {len(list(balance))}) or use fewer stages"
            )
        super().__init__(device=self.devices[0], checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.blocks = blocks
        self.deferred_batch_norm = deferred_batch_norm
        self.pipeline: LocalPipeline | None = None
        self._kv_cache = KVCacheSwitch(type(self).__name__, "re-materializing")  # use_cache off for fit, back at teardown
        self._forward: Patch | None = None  # the network's micro-batched forward, installed by model_to_device
        self._training = False  # inside the user's training_step: a forward of the network is micro-batched
        self._called = False  # the network's forward ran during this training_step
        self._full_batch_seen = False  # a batch of >= chunks samples came: a smaller one later is an epoch's last
        self._said: set[str] = set()  # one-time notices already given

    def _net(self) -> nn.Module:
        """The network the blocks live in: the LightningModule's ``net`` if it has one (zoo tasks), else itself."""
        module = self.lightning_module
        assert module is not None
        net = getattr(module, "net", None)
        return net if isinstance(net, nn.Module) else module

    def _find_blocks(self, net: nn.Module) -> list[Block]:
        """The blocks to cut stages at: the policy's, or, under ``"auto"`` for a model with no block container, its
        children with parameters where its forward runs them as a chain (:mod:`lightning_accel.pipeline.child_chain`)."""
        try:
            return find_blocks(net, self.blocks, stacks="all")
        except ValueError as no_container:
            if not (isinstance(self.blocks, str) and self.blocks == "auto"):
                raise
            return chained_children(net, type(self).__name__, str(no_container))

    def _place(self, net: nn.Module, blocks: list[Block], balance: list[int], why: str) -> None:
        self.pipeline = LocalPipeline(
            net, blocks, balance, self.devices, self.options.checkpoint_stop, self.deferred_batch_norm is not False,
            owner=type(self).__name__,
        )
        self.pipeline.place()
        placed = ", ".join(f"{n} on {d}" for n, d in zip(balance, self.devices))
        plan = (
            f"GPipeStrategy: {len(blocks)} blocks in {len(balance)} stages ({placed}; {why}), "
            f"chunks={self.chunks}, checkpoint={self.checkpoint!r}"
        )
        if plan != getattr(self, "_plan_said", None):  # fit, then validate, set up again: say the plan once
            self._plan_said = plan
            rank_zero_info(plan)

    def _place_by_time(self, forward: Any, args: tuple, kwargs: dict) -> None:
        """Time every block on the network's first micro-batch (``forward(*args, **kwargs)``), split by those times, place."""
        net = self._net()
        blocks = self._find_blocks(net)
        times = profile_block_times(net, [b.module for b in blocks], lambda: forward(*args, **kwargs))
        balance = balance_by_cost(times, min(len(self.devices), len(blocks)))
        self._place(net, blocks, balance, "balance='by_time': " + ", ".join(f"{t * 1e3:.2f}" for t in times)
                    + " ms per block, forward + backward on the first micro-batch")
        for optimizer in self.optimizers:
            if optimizer.state:  # restored from a checkpoint while the model was whole: move it with the parameters
                optimizer.load_state_dict(optimizer.state_dict())

    def _warn_batch_norm(self, net: nn.Module) -> None:
        """BatchNorm sees one micro-batch at a time, which plain training does not: say so once, up front."""
        norms = [n for n, m in net.named_modules() if isinstance(m, _BatchNorm)]
        if self.chunks > 1 and norms and self.deferred_batch_norm is False:
            warnings.warn(
                f"GPipeStrategy(chunks={self.chunks}): {len(norms)} BatchNorm layer(s) (e.g. {norms[0]!r}) normalize "
                f"each micro-batch (1/{self.chunks} of the batch) on its own, so batch statistics, running mean/var "
                "and gradients differ from plain training; set deferred_batch_norm=True to keep the running "
                "statistics over the whole batch (each micro-batch is still normalized by its own statistics)",
                UserWarning,
                stacklevel=2,
            )

    def check_fit(self, module: nn.Module) -> None:
        """What a fit of ``module`` needs that this strategy cannot honour, refused before any work: a layer that
        micro-batches would train otherwise than plain training (a BatchNorm, an instance norm's running statistics,
        spectral normalization; :func:`~lightning_accel.pipeline.batch_layers.check_batch_layers`)."""
        check_batch_layers(module, self.chunks, self.deferred_batch_norm, type(self).__name__)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self.check_fit(trainer.lightning_module)
        super().setup(trainer)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if self.pipeline is not None:
            self.pipeline.restore()
        self.pipeline = None
        self.model.to(self.root_device)
        net = self._net()
        if next(net.parameters(), None) is None:  # nothing to place (a model evaluated, or stepping data only): it runs whole
            return
        blocks = self._find_blocks(net)  # no blocks: say so now, not at the first batch
        self._disable_kv_cache()
        stages = min(len(self.devices), len(blocks))
        if not isinstance(self.balance, str):
            self._place(net, blocks, check_balance(self.balance, len(blocks), len(self.devices)), "balance given")
        elif self.balance == "by_size" or stages == 1:  # by_time with one stage: nothing to measure
            self._place(net, blocks, balance_by_cost(block_bytes([b.module for b in blocks]), stages), f"balance={self.balance!r}")
        # else by_time: needs a sample, so the network's first training call places (see the module docstring)
        self._warn_batch_norm(net)
        if (router := router_loss_notice(type(self).__name__, net, self.chunks)) is not None:
            self._say_once("router", router)
        if self._forward is None:
            # an instance attribute: the class's forward is called per micro-batch, and comes back at teardown
            self._forward = patch(net, "forward", self._microbatched(net.forward))

    def _disable_kv_cache(self) -> None:
        """transformers models cache keys and values by default; a re-materialized block would append them twice.

        Without re-materialization (``checkpoint="never"``, or ``"except_last"`` with one micro-batch) every
        micro-batch's forward builds and drops its own cache, as plain training does: the setting stays.
        """
        if self.options.checkpoint_stop > 0:
            assert self.model is not None
            if (notice := self._kv_cache.off(self.model)) is not None:
                rank_zero_warn(notice)

    def _microbatched(self, forward: Any) -> Any:
        """The network's forward: within ``training_step`` (with grad), as micro-batches through the stages."""

        def run(*args: Any, **kwargs: Any) -> Any:
            if not self._training or not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            self._called = True
            chunks = self._chunks_for(call_batch_size(args, kwargs))
            if self.pipeline is None:  # balance="by_time", first batch
                first_args, first_kwargs = scatter_call(args, kwargs, chunks)[0][0]
                self._place_by_time(forward, first_args, first_kwargs)
                assert self.pipeline is not None
            self.pipeline.checkpoint_stop = checkpoint_stop(self.checkpoint, chunks)
            output, averaged = self.pipeline.run_microbatches(forward, args, kwargs, chunks)
            if averaged:
                self._say_once(
                    "scalar",
                    f"GPipeStrategy(chunks={self.chunks}): the network returned a scalar (e.g. a loss it computed itself) "
                    "per micro-batch; it is their size-weighted mean, which equals the whole batch's only for a mean over "
                    "equally weighted samples; compute the loss from the network's outputs in training_step for exactness",
                )
            return output

        return run

    def _chunks_for(self, size: int) -> int:
        """Micro-batches for a batch of ``size``: ``chunks``, or fewer for an epoch's smaller last batch."""
        if size >= self.chunks:
            self._full_batch_seen = True
            return self.chunks
        if not self._full_batch_seen:
            check_chunks(self.chunks, size)  # a first batch: the setting could never be honoured (also preflight's check)
        self._say_once("ragged", f"GPipeStrategy(chunks={self.chunks}): a batch of {size} samples runs as {size} micro-batches")
        return size

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            rank_zero_warn(message)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._training, self._called = True, False
        try:
            output = super().training_step(*args, **kwargs)
        finally:
            self._training = False
        if self.pipeline is not None:
            self.pipeline.finish_batch()
        if not self._called and self._forward is not None:
            self._say_once(
                "uncalled",
                f"GPipeStrategy: training_step did not call {type(self._net()).__name__}.forward, so nothing was split "
                "into micro-batches or pipelined; call the network (self.net(x) or self(x)) in training_step",
            )
        return output

    @override
    def teardown(self) -> None:
        if self._forward is not None:
            self._forward.remove()
            self._forward = None
        if self.pipeline is not None:
            self.pipeline.restore()
            self.pipeline = None
        self._kv_cache.restore()
        super().teardown()
