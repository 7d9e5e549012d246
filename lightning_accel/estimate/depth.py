"""A deep model's step activations from traces of a few blocks per stack, extrapolated when exact.

Tracing a step on fake tensors costs about half a second per block of a 70B model (dispatch, not
arithmetic): 80 blocks took ~45 s, so ``estimate`` of the 70B recipe and ``validate --all`` took
more than a minute. A stack's blocks are one class with one set of parameter shapes, so past its ends each adds the
same bytes; this traces the step with every stack cut to 4, 5 and 6 blocks (the model's own forward
runs the shorter ``ModuleList``) and extends the figures to the full depth when the three traces
show it: each stack's end blocks the same at every depth, the blocks between them equal, and every
whole-step figure (peak, bytes outside the blocks) growing by one amount per block. Anything else
(stacks of different lengths, blocks that differ in shape, a forward that needs every layer, uneven
growth) falls back to tracing every block, so the result is the full trace's or equal to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from lightning_accel.estimate.activations import StepActivations, measure_step

HEAD, TAIL = 2, 1
"""Blocks at a stack's ends that may differ from the rest: the first receives the embeddings, the
second what the first computes once and passes on (T5's position bias), the last hands its output
to the head (or to the next stack)."""
DEPTHS = (HEAD + TAIL + 1, HEAD + TAIL + 2, HEAD + TAIL + 3)
"""Blocks per stack in the three traces: one, two and three repeated blocks between the ends, so
that three depths show whether every figure grows evenly."""


def _parents(root: nn.Module, blocks: Sequence[tuple[str, nn.Module]]) -> dict[int, nn.Module] | None:
    """Each block's parent, when every block sits directly in an ``nn.ModuleList`` or ``nn.Sequential``."""
    modules = dict(root.named_modules())
    parents: dict[int, nn.Module] = {}
    for name, module in blocks:
        parent = modules.get(name.rpartition(".")[0])
        if type(parent) not in (nn.ModuleList, nn.Sequential):  # a subclass may iterate its own way
            return None
        parents[id(module)] = parent
    return parents


def _signature(module: nn.Module) -> tuple:
    return type(module), tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters())


@contextlib.contextmanager
def _cut(stacks: Sequence[tuple[nn.Module, list[str]]], depth: int) -> Iterator[None]:
    """Every stack holds only its first ``depth`` blocks (their keys and objects unchanged)."""
    saved = [parent._modules for parent, _keys in stacks]  # noqa: SLF001
    try:
        for parent, keys in stacks:
            parent._modules = {k: parent._modules[k] for k in keys[:depth]}  # noqa: SLF001
        yield
    finally:
        for (parent, _keys), modules in zip(stacks, saved):
            parent._modules = modules  # noqa: SLF001


def _extended(traces: Sequence[StepActivations], stacks: int, length: int) -> StepActivations | None:
    """The last of ``traces`` (at ``DEPTHS`` blocks a stack) at ``length`` blocks a stack, or None when the
    traces do not show even growth: within each stack the blocks between its ends (``HEAD`` first, ``TAIL``
    last) equal and its ends the same at every depth; each whole-step figure growing by one amount a block."""
    lists: dict[str, list[int]] = {}
    for field in ("kept", "inputs", "backward"):
        per_depth = [[getattr(t, field)[s * d : (s + 1) * d] for s in range(stacks)] for t, d in zip(traces, DEPTHS)]
        out: list[int] = []
        for s in range(stacks):
            parts = [stacks_at[s] for stacks_at in per_depth]
            head, tail, middle = parts[-1][:HEAD], parts[-1][len(parts[-1]) - TAIL :], parts[-1][HEAD]
            if any(p[:HEAD] != head or p[len(p) - TAIL :] != tail or set(p[HEAD : len(p) - TAIL]) != {middle} for p in parts):
                return None  # a stack's blocks do not repeat
            out += [*head, *[middle] * (length - HEAD - TAIL), *tail]
        lists[field] = out
    scalars: dict[str, int] = {}
    for field in ("peak", "before", "after", "head_backward"):
        values = [getattr(t, field) for t in traces]
        growth = {b - a for a, b in zip(values, values[1:])}
        if len(growth) != 1:
            return None
        scalars[field] = values[-1] + (length - DEPTHS[-1]) * growth.pop()
    return StepActivations(**scalars, **lists)


def measure_step_by_depth(
    step: Callable[[], object],
    root: nn.Module,
    blocks: Sequence[tuple[str, nn.Module]],
    params: Sequence[nn.Parameter],
    autocast: torch.dtype | None = None,
    checkpoint_blocks: bool = False,
) -> StepActivations:
    """:func:`~.activations.measure_step` of ``step`` over ``blocks`` (``(name, module)`` in ``root``),
    from three shallow traces when they extrapolate exactly (see the module doc), else the full trace."""
    modules = [m for _n, m in blocks]

    def full() -> StepActivations:
        return measure_step(step, modules, params, autocast, checkpoint_blocks)

    parents = _parents(root, blocks)
    if parents is None:
        return full()
    by_parent: dict[int, tuple[nn.Module, list[nn.Module]]] = {}
    for module in modules:
        parent = parents[id(module)]
        by_parent.setdefault(id(parent), (parent, []))[1].append(module)
    stacks = []
    for parent, members in by_parent.values():
        if list(parent._modules.values()) != members:  # noqa: SLF001 - the blocks are not the whole list
            return full()
        stacks.append((parent, list(parent._modules)))  # noqa: SLF001
    if modules != [m for _p, members in by_parent.values() for m in members]:
        return full()  # not stack after stack
    lengths = {len(keys) for _p, keys in stacks}
    if len(lengths) != 1 or (length := lengths.pop()) <= DEPTHS[-1]:
        return full()
    if any(len({_signature(m) for m in members[1:]}) != 1 for _p, members in by_parent.values()):
        return full()
    traces = []
    for depth in DEPTHS:
        shallow = [m for parent, keys in stacks for m in list(parent._modules.values())[:depth]]  # noqa: SLF001
        with _cut(stacks, depth):
            try:
                traces.append(measure_step(step, shallow, params, autocast, checkpoint_blocks))
            except Exception:  # noqa: BLE001 - a forward that needs every layer: trace them all
                return full()
    extended = _extended(traces, len(stacks), length)
    return extended if extended is not None else full()
