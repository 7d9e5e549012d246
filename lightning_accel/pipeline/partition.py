"""Partition of a model's blocks into pipeline stages.

The plan is plain data decided once: ``balance[s]`` is how many consecutive blocks
stage ``s`` runs. It comes from an explicit list, or from per-block costs (parameter
and buffer bytes for ``"by_size"``, or forward+backward seconds measured on a sample
for ``"by_time"``) split into contiguous stages so that the most loaded stage, which
sets the pipeline's pace, is as light as possible.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Union

import torch
from torch import Tensor, nn

from lightning_accel.pipeline.microbatch import map_tensors, tensors_in

__all__ = [
    "Balance",
    "balance_by_cost",
    "block_bytes",
    "check_balance",
    "profile_block_times",
    "stage_of_block",
]

Balance = Union[Sequence[int], str]


def check_balance(balance: Sequence[int], num_blocks: int, num_devices: int) -> list[int]:
    """Validate an explicit balance against the block and device counts; return it as a list."""
    balance = list(balance)
    if not balance or any(not isinstance(b, int) or b < 1 for b in balance):
        raise ValueError(f"balance must be a non-empty list of positive ints (blocks per stage), got {balance}")
    if sum(balance) != num_blocks:
        raise ValueError(
            f"the balance does not cover the model's blocks (blocks: {num_blocks}, sum of balance {balance}: "
            f"{sum(balance)}); give a balance that sums to {num_blocks}, or balance='by_size'"
        )
    if len(balance) > num_devices:
        raise ValueError(
            f"the balance has {len(balance)} stages but only {num_devices} devices were given; "
            f"list one device per stage (devices=[...] of length {len(balance)}) or use fewer stages"
        )
    return balance


def balance_by_cost(costs: Sequence[float], stages: int) -> list[int]:
    """Split ``costs`` (one per block, in order) into ``stages`` contiguous non-empty groups
    minimising the largest group sum (the slowest stage sets the pipeline's pace).

    Exact dynamic programme, O(stages * n^2): n is a block count, so this is instant.
    """
    n = len(costs)
    if stages < 1:
        raise ValueError(f"the number of stages must be >= 1, got {stages}")
    if stages > n:
        raise ValueError(f"cannot split {n} blocks into {stages} stages: each stage needs a block; use at most {n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: the smallest max-load splitting the first i blocks into s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                load = max(best[s - 1][j], prefix[i] - prefix[j])
                if load < best[s][i]:
                    best[s][i], cut[s][i] = load, j
    balance: list[int] = []
    i = n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        balance.append(i - j)
        i = j
    return balance[::-1]


def block_bytes(blocks: Sequence[nn.Module]) -> list[int]:
    """Bytes of each block's parameters and buffers: the ``"by_size"`` cost."""
    return [
        sum(t.numel() * t.element_size() for t in (*b.parameters(), *b.buffers()))
        for b in blocks
    ]


class _Captured(BaseException):
    """Stops the sample forward once every block's input is captured (a BaseException, so a user's
    ``except Exception`` around the forward cannot swallow it)."""


def _leaves(value: Any, device: torch.device | None = None) -> Any:
    """``value`` with every tensor detached (floating ones requiring grad, as a stage's input does), on ``device`` if given."""

    def leaf(t: Tensor) -> Tensor:
        t = t if device is None else t.to(device)
        return t.detach().requires_grad_(t.is_floating_point())

    return map_tensors(value, leaf)


def _block_inputs(blocks: Sequence[nn.Module], forward: Callable[[], object]) -> list[tuple[tuple, dict]]:
    """The ``(args, kwargs)`` each block is first called with while ``forward()`` runs, without grad,
    stopped as the last block is about to run (so the loss and what follows it never run)."""
    inputs: dict[int, tuple[tuple, dict]] = {}

    def capture(k: int) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            inputs.setdefault(k, (args, kwargs))
            if k == len(blocks) - 1:
                raise _Captured

        return hook

    handles = [b.register_forward_pre_hook(capture(k), with_kwargs=True) for k, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            forward()
    except _Captured:
        pass
    finally:
        for h in handles:
            h.remove()
    missing = [k for k in range(len(blocks)) if k not in inputs]
    if missing:
        raise ValueError(
            f"balance='by_time' ran the model on a sample but block(s) {missing} of {len(blocks)} were never called; "
            "every block must run on every batch to be timed; pass an explicit balance (blocks per stage) "
            "or balance='by_size'"
        )
    return [inputs[k] for k in range(len(blocks))]


def _synchronize(tensors: Sequence[Tensor]) -> None:
    for index in sorted({t.device.index or 0 for t in tensors if t.is_cuda}):
        torch.cuda.synchronize(index)


def profile_block_times(
    net: nn.Module,
    blocks: Sequence[nn.Module],
    forward: Callable[[], object],
    repeat: int = 5,
    device: torch.device | str | None = None,
) -> list[float]:
    """Seconds of forward + backward of each block on the input it gets when ``forward()`` runs ``net`` on a sample.

    The ``"by_time"`` cost, for any model whose blocks the block policy found: ``forward``
    runs the model once on a sample (``lambda: net(x)``, or a ``training_step`` on one
    micro-batch); it is stopped just before the last block, so neither the loss nor what
    follows it (logging) runs. Each block is then timed alone from its captured input,
    forward and backward (as a stage runs it), the best of ``repeat`` rounds over all
    blocks, so a stall (a noisy neighbour) does not move a stage boundary. Call it under
    the autocast context training uses, so the times are those of training.

    ``device``: time each block there rather than where it is. ``forward`` still runs where
    the model is (to capture the inputs); then each block, with its input, moves to
    ``device`` for its measurement and back, so the whole model never has to fit there: a
    pipeline stage's device, timed before the model is split.

    Leaves no trace: ``net``'s buffers (BatchNorm statistics), every parameter's ``.grad``
    and the RNG state are what they were.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    tensors = [*net.parameters(), *net.buffers()]
    target = None if device is None else torch.device(device)
    cuda = sorted({t.device.index or 0 for t in tensors if t.is_cuda} | ({target.index or 0} if target and target.type == "cuda" else set()))
    grads = {p: p.grad for p in net.parameters()}
    buffers = [(b, b.detach().clone()) for b in net.buffers()]
    for p in grads:
        p.grad = None  # backward below would accumulate into the user's gradients in place
    times = [float("inf")] * len(blocks)
    try:
        with torch.random.fork_rng(devices=cuda):  # dropout in the sample runs must not shift training's masks
            inputs = _block_inputs(blocks, forward)
            for _ in range(repeat):  # round by round, so a stall that lasts a while costs each block one round
                for k, (block, (args, kwargs)) in enumerate(zip(blocks, inputs)):
                    home = next((t.device for t in (*block.parameters(), *block.buffers())), None)
                    if target is not None:
                        block.to(target)
                    try:
                        a, kw = _leaves(args, target), _leaves(kwargs, target)
                        _synchronize([*tensors_in(a), *tensors_in(kw)])
                        start = time.perf_counter()
                        out = [t for t in tensors_in(block(*a, **kw)) if t.requires_grad]
                        if out:
                            torch.autograd.backward(out, [torch.ones_like(t) for t in out])
                        _synchronize(out)
                        times[k] = min(times[k], time.perf_counter() - start)
                        del a, kw, out  # freed here, not inside the next block's measurement
                    finally:
                        if target is not None and home is not None:
                            block.to(home)
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads.items():
            p.grad = g
    return times


def stage_of_block(balance: Sequence[int]) -> list[int]:
    """For each block, the stage that runs it: ``[2, 1] -> [0, 0, 1]``."""
    return [s for s, count in enumerate(balance) for _ in range(count)]
