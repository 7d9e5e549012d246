"""Part 2 of ``bench pipeline``: activation memory against micro-batches, on one process.

Peak bytes allocated during one step (activations, their recomputation and the gradients)
of the MLP through :class:`LocalPipeline` with ``always`` checkpointing for growing M,
against no micro-batching and no checkpointing, and the time each costs. The model is
one stage, so ``always`` keeps only the stage's input per micro-batch and backward
recomputes one micro-batch of the whole stage at a time: the peak falls with M (GPipe's
O(N + L/K * N/M)); at M=1 it recomputes the whole batch at once and saves little. On the
CPU the bytes come from the profiler's allocation events; on CUDA from the allocator's peak.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from lightning_accel.bench import format_table, machine_line
from lightning_accel.benchmarks.pipeline_workload import step_times, workload
from lightning_accel.models import MLP
from lightning_accel.models.block_policy import find_blocks
from lightning_accel.pipeline.local import LocalPipeline, checkpoint_stop
from lightning_accel.pipeline.microbatch import scatter

__all__ = ["memory_rows", "print_memory"]


def _model(depth: int, hidden: int, batch: int) -> tuple[MLP, torch.Tensor, torch.Tensor]:
    """The memory table's MLP and batch."""
    return workload("mlp", depth, hidden, batch).build()  # type: ignore[return-value]


def _peak_bytes(fn) -> int:
    """Peak bytes allocated while ``fn`` runs (CUDA allocator peak, or the CPU profiler's allocation events)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def memory_rows(args: argparse.Namespace, chunk_values: list[int]) -> list[list[object]]:
    """One row per setting: M=1 without checkpointing, then ``always`` for each M in ``chunk_values``."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows: list[list[object]] = []
    baseline: tuple[int, float] | None = None
    for chunks, mode in [(1, "never"), *((m, "always") for m in chunk_values)]:
        net, x, y = _model(args.depth, args.memory_hidden, args.memory_batch)
        net, x, y = net.to(device), x.to(device), y.to(device)
        pipe = LocalPipeline(net, find_blocks(net), [args.depth], [device], checkpoint_stop(mode, chunks))
        pipe.place()

        def step(pipe=pipe, net=net, chunks=chunks) -> None:
            net.zero_grad(set_to_none=True)
            losses = []
            for i, (xb, yb) in enumerate(scatter((x, y), chunks)):
                with pipe.microbatch(i):
                    losses.append(F.mse_loss(net(xb), yb) * (xb.size(0) / x.size(0)))
            sum(losses).backward()

        seconds = statistics.median(step_times(step, args.steps * args.rounds))
        net.zero_grad(set_to_none=True)
        # the larger of two profiled steps: the CPU profiler's allocation events now and then miss some (a whole-suite
        # run read 1.342 MiB for M=1 with checkpointing against 2.115 alone, every other row the same)
        peak = max(_peak_bytes(step) for _ in range(2))
        baseline = baseline or (peak, seconds)
        rows.append([f"M={chunks}, checkpoint={mode}", peak / 2**20, peak / baseline[0], seconds * 1e3, seconds / baseline[1]])
    return rows


def print_memory(args: argparse.Namespace, memory: list[list[object]]) -> None:
    grads = sum(p.numel() * p.element_size() for p in _model(args.depth, args.memory_hidden, 1)[0].parameters())
    print(f"one process, MLP depth {args.depth} as one stage, hidden {args.memory_hidden}, batch {args.memory_batch}, "
          f"1 thread: peak bytes allocated during a step (activations, their recomputation, and {grads / 2**20:.1f} MiB "
          f"of gradients), after 2 warm-up steps; time: median of {args.steps * args.rounds} steps:")
    print(format_table(["setting", "peak MiB", "vs M=1 never", "ms/step", "time vs M=1 never"], memory))
    print(machine_line())
