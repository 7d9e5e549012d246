"""The user's ``training_step`` once per batch on every pipeline rank, as under plain Lightning, not once per micro-batch.

Why: a multi-process pipeline runs the model's own forward on each micro-batch, and the user's step is what calls it. Run
once per micro-batch, the step's own code runs ``chunks`` times: a logged ``loss ** 2`` becomes the micro-batches' mean
of squares, a hook or a counter in the step counts micro-batches, a random draw before the model's call draws
``chunks`` times. Here the step runs once on the whole batch and only the model's call is split:

- the *entry* is the module that calls the blocks (:func:`entry_module`: the blocks' nearest common ancestor that has a
  forward of its own, below the LightningModule: a transformers ``LlamaModel``, a litgpt ``GPT``, the user's network);
  its call inside the step is intercepted (:class:`EntryCall`), its arguments split into micro-batches
  (:func:`~lightning_accel.pipeline.microbatch.scatter_call`), and each micro-batch's forward, driven by the schedule,
  runs the entry's own forward on its share;
- a rank without the last stage leaves the step at that call (its part of the step ends there: its logs, loss and
  outputs are the last rank's) and runs the schedule;
- on the last stage's rank, under GPipe (every forward before the first backward:
  :class:`~lightning_accel.pipeline.split_gpipe.SplitGPipe`), the call runs every forward and returns the micro-batches'
  outputs joined into the whole batch's (:func:`~lightning_accel.pipeline.microbatch.gather_output`), as detached leaves;
  the step goes on with them (the loss, ``self.log``, what it appends) exactly once; the loss's backward gives each leaf
  its gradient, and each micro-batch's backward starts from those (:class:`WholeOutputs`: the last stage's "loss" for the
  schedule is a stand-in whose gradient is the leaves' gradient, so no ``1 / chunks`` scaling enters). Under the other
  schedules a micro-batch's backward starts before the later ones' forwards, so there the last rank runs the step per
  micro-batch, as before.

A step that never calls the entry, or calls it twice (two batches through one model in one step), cannot be pipelined
this way; it is refused in one line at its first step, on every rank. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_accel.patching import swapped
from lightning_accel.pipeline.microbatch import gather_output, map_tensors, scatter_call, tensors_in

__all__ = ["Captured", "EntryCall", "Left", "WholeOutputs", "as_leaves", "entry_module"]


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


class Captured(BaseException):
    """Raised out of the user's step at the entry's call on a rank that only needs its arguments (a ``BaseException``, so
    a step's ``except Exception`` does not swallow it)."""

    def __init__(self, args: tuple, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.call_args, self.call_kwargs = args, kwargs


class Left(BaseException):
    """Raised out of the user's step on the last rank when the forwards failed (the step does not go on)."""


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


class EntryCall:
    """The entry's ``forward`` replaced while the user's step runs once: :meth:`capturing` (raise :class:`Captured` with
    the call's arguments) or :meth:`driving` (hand the arguments to ``drive``, return what it returns); a second call in
    one step is refused. :meth:`micro` runs the entry's own forward on micro-batch ``i`` of the captured call."""

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name, self.module = name, module
        self.original: Callable[..., Any] = module.forward
        self.calls = 0
        self._through = False  # micro() is calling: the forward is the module's own
        self.parts: list[tuple[tuple, dict[str, Any]]] = []
        self.sizes: list[int] = []
        self.before: list[tuple[Tensor, Tensor]] = []  # (a call argument's micro-batch part, the leaf standing in for it)

    def split(self, args: tuple, kwargs: dict[str, Any], chunks: Callable[[int], int]) -> int:
        """Split a captured call into micro-batches (``chunks(size)``: how many for a batch of ``size``); their count."""
        first = next(iter(tensors_in(list(args)) or tensors_in(kwargs)), None)
        if first is None or first.ndim == 0:
            raise ValueError(
                f"{self.name} was called without a batched tensor argument; the pipeline splits the call into "
                "micro-batches along dimension 0 of its first tensor argument"
            )
        parts, self.sizes = scatter_call(args, kwargs, chunks(first.size(0)))
        # a part computed with gradients before the call (an embedding outside the entry) enters each micro-batch as a
        # leaf of its own: the schedule's backwards give the leaves gradients, and the code before the call is
        # backpropagated once, from all of them (backward_before), as plain training runs it once
        self.parts, self.before = [], []
        for part in parts:
            leaves, pairs = as_leaves(part)
            self.parts.append(leaves)
            self.before += pairs
        return len(self.parts)

    def capture(self, step: Callable[[Any], Any], batch: Any, chunks: Callable[[int], int], hook: str) -> Exception | None:
        """Run ``step(batch)`` up to the entry's call and split the call (:meth:`split`); what failed instead: the step's
        own error before the call, a call that cannot be split, or a step that never made it (``hook`` names it)."""
        with self.capturing():
            try:
                step(batch)
            except Captured as captured:
                try:
                    self.split(captured.call_args, captured.call_kwargs, chunks)
                except Exception as err:  # noqa: BLE001
                    return err
                return None
            except Exception as err:  # noqa: BLE001  # the step's code before the model's call
                return err
        return self.not_called(hook)

    def not_called(self, hook: str) -> ValueError:
        """The error of a step that returned without calling the entry."""
        return ValueError(
            f"{hook} returned without calling {self.name} (the module that runs the pipelined blocks); the pipeline "
            f"runs the blocks inside that call: call the model in {hook}"
        )

    def backward_before(self) -> None:
        """The backward of the step's code before the entry's call, from the gradients its micro-batches gave their
        inputs (nothing when no input carried a gradient or none reached it: a rank whose stage starts later)."""
        pairs = [(t, c.grad) for t, c in self.before if c.grad is not None]
        self.before = []
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def micro(self, i: int) -> Any:
        """The entry's call on micro-batch ``i``, through the module's call (its hooks run, as they did per micro-batch
        before: a router's mask hook), to its own forward."""
        args, kwargs = self.parts[i]
        self._through = True
        try:
            return self.module(*args, **kwargs)
        finally:
            self._through = False

    def _second(self) -> None:
        self.calls += 1
        if self.calls > 1:
            raise ValueError(
                f"training_step called {self.name} (the module that runs the pipelined blocks) {self.calls} times in one "
                "step; the pipeline runs it once per batch: call it once (concatenate the inputs), or train with one "
                "dataloader"
            )

    def capturing(self) -> Any:
        return self.driving(_capture)

    def driving(self, drive: Callable[[tuple, dict[str, Any]], Any]) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._through:
                return self.original(*args, **kwargs)
            self._second()
            return drive(args, kwargs)

        self.calls = 0
        return swapped(self.module, "forward", forward)


def _capture(args: tuple, kwargs: dict[str, Any]) -> Any:
    raise Captured(args, kwargs)


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
