"""The user's step once per batch on every rank of a pipeline; the model's call inside it runs the pipeline.

Why: under DDP every rank runs the user's ``training_step`` to its end, once per batch: its loss, ``self.log``,
``self.all_gather``, what it appends, returns, counts or writes on rank 0. A pipeline's ranks are the stages of one
model, so only the model's call is split. The route of a training step, top to bottom:

1. the strategy runs the user's step on every rank (:meth:`ModelCalls.training` around it);
2. the step calls the *entry*, the module that runs the blocks (:func:`entry_module`: the blocks' nearest common ancestor
   with a forward of its own, below the LightningModule: a transformers ``LlamaModel``, a litgpt ``GPT``, the user's
   network); the call is cut here (:meth:`ModelCalls._train`): its arguments are split into micro-batches
   (:func:`~lightning_accel.pipeline.microbatch.scatter_call`), and every micro-batch's forward runs through the stages
   (:meth:`RankPipeline.forward_phase <lightning_accel.pipeline.distributed.RankPipeline.forward_phase>`: torch's GPipe
   schedule in two halves, :mod:`~lightning_accel.pipeline.split_gpipe`), each rank computing its stages;
3. the last stage's rank joins its micro-batches' outputs into the whole batch's, as detached leaves that will receive
   the loss's gradients (:class:`WholeOutputs`), and sends a copy to the other ranks
   (:class:`~lightning_accel.pipeline.call_output.CallOutput`); the call returns it on every rank, and the step goes on,
   on every rank, with the batch's output: its loss, logs and outputs are each rank's own and equal;
4. Lightning's ``backward``: on the last stage's rank the loss's backward fills the leaves' gradients; then every rank runs
   each call's backward phase (:meth:`ModelCalls.backward`), the leaves' gradients starting each micro-batch's backward,
   and the code before the call (an embedding outside the entry) is backpropagated once from what reached its inputs.

A step may call the entry more than once (two loaders' batches, a consistency loss): each call runs its own forward
phase, and the backward runs each call's backward phase. A call without gradients (``torch.no_grad()`` inside the step,
or evaluation) streams its micro-batches through the stages instead (:meth:`ModelCalls._evaluate`). A stage's error, or
the step's own on any rank, is raised on every rank (:meth:`ModelCalls.end_step`). No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_accel.patching import patch
from lightning_accel.pipeline.call_output import CallOutput
from lightning_accel.pipeline.microbatch import call_batch_size, gather_output, map_tensors, scatter_call, tensors_in

if TYPE_CHECKING:
    from lightning_accel.pipeline.distributed import RankPipeline

__all__ = ["ModelCalls", "WholeOutputs", "as_leaves", "entry_module"]


def as_leaves(value: Any) -> tuple[Any, list[tuple[Tensor, Tensor]]]:
    """``value`` with each tensor that carries a gradient replaced by a detached leaf that requires one, and the
    (tensor, leaf) pairs: a graph cut whose two sides' backwards run apart (the leaves' gradients start the other)."""
    pairs: list[tuple[Tensor, Tensor]] = []

    def leaf(t: Tensor) -> Tensor:
        if not t.requires_grad:
            return t
        copy = t.detach().requires_grad_()
        pairs.append((t, copy))
        return copy

    return map_tensors(value, leaf), pairs


def entry_module(net: nn.Module, blocks: Sequence[nn.Module]) -> tuple[str, nn.Module] | None:
    """The module whose call runs the blocks: their nearest common ancestor in ``net`` that is not a container
    (``ModuleList``, ``ModuleDict``) and not a block; None when that is ``net`` itself (the step calls the blocks itself)."""
    paths = {id(m): name for name, m in net.named_modules(remove_duplicate=False)}
    block_names = [paths.get(id(b)) for b in blocks]
    if not block_names or any(n is None or n == "" for n in block_names):
        return None
    split = [n.split(".") for n in block_names if n is not None]
    common: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    if len(block_names) == 1 or common == split[0]:
        common = common[:-1]  # one block: its parent
    while common:
        module = net.get_submodule(".".join(common))
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            return ".".join(common), module
        common = common[:-1]
    return None


@dataclass
class _Call:
    """One call of the entry in a training step, waiting for its backward: its schedule, and the code before the call
    that carried gradients into it (each micro-batch's argument and the leaf that stood in for it)."""

    schedule: Any
    before: list[tuple[Tensor, Tensor]] = field(default_factory=list)

    def backward_before(self) -> None:
        """The backward of the step's code before the call, from the gradients its micro-batches gave their inputs
        (nothing where none reached them: a rank whose stage starts later)."""
        pairs = [(t, c.grad) for t, c in self.before if c.grad is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


class ModelCalls:
    """The entry's calls inside the user's steps on this rank of ``pipe`` (see the module docstring): the entry's
    ``forward`` is replaced while a step runs (:meth:`training`, :meth:`evaluating`), and each call runs the pipeline."""

    def __init__(self, pipe: RankPipeline, src: int) -> None:
        assert pipe.entry is not None, "ModelCalls needs an entry module (RankPipeline.entry)"
        self.pipe = pipe
        self.name, self.module = pipe.entry
        self.output = CallOutput(src, pipe.group, pipe.device)  # the last stage's rank (global rank src) sends
        self.pending: list[_Call] = []  # this training step's calls, until Lightning's backward
        self._original: Callable[..., Any] = self.module.forward
        self._through = False  # _own() is calling: the forward is the module's own
        self._mode = "outside"  # "training" or "evaluating" while a step of the user runs
        # the entry's forward is replaced from here to restore(): a call outside the steps (a hook or callback calling
        # the model on every rank, as under DDP) streams through the stages too
        self._patch = patch(self.module, "forward", self._call)

    def restore(self) -> None:
        """The entry's own forward back (the strategy drops this pipeline)."""
        self._patch.remove()

    @contextmanager
    def training(self) -> Iterator[None]:
        """Around the user's training step: each call of the entry runs a forward phase (or streams, without gradients)."""
        self.pipe.begin_step()
        self.discard()
        with self._in("training"):
            yield

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Around the user's evaluation step: each call of the entry streams its micro-batches through the stages."""
        self.pipe.begin_step()
        with self._in("evaluating"):
            yield

    @contextmanager
    def _in(self, mode: str) -> Iterator[None]:
        previous, self._mode = self._mode, mode
        try:
            yield
        finally:
            self._mode = previous

    def end_step(self, failed: Exception | None) -> None:
        """After the user's step, on every rank: what it raised here or on another rank of the pipeline is raised on
        every rank (a collective), and the step's calls are forgotten."""
        if self.pipe.failure.settled:  # a call already raised a stage's error on every rank
            self.discard()
            if failed is not None:
                raise failed
            return
        if failed is not None:
            self.pipe.record_failure(failed, backward=False)
        try:
            self.pipe.settle()
        except BaseException:
            self.discard()
            raise

    def backward(self) -> None:
        """Every pending call's backward phase on this rank, the last call's first (on the last stage's rank after the
        loss's backward reached their outputs); what failed is raised on every rank."""
        pending, self.pending = self.pending, []
        if not pending:  # the step did not call the model: what the loss's backward raised is still every rank's
            self.pipe.settle()
        try:
            while pending:
                call = pending.pop()
                self.pipe.backward_phase(call.schedule, after=call.backward_before)
        finally:
            for call in pending:  # not run after a failure: forgotten
                self.pipe.discard(call.schedule)

    def discard(self) -> None:
        """Forget the step's calls without their backward (the step returned no loss, or failed)."""
        for call in self.pending:
            self.pipe.discard(call.schedule)
        self.pending = []

    def _own(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The entry's call through the module's ``__call__`` (its hooks run, per micro-batch) to its own forward."""
        self._through = True
        try:
            return self.module(*args, **kwargs)
        finally:
            self._through = False

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        """The entry's forward while the pipeline is set up: the module's own inside a stage's run (:meth:`_own`, or the
        user's step run per micro-batch by the schedule: :mod:`~lightning_accel.pipeline.rank_step`) and for a call on
        ``meta`` (Lightning's model summary); in a training step a forward phase; elsewhere streamed."""
        if self._through or self.pipe._forwarding or any(t.is_meta for t in tensors_in([args, kwargs])):
            return self._original(*args, **kwargs)
        if self._mode == "training":
            return self._train(args, kwargs)
        if self._mode == "evaluating":
            return self._evaluate(args, kwargs)
        return self._stream(args, kwargs)  # a hook or callback, on every rank: without gradients

    def _train(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        if not torch.is_grad_enabled():  # a call the step makes without gradients (a target, a teacher): no backward
            return self._stream(args, kwargs)
        pipe = self.pipe
        chunks = pipe.microbatches(call_batch_size(args, kwargs))  # the pipeline's chunks, or a ragged batch's count
        parts, sizes = scatter_call(args, kwargs, chunks)
        # a part computed with gradients before the call (an embedding outside the entry) enters each micro-batch as a
        # leaf of its own: the backward phase gives the leaves gradients, and the code before the call is
        # backpropagated once, from all of them (_Call.backward_before), as plain training runs it once
        call = _Call(None)
        leaves = []
        for part in parts:
            part_leaves, pairs = as_leaves(part)
            leaves.append(part_leaves)
            call.before += pairs
        whole = WholeOutputs(chunks) if pipe.holds_last else None
        shape = (len(self.pending), tuple(tuple(t.shape) for t in tensors_in([args, kwargs])))  # equal on every rank
        call.schedule = pipe.forward_phase(lambda i: self._own(*leaves[i]), shape, chunks, whole)
        self.pending.append(call)
        return self._deliver(whole.joined(sizes) if whole is not None else None)

    def _evaluate(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        if torch.is_grad_enabled():
            raise ValueError(
                f"{self.name} was called with gradients enabled in an evaluation step (torch.enable_grad() under "
                "Trainer(inference_mode=False)); a pipeline runs evaluation forward only, each rank its stages, so no "
                "gradient can reach what the step differentiates; compute such gradients in training_step, or train with "
                "strategy='ddp'"
            )
        return self._stream(args, kwargs)

    def _stream(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The call without gradients: its micro-batches streamed through the stages (any batch size), the last stage's
        rank running the entry on the whole batch from its stage's input; its output on every rank."""
        pipe = self.pipe
        size = call_batch_size(args, kwargs)
        parts, _ = scatter_call(args, kwargs, pipe.eval_chunks(size))
        value = pipe.evaluate(size, lambda i: self._own(args, kwargs) if i is None else self._own(*parts[i]))
        return self._deliver(value)

    def _deliver(self, value: Any) -> Any:
        """The last stage's rank's output on every rank; what the step reads after the call from outside the entry
        (a head) is current on every rank first (:meth:`~lightning_accel.pipeline.shared_params.SharedParams.freshen`)."""
        pipe = self.pipe
        if self._mode != "evaluating":  # a copy of what this rank does not step is stale (an evaluation syncs them first)
            pipe.shared.freshen(pipe.outside, pipe.world_size)
        return self.output.deliver(value)


class _FromLeaves(torch.autograd.Function):
    """A micro-batch's stand-in loss on the last stage: zero; its backward hands each output tensor its leaf's gradient
    (what the whole batch's loss gave it)."""

    @staticmethod
    def forward(ctx: Any, holder: WholeOutputs, index: int, *outputs: Tensor) -> Tensor:
        ctx.holder, ctx.index = holder, index
        return torch.zeros(1, device=outputs[0].device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        grads = ctx.holder.gradients(ctx.index)
        return (None, None, *(None if g is None else g * grad.reshape(()).to(g.dtype) for g in grads))


class WholeOutputs:
    """The last stage's outputs of one whole step's micro-batches: each kept as detached leaves, joined for the step, and
    each micro-batch's backward started from its leaves' gradients."""

    def __init__(self, chunks: int) -> None:
        self.leaves: list[Any] = [None] * chunks
        self._pairs: dict[int, list[Tensor]] = {}  # per micro-batch: the leaves of its outputs that carry a gradient

    def keep(self, index: int, out: Any, device: torch.device) -> Tensor:
        """Micro-batch ``index``'s output: kept; returns the stand-in loss the schedule's backward starts from."""
        self.leaves[index], pairs = as_leaves(out)
        self._pairs[index] = [c for _, c in pairs]
        if not pairs:  # nothing of this micro-batch's output trains: a stand-in whose backward is empty
            return torch.zeros(1, device=device, requires_grad=True)
        return _FromLeaves.apply(self, index, *(t for t, _ in pairs))

    def joined(self, sizes: Sequence[int]) -> Any:
        """The whole batch's output, built from the leaves (:func:`gather_output`)."""
        return gather_output(self.leaves, sizes)[0]

    def gradients(self, index: int) -> list[Tensor | None]:
        return [c.grad for c in self._pairs.get(index, [])]
