"""Activation bytes of one training step, measured on fake tensors: per block, per boundary, at peak.

The recipe's own training step runs once, forward and backward, on a fake batch and fake
parameters (:mod:`~lightning_accel.estimate.fake`) under :class:`~.live_bytes.LiveBytes`, so
the bytes are what the model's operators create (attention kernels, autocast's casts,
rotary tables, the loss), for any model, not a formula per architecture. Hooks on the blocks
read the counter as the step passes them:

- ``inputs[i]``: bytes of block ``i``'s input tensors not already given to an earlier block
  (what a checkpoint keeps: the hidden states; the rotary tables once);
- ``kept[i]``: bytes block ``i``'s forward leaves alive (saved for backward and its output);
- ``backward[i]``: the most bytes block ``i``'s backward adds above what was alive when it
  started (a checkpointed block: its recompute too);
- ``before`` / ``after``: bytes kept by the forward outside the blocks (embeddings; head and
  loss), ``head_backward`` the backward's peak above the kept bytes before it reaches the last
  block (the logits' gradient);
- ``peak``: the most bytes alive at once in the whole step.

Gradients of parameters are dropped as they are accumulated, so every figure is activations
only (the gradients are a component of their own). Nothing here imports Lightning.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from lightning_accel.estimate.live_bytes import LiveBytes


@dataclass(frozen=True)
class StepActivations:
    """Activation bytes of one training step (see the module doc)."""

    peak: int
    kept: list[int]
    inputs: list[int]
    backward: list[int]
    before: int
    after: int
    head_backward: int

    @property
    def kept_total(self) -> int:
        return self.before + sum(self.kept) + self.after


@contextlib.contextmanager
def _checkpointed(blocks: Sequence[nn.Module]) -> Iterator[None]:
    """Each block's forward recomputed in backward (torch.utils.checkpoint, non-reentrant)."""
    saved = [block.forward for block in blocks]
    for block, forward in zip(blocks, saved):
        block.forward = functools.partial(checkpoint, forward, use_reentrant=False)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for block, forward in zip(blocks, saved):
            block.forward = forward  # type: ignore[method-assign]


def _loss_of(out: object) -> Tensor:
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, Tensor):
        raise ValueError(f"the training step returned {type(out).__name__}, not a loss tensor; the estimate runs automatic-optimization steps only")
    return loss


def measure_step(
    step: Callable[[], object],
    blocks: Sequence[nn.Module],
    params: Sequence[nn.Parameter],
    autocast: torch.dtype | None = None,
    checkpoint_blocks: bool = False,
) -> StepActivations:
    """Run ``step()`` (returns the loss) and its backward under the counter; see the module doc.

    ``params``: the trainable parameters (their gradients are dropped as they land);
    ``autocast``: the mixed-precision dtype (CPU autocast), or None.
    """
    n = len(blocks)
    kept, inputs, backward = [0] * n, [0] * n, [0] * n
    given: set[int] = set()
    entered: dict[int, int] = {}
    finished: set[int] = set()
    marks = {"first": -1, "last_out": -1, "bwd_start": 0, "block_bwd": 0}
    counter = LiveBytes()

    def pre(k: int) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            if k in entered:  # a second call (a recompute) is not the forward's
                return
            entered[k] = counter.now
            if marks["first"] < 0:
                marks["first"] = counter.now
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, Tensor) and t.untyped_storage()._cdata not in given:
                    storage = t.untyped_storage()
                    given.add(storage._cdata)
                    # a freed storage's address may come back for another tensor, which is not given yet
                    weakref.finalize(storage, given.discard, storage._cdata)
                    inputs[k] += storage.nbytes()

        return hook

    def post(k: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: tuple, _out: object) -> None:
            if k not in finished:
                finished.add(k)
                kept[k] = counter.now - entered[k]
                marks["last_out"] = counter.now

        return hook

    def bwd_pre(k: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _grad: tuple) -> None:
            if k == n - 1:
                head = counter.window_peak - marks["bwd_start"]
                marks["head_backward"] = max(marks.get("head_backward", 0), head)
            marks["block_bwd"] = counter.mark()

        return hook

    def bwd_post(k: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _gin: tuple, _gout: tuple) -> None:
            backward[k] = max(backward[k], counter.window_peak - marks["block_bwd"])
            counter.mark()

        return hook

    handles = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in params]
    for k, block in enumerate(blocks):
        handles += [
            block.register_forward_pre_hook(pre(k), with_kwargs=True),
            block.register_forward_hook(post(k)),
            block.register_full_backward_pre_hook(bwd_pre(k)),
            block.register_full_backward_hook(bwd_post(k)),
        ]
    cast = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    try:
        with warnings.catch_warnings(), counter, cast, (_checkpointed(blocks) if checkpoint_blocks else contextlib.nullcontext()):
            warnings.simplefilter("ignore")  # self.log without a Trainer, full backward hooks on tuple outputs
            loss = _loss_of(step())
            after_forward = counter.now
            marks["bwd_start"] = counter.mark()
            loss.backward()
            del loss
    finally:
        for handle in handles:
            handle.remove()
    first = max(marks["first"], 0)
    last = marks["last_out"] if marks["last_out"] >= 0 else after_forward
    return StepActivations(
        peak=counter.peak,
        kept=kept,
        inputs=inputs,
        backward=backward,
        before=first,
        after=after_forward - last,
        head_backward=int(marks.get("head_backward", counter.peak - after_forward)),
    )
