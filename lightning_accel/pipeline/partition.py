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
from typing import Union

import torch
from torch import Tensor, nn

__all__ = ["Balance", "balance_by_cost", "block_bytes", "check_balance", "profile_times", "stage_of_block"]

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


def profile_times(blocks: Sequence[Callable[[Tensor], Tensor]], sample: Tensor, repeat: int = 2) -> list[float]:
    """Seconds each block takes for forward and backward on ``sample`` (fed block to block).

    The ``"by_time"`` cost: the best of ``repeat`` runs per block, so a one-off stall
    (allocation, a noisy neighbour) does not move a stage boundary.
    """
    times: list[float] = []
    x = sample
    for block in blocks:
        best = float("inf")
        for _ in range(repeat):
            inp = x.detach().requires_grad_(x.is_floating_point())
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            start = time.perf_counter()
            out = block(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            best = min(best, time.perf_counter() - start)
        times.append(best)
        x = out.detach()
    for block in blocks:
        if isinstance(block, nn.Module):
            block.zero_grad(set_to_none=True)  # profiling must leave no gradients behind
    return times


def stage_of_block(balance: Sequence[int]) -> list[int]:
    """For each block, the stage that runs it: ``[2, 1] -> [0, 0, 1]``."""
    return [s for s, count in enumerate(balance) for _ in range(count)]
