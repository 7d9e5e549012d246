"""The steps of :class:`~lightning_accel.strategies.gpipe_distributed.DistributedGPipeStrategy`: where the user's
``training_step`` and evaluation steps run on each rank of a pipeline, and Lightning's ``backward``.

:class:`PipelineSteps` is the part of the strategy Lightning calls once per batch: ``training_step`` runs the user's
step once on every rank, its call of the model running the pipeline (:mod:`lightning_accel.pipeline.whole_step`, under
GPipe), and ``backward`` runs the loss's backward on the last stage's rank and then every call's backward phase; under the
other schedules ``training_step`` runs the user's step per micro-batch inside the schedule
(:mod:`lightning_accel.pipeline.rank_step`: the loss and logs of the last rank sent to every rank) and ``backward`` adds
the gradients it set aside. The evaluation steps run the user's step once on every rank, its call streamed.
"""

from __future__ import annotations

import dataclasses
import os
import time
from functools import partial
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.pipeline.batch_agreement import check_same_batch
from lightning_accel.pipeline.batch_layers import check_batch_layers
from lightning_accel.pipeline.distributed import RankPipeline, stage_indices
from lightning_accel.pipeline.gradients import add_gradients, average_gradients
from lightning_accel.pipeline.microbatch import batch_size, map_tensors
from lightning_accel.pipeline.rank_step import RETURNED, eval_step, kept_on_cpu, train_step
from lightning_accel.pipeline.step_report import broadcast_step_result
from lightning_accel.pipeline.whole_step import ModelCalls
from lightning_accel.strategies.user_hooks import calls_in

__all__ = ["PipelineSteps"]


def _shapes(batch: Any) -> tuple:
    """The shapes of a batch's tensors: the same on every rank (every rank loads the same batch)."""
    found: list[tuple[int, ...]] = []
    apply_to_collection(batch, Tensor, lambda t: found.append(tuple(t.shape)))
    return tuple(found)


class PipelineSteps(DDPStrategy):
    """``training_step``, ``backward`` and the evaluation steps of a pipeline strategy (see the module docstring)."""

    pipeline: RankPipeline | None = None
    deferred_batch_norm: bool | None = None
    _calls: ModelCalls | None = None  # the model's calls in the user's steps (None: the LightningModule calls the blocks)
    _step_signature_cache: tuple | None = None  # the last step's result signature, the same on every rank of a pipeline

    # -- one training step: where the user's step runs ------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The user's ``training_step`` once, on every rank: its call of the model runs the pipeline and returns the whole
        batch's output on every rank (:class:`~lightning_accel.pipeline.whole_step.ModelCalls`), so what the step does
        after it (loss, logs, gathers, outputs) is every rank's own, as under DDP. Under the other schedules, once per
        micro-batch on the last stage's rank (:meth:`_micro_batch_training_step`)."""
        calls, module, layout = self._calls, self.lightning_module, self._layout
        batch = args[0] if args else kwargs.get("batch")
        check_same_batch(batch, layout.pp_group, layout.pp_size, self.root_device, type(self).__name__)
        if calls is None or not self._whole_steps():
            return self._micro_batch_training_step(args, kwargs)
        assert module is not None and self._split_state is not None
        self._split_state.follow_param_groups(self.optimizers, self._layout)  # a group a callback added: this rank's share
        out, failed = None, None
        with self.precision_plugin.train_step_context(), calls.training():
            try:
                out = module.training_step(*args, **kwargs)
            except Exception as err:  # noqa: BLE001  # raised on every rank, below
                failed = err
        self._step_ended(calls, failed)
        if out is None:  # the batch is skipped, as Lightning skips it: its calls get no backward
            calls.discard()
        return out

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward: on the last stage's rank the loss's own (``LightningModule.backward``, a loss scaler's
        scaling) reaches the outputs of the step's model calls; then every rank runs their backward phases (the other
        ranks' loss is a copy and is not backpropagated); at the end of an accumulation window the gradients of what two
        stages share are summed and the replicas' averaged."""
        calls, module, pipe = self._calls, self.lightning_module, self.pipeline
        if calls is None or not self._whole_steps():
            return self._micro_batch_backward(closure_loss)
        assert module is not None and pipe is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if pipe.holds_last:
            try:
                self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
            except Exception as err:  # noqa: BLE001  # detect_anomaly's NaN gradient: raised on every rank, below
                pipe.record_failure(err, backward=True)
        try:
            calls.backward()
        except Exception:
            self._failed_together = pipe.failure.settled and self.data_parallel_size == 1
            raise
        if self._sync_grads:
            pipe.shared.sum_gradients()  # a tied embedding and head: summed between the ranks that use it
            self._average_over_replicas()
        return self.precision_plugin.post_backward(closure_loss, module)

    def _step_ended(self, calls: ModelCalls, failed: Exception | None) -> None:
        """What the step raised, here or on another rank of the pipeline: raised on every rank (the module is made whole
        at teardown, as after DDP)."""
        try:
            calls.end_step(failed)
        except Exception:
            assert self.pipeline is not None
            self._failed_together = self.pipeline.failure.settled and self.data_parallel_size == 1
            raise

    def _average_over_replicas(self) -> None:
        """As DDP: the replicas' mean of every gradient this rank holds, once per optimizer step."""
        if self.data_parallel_size > 1:
            assert self.optimizers
            mine = [p for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]]
            average_gradients(mine, self._layout.dp_group)

    # -- the other schedules: the step once per micro-batch on the last stage's rank ----------------

    def _micro_batch_training_step(self, args: tuple, kwargs: dict) -> STEP_OUTPUT:
        """The schedule runs the user's step on each micro-batch (:func:`~lightning_accel.pipeline.rank_step.train_step`);
        the last rank's loss, logs and list items, reduced over the micro-batches, reach every rank."""
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
        others = {name: value for name, value, kw in records if kw.get(RETURNED)}  # a returned dict's other keys
        records = [(name, value, kw) for name, value, kw in records if not kw.get(RETURNED)]
        for name, value, kw in records:
            module.log(name, value.to(self.root_device) if isinstance(value, Tensor) else value, **kw)
        loss = loss.to(self.root_device)
        others = {k: map_tensors(v, lambda t: t.to(self.root_device)) for k, v in others.items()}
        return {"loss": loss, **others} if as_dict else loss

    def _micro_batch_backward(self, closure_loss: Tensor) -> Tensor:
        """The schedule ran backward in ``training_step``: add its gradients now (Lightning has zeroed them)."""
        assert self.lightning_module is not None and self.pipeline is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        if self._backward_error is not None:  # what the schedule's backward raised, on every rank (training_step)
            err, self._backward_error, self._pending = self._backward_error, None, []
            raise err
        add_gradients(self.pipeline.parameters(), self._pending, self.lightning_module.trainer.accumulate_grad_batches)
        self._pending = []
        if self._sync_grads:
            self._average_over_replicas()
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """A training loader: its batches' sizes are checked before the first step (:meth:`_check_batch_sizes`). Under
        ``seed_everything(workers=True)`` its workers are seeded by the replica, not the process, as Lightning seeds
        DDP's ranks' workers: a replica's stages load the same batches (random augmentations included)."""
        dataloader = super().process_dataloader(dataloader)
        if int(os.environ.get("PL_SEED_WORKERS", 0)) and getattr(dataloader, "worker_init_fn", "") is None:
            dataloader.worker_init_fn = partial(pl_worker_init_function, rank=self.data_parallel_rank)  # type: ignore[attr-defined]
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

    def _gather_in_step(self) -> str:
        """Why ``self.all_gather`` in ``training_step`` is refused when micro-batches run it (one line, with the fixes)."""
        schedule = "schedule='auto'" if self._auto is not None else f"schedule={self.schedule!r}"
        return (
            f"{type(self).__name__}(chunks={self.chunks}, {schedule}) runs training_step once per micro-batch on the last "
            "stage's rank: self.all_gather there would gather one micro-batch's values, not the batch's as under DDP; "
            "gather in on_train_batch_end or validation_step, use schedule='gpipe' (training_step once per batch), or "
            "chunks=1"
        )

    def _gpipe(self) -> bool:
        """GPipe, not tuned to another schedule during the fit: every forward of a batch before its first backward."""
        return self._auto is None and self.schedule == "gpipe"

    def _whole_steps(self) -> bool:
        """Whether ``training_step`` runs once per batch on every rank (:mod:`~lightning_accel.pipeline.whole_step`): GPipe,
        and a module (the entry) whose call runs the blocks."""
        return self._gpipe() and self._calls is not None

    @override
    def check_fit(self, module: Any, sync_batchnorm: bool) -> None:
        """Also: ``self.all_gather`` in a ``training_step`` that micro-batches run (read from its source; a call the source
        does not show is refused when it is made, :meth:`all_gather`; under GPipe the step runs once per batch, and a
        gather there is the replicas' whole batches, as under DDP), and a layer micro-batches would train otherwise."""
        super().check_fit(module, sync_batchnorm)
        if self.chunks > 1 and not self._gpipe() and calls_in(module, "training_step", "all_gather"):
            raise ValueError(self._gather_in_step())
        # a layer whose result depends on the whole batch (a BatchNorm, an instance norm's running statistics, spectral
        # normalization): honoured or refused (lightning_accel.pipeline.batch_layers)
        check_batch_layers(module, self.chunks, self.deferred_batch_norm, type(self).__name__)

    # -- evaluation ---------------------------------------------------------------------------

    def _eval_step(self, hook: str, args: tuple, kwargs: dict) -> Any:
        """The user's ``hook`` once, on every rank: its call of the model streams the batch through the stages and returns
        the output on every rank (:class:`~lightning_accel.pipeline.whole_step.ModelCalls`). A LightningModule that calls
        the blocks itself: the last rank runs ``hook`` on the whole batch, its logs and output sent to every rank."""
        calls, module, pipe = self._calls, self.lightning_module, self.pipeline
        assert module is not None and pipe is not None
        if calls is None:
            return self._eval_step_without_entry(hook, args, kwargs)
        out, failed = None, None
        with calls.evaluating():
            try:
                out = getattr(module, hook)(*args, **kwargs)
            except Exception as err:  # noqa: BLE001  # raised on every rank, below
                failed = err
        self._step_ended(calls, failed)
        return out

    def _eval_step_without_entry(self, hook: str, args: tuple, kwargs: dict) -> Any:
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

    on_test_start = on_validation_start  # the same: weights current

    @override
    def on_predict_start(self) -> None:
        self.sync_weights()
