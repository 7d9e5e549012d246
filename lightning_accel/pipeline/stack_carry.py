"""Which stack ends a multi-process pipeline stage carries on, beside its own output, so a later stack gets them.

An encoder-decoder's blocks are two stacks (T5's ``encoder.block.*`` then ``decoder.block.*``).
A pipeline stage receives only the previous stage's last block output, but every decoder
block reads the encoder's output (cross-attention), which the model's own code computes from
the encoder's last block output (T5: its final layer norm). So the output of each stack's
last block (a *stack end*) travels with the activations: a stage that computes it, or
receives it, sends it on beside its own output for as long as a later stage needs it; a
stage that receives it puts it back where the model's code expects it (that block's output;
:mod:`lightning_accel.pipeline.boundaries`). Its gradient comes back through the same sends,
each decoder stage's part added to the next's on the way (autograd sums them where the
carry is used and also sent on), so the encoder's gradient is the sum over every decoder
stage, as in one process. This is how torch's pipelines, whose stages exchange tensors only
with their neighbours, can feed every decoder stage: the cost is the encoder output's bytes
once more per decoder stage boundary, forward and backward.

What the model computes once from its inputs (masks, T5's relative position biases) is
either recomputed on every rank (the model's code before the blocks) or part of a block's
output tuple, which crosses as it is. Pure: block indices in, block indices out.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["carried_into", "carried_out_of", "stack_ends"]


def stack_ends(names: Sequence[str]) -> tuple[int, ...]:
    """Indices of the blocks that end a stack, the last stack's excepted: block ``k`` whose parent module differs from
    block ``k + 1``'s (``encoder.block.1`` before ``decoder.block.0``). One stack: none."""
    parents = [name.rpartition(".")[0] for name in names]
    return tuple(k for k in range(len(names) - 1) if parents[k] != parents[k + 1])


def carried_into(ends: Sequence[int], starts: Sequence[int], stage: int) -> tuple[int, ...]:
    """The stack ends stage ``stage`` (first block ``starts[stage]``) receives as carries: those before the block that
    hands it its input (that one arrives as the previous stage's output)."""
    return tuple(k for k in ends if k < starts[stage] - 1) if stage > 0 else ()


def carried_out_of(ends: Sequence[int], starts: Sequence[int], stage: int) -> tuple[int, ...]:
    """The stack ends stage ``stage`` sends on beside its output: what the next stage receives as carries (none from
    the last stage)."""
    return carried_into(ends, starts, stage + 1) if stage + 1 < len(starts) else ()
