"""``lightning-accel bench pipeline --schedules``: every pipeline schedule on one workload of known cost.

Each block of the workload sleeps a fixed time per micro-batch in its forward (``f``), in the
input-gradient half of its backward (``i``) and in the weight-gradient half (``w``); its
matrix products are small beside that. So a rank's work per step is known,
``M x blocks per rank x (f + i + w)``, whatever the schedule, and

- the measured bubble is idle time: ``1 - busy / step``, ``busy`` the wall time the rank with the
  most of it spent in its blocks' f, i and w that step (:class:`BusyClock`, each sleep timed as it
  ran). A sleep wakes late (~1 ms here) and torch's runtime runs around each action; that time is
  the rank's work overshooting, not a bubble: no schedule can fill it, the zero-bubble ones pay it
  too. The busiest rank, since the step can be no shorter than its busy time: what is left is
  what a better order could win back, while the other rank's extra idle time (its sleeps woke
  sooner) is no bubble of the schedule's. ``1 - nominal work / step`` (the work at the nominal
  costs, ``M x blocks per rank x (f + i + w)``) is printed beside it, as it was measured before:
  it counts the overshoot as bubble;
- the ideal bubble is the same figure for the schedule's own order of actions (torch's
  ``pipeline_order`` for the looped and V-shaped schedules, :func:`lightning_accel.pipeline.schedule.gpipe_order`
  and ``one_f_one_b_order`` for the others) run with those costs and free communication
  (:func:`ideal_step`);
- the peak activation memory is the most bytes saved for backward alive at once on a rank
  (``torch.autograd.graph.saved_tensors_hooks``), which counts what the schedule keeps for
  every micro-batch in flight, split backwards included.

Sleeping blocks make the table repeatable on a loaded machine: a sleep takes no core.
The block cost (``--block-ms``, default :data:`TABLE_BLOCK_MS`) sets what the sends weigh
against: the time each rank spends sending, receiving and in the schedule's own code is
about fixed per step, so at small costs it is as large as the bubble the zero-bubble
schedules fill, and at a real model's cost it is small beside it.
Each schedule runs raw ``torch.distributed.pipelining`` (its class over the stages cut by
hand) and :class:`lightning_accel.pipeline.distributed.RankPipeline` on the same blocks,
their steps interleaved; "vs raw" is the median of per-step ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_accel.bench import format_table, machine_line
from lightning_accel.benchmarks.two_ranks import rank_result, run_two_ranks
from lightning_accel.pipeline.schedule import SCHEDULE_TABLE, SCHEDULES
from lightning_accel.pipeline.schedule_clock import schedule_orders, step_time

__all__ = ["TABLE_BLOCK_MS", "BusyClock", "SleepNet", "ideal_step", "picture", "run_schedules"]

TABLE_BLOCK_MS = 25.0
"""Default ms per block and micro-batch in each of forward, input gradient and weight gradient: about a real
pipelined model's block, so that sending a micro-batch's activation weighs what it does there. A Llama-2-7B
decoder layer (202M parameters) on a micro-batch of 4 x 2048 tokens does ~3.6 TFLOP in forward and twice that in
backward: ~26 ms each for forward, input gradient and weight gradient at 140 TFLOP/s (an A100 at 45% of its bf16
peak). Its activation (64 MiB in bf16) takes ~0.3 ms over NVLink, ~3 ms over 200 Gb/s InfiniBand: 1-10% of the
block's forward. Here 1f1b measures ~40-60 ms per step over its ideal whatever the block cost (sends, torch's
runtime, sleeps waking ~1 ms late): 3-5% of the step at 25 ms, 15-20% at 5 ms, where it is as large as the
bubble the zero-bubble schedules fill (docs/pipeline.md has the tables at 5, 15, 25 and 50 ms)."""


class BusyClock:
    """Seconds a process's sleeping blocks spent in their f, i and w, each sleep timed on the wall clock as it ran.

    The work a rank actually did, not the nominal cost asked: a sleep that wakes late kept the rank from any other
    action, so the bench counts it as busy, not as bubble. :meth:`take` returns the seconds since the last take."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _sleep(seconds: float, clock: BusyClock | None) -> None:
    if seconds > 0:  # time.sleep(0) is no free call: on a loaded machine it gives the core away (~1 ms back)
        start = time.perf_counter()
        time.sleep(seconds)
        if clock is not None:
            clock.seconds += time.perf_counter() - start


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in forward and ``backward_s`` in backward, timed on ``clock``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, forward_s: float, backward_s: float, clock: BusyClock | None) -> Tensor:
        _sleep(forward_s, clock)
        ctx.backward_s, ctx.clock = backward_s, clock
        return x.view_as(x)  # no copy: a weight passed through stays the weight's storage (not an activation)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        _sleep(ctx.backward_s, ctx.clock)
        return grad, None, None, None


class SleepBlock(nn.Module):
    """``tanh(x @ W)``, with ``f`` seconds in forward, ``i`` in the input gradient and ``w`` in the weight gradient.

    ``rows``: when set, those times are for a micro-batch of ``rows`` rows and scale with its rows, plus ``overhead``
    seconds per action (what a real stage's time looks like: a part per row, a part per call); unset, fixed.

    The pipeline's raw input needs no gradient, so on the first block the input-gradient sleep would never run and
    the rank holding stage 0 would compute ``M x i`` less than the other (1f1b's ideal one ``i`` per step below
    its column). There ``i`` is slept on the weight's backward instead: every block pays ``f``, ``i`` and ``w``
    per micro-batch, as a real first block does (its input gradient feeds the embedding's weight gradient). In
    torch's stage 0 it changes no order: a first stage's split backward runs whole at its W.

    ``clock``: where each sleep adds its wall time (the block's own when not given)."""

    def __init__(self, hidden: int, f: float, i: float, w: float, clock: BusyClock | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5)
        self.f, self.i, self.w = f, i, w
        self.clock = BusyClock() if clock is None else clock
        self.rows: int | None = None
        self.overhead = 0.0

    def forward(self, x: Tensor) -> Tensor:
        k, o = (x.shape[0] / self.rows if self.rows else 1.0), self.overhead
        i = o + self.i * k
        if x.requires_grad:  # (rows, hidden): its backward is on the input-gradient path
            h, w = _Sleep.apply(x, o + self.f * k, i, self.clock), o + self.w * k
        else:  # the first block: no input gradient to compute, its cost paid beside the weight's
            h, w = _Sleep.apply(x, o + self.f * k, 0.0, self.clock), i + o + self.w * k
        weight = _Sleep.apply(self.weight, 0.0, w, self.clock)  # its backward is on the weight-gradient path only
        return torch.tanh(h @ weight)


class SleepNet(nn.Module):
    """``depth`` :class:`SleepBlock` in a row, all timing their sleeps on one :attr:`clock` (the process's busy time:
    in a pipeline each rank runs only its own blocks)."""

    def __init__(self, depth: int, hidden: int, f: float, i: float, w: float) -> None:
        super().__init__()
        self.clock = BusyClock()
        self.blocks = nn.ModuleList(SleepBlock(hidden, f, i, w, self.clock) for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _orders(name: str, ranks: int, chunks: int, schedule: Any = None) -> dict[int, list[tuple[str, int, int]]]:
    """Per rank, its actions in order as (kind, stage, micro-batch), kind in F, I, W, B (a whole backward)
    (:func:`lightning_accel.pipeline.schedule_clock.schedule_orders`; ``schedule``: unused, torch's order is rebuilt)."""
    return schedule_orders(name, ranks, chunks)


def ideal_step(
    orders: dict[int, list[tuple[str, int, int]]], stages: int, cost: dict[str, float],
    starts: dict[int, list[tuple[float, str, int, int]]] | None = None,
) -> float:
    """Seconds the per-rank ``orders`` take with ``cost`` per action kind (every stage alike) and free communication:
    :func:`lightning_accel.pipeline.schedule_clock.step_time`, the clock ``schedule="auto"`` predicts with."""
    return step_time(orders, stages, lambda kind, _stage: cost[kind], starts)


@contextmanager
def _activation_meter(peak: list[int], weights: set[int]) -> Iterator[None]:
    """Bytes saved for backward alive at once: ``peak[0]`` the most, ``peak[1]`` now; tensors on the storage of
    ``weights`` (data pointers) are not activations."""

    class Held:
        def __init__(self, t: Tensor) -> None:
            self.t = t

    def pack(t: Tensor) -> Any:
        if isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in weights:
            return t  # a weight is not an activation
        held, n = Held(t), t.numel() * t.element_size()
        peak[1] += n
        peak[0] = max(peak[0], peak[1])
        weakref.finalize(held, lambda: peak.__setitem__(1, peak[1] - n))  # freed with the graph's saved tensors
        return held

    def unpack(h: Any) -> Tensor:
        return h if isinstance(h, Tensor) else h.t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _worker(args: Any) -> None:
    """One of the 2 ranks: per schedule, interleaved steps of raw torch and RankPipeline; rank 0 prints the result."""
    from torch.distributed.pipelining import PipelineStage

    from lightning_accel.pipeline.distributed import RankPipeline, stage_indices

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, ranks = dist.get_rank(), dist.get_world_size()
    f, i, w = args.cost_f / 1e3, args.cost_i / 1e3, args.cost_w / 1e3
    results: dict[str, Any] = {}
    for name in args.schedule_names:
        spec = SCHEDULE_TABLE[name]
        stages = spec.stages_per_rank * ranks
        per = args.depth // stages
        balance = [per] * stages
        torch.manual_seed(0)
        x, y = torch.randn(args.rows, args.width), torch.randn(args.rows, args.width)
        # raw: the stages cut by hand, the loss on the last one's output
        torch.manual_seed(0)
        raw_net = SleepNet(args.depth, args.width, f, i, w)
        mine = stage_indices(rank, ranks, name)
        raw_stages = [
            PipelineStage(nn.Sequential(*raw_net.blocks[s * per:(s + 1) * per]), s, stages, torch.device("cpu"))
            for s in mine
        ]
        raw_schedule = spec.build(raw_stages, n_microbatches=args.chunks, loss_fn=F.mse_loss)
        raw_opt = torch.optim.SGD(raw_net.parameters(), lr=1e-3)
        first, last = 0 in mine, stages - 1 in mine

        def raw() -> None:
            raw_opt.zero_grad(set_to_none=True)
            kwargs = {"target": y} if last else {}
            raw_schedule.step(*((x,) if first else ()), **kwargs)
            raw_opt.step()

        torch.manual_seed(0)
        net = SleepNet(args.depth, args.width, f, i, w)
        pipe = RankPipeline(net, balance, args.chunks, schedule=name)
        opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        xs, ys = x.chunk(args.chunks), y.chunk(args.chunks)

        def ours() -> None:
            opt.zero_grad(set_to_none=True)
            pipe.train_step(lambda k: F.mse_loss(net(xs[k]), ys[k]))
            opt.step()

        weights = {p.untyped_storage().data_ptr() for p in [*raw_net.parameters(), *net.parameters()]}
        times: dict[str, list[float]] = {"raw": [], "ours": []}
        busy: dict[str, list[float]] = {"raw": [], "ours": []}  # this rank's seconds in its blocks' sleeps, per step
        peaks = {"raw": [0, 0], "ours": [0, 0]}
        steps = {"raw": raw, "ours": ours}
        clocks = {"raw": raw_net.clock, "ours": net.clock}
        for k in range(2 + args.steps):
            for who in ("raw", "ours") if k % 2 else ("ours", "raw"):
                dist.barrier()
                start = time.perf_counter()
                clocks[who].take()
                # metered after the warm-up (torch's shape inference at the first step runs an extra micro-batch)
                with _activation_meter(peaks[who] if k >= 2 else [0, 0], weights):
                    steps[who]()
                dist.barrier()
                if k >= 2:
                    times[who].append(time.perf_counter() - start)
                    busy[who].append(clocks[who].take())
        all_peaks: list[Any] = [None] * ranks
        dist.all_gather_object(all_peaks, {who: p[0] for who, p in peaks.items()})
        all_busy: list[Any] = [None] * ranks
        dist.all_gather_object(all_busy, busy)
        orders = _orders(name, ranks, args.chunks, raw_schedule)
        results[name] = {"times": times, "busy": all_busy, "peaks": all_peaks, "orders": {str(r): o for r, o in orders.items()}, "per": per}
        pipe.restore()
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown with gloo groups still referenced (see benchmarks.pipeline._worker)


def _launch(args: Any) -> dict[str, Any]:
    outputs = run_two_ranks(["-m", "lightning_accel.benchmarks.pipeline_schedules", json.dumps(vars(args))], args.timeout)
    return rank_result(outputs[0])


def run_schedules(args: Any) -> int:
    """Print the table: one row per schedule of ``args.schedules`` ("all" or a comma-separated list)."""
    names = list(SCHEDULES) if args.schedules == "all" else args.schedules.split(",")
    unknown = [n for n in names if n not in SCHEDULE_TABLE]
    if unknown:
        raise SystemExit(f"--schedules {args.schedules}: unknown {unknown}; choose 'all' or from {', '.join(SCHEDULES)}")
    depth = args.schedule_depth
    if depth % 4 or args.chunks < 4 or args.schedule_rows % args.chunks:
        raise SystemExit(f"--schedule-depth {depth} / --chunks {args.chunks} / --schedule-rows {args.schedule_rows}: need "
                         "depth a multiple of 4 (2 ranks x 2 stages), chunks >= 4 and rows divisible by chunks")
    job = type("Job", (), {})()
    job.__dict__.update(schedule_names=names, depth=depth, width=args.schedule_width, rows=args.schedule_rows,
                        chunks=args.chunks, steps=args.steps, cost_f=args.cost_f, cost_i=args.cost_i,
                        cost_w=args.cost_w, timeout=args.timeout)
    results = _launch(job)
    f, i, w = args.cost_f / 1e3, args.cost_i / 1e3, args.cost_w / 1e3
    work = args.chunks * depth // 2 * (f + i + w)  # seconds one rank computes per step, whatever the schedule
    rows: list[list[object]] = []
    for name in names:
        r = results[name]
        per = r["per"]
        cost = {"F": per * f, "I": per * i, "W": per * w, "B": per * (i + w)}
        stages = SCHEDULE_TABLE[name].stages_per_rank * 2
        ideal = ideal_step({int(k): [tuple(a) for a in v] for k, v in r["orders"].items()}, stages, cost)
        raw, ours = statistics.median(r["times"]["raw"]), statistics.median(r["times"]["ours"])
        ratio = statistics.median(a / b for a, b in zip(r["times"]["raw"], r["times"]["ours"]))
        mb = " / ".join(f"{p['ours'] / 2**20:.2f}" for p in r["peaks"])
        busy = " / ".join(f"{statistics.median(b['ours']):.3f}" for b in r["busy"])
        rows.append([name, raw, ours, ratio, _bubble(_busiest(r, "raw"), raw), _bubble(_busiest(r, "ours"), ours),
                     _bubble(work, ours), _bubble(work, ideal), ideal, busy, mb])
    print(f"schedules on 2 ranks (gloo, 1 thread each), M={args.chunks}, {depth} sleeping blocks of width "
          f"{args.schedule_width} (per block and micro-batch: forward {args.cost_f:g} ms, input gradient "
          f"{args.cost_i:g} ms, weight gradient {args.cost_w:g} ms; {work * 1e3:.0f} ms of nominal work per rank and step); "
          f"median of {args.steps} steps, raw torch and RankPipeline interleaved")
    print(format_table(
        ["schedule", "raw torch s/step", "ours s/step", "vs raw", "raw bubble idle", "ours bubble idle",
         "ours 1 - nominal work/step", "bubble ideal", "ideal s/step", "ours busy s/step (rank 0 / 1)",
         "peak activations MiB (rank 0 / 1)"], rows,
    ))
    by = {row[0]: row for row in rows}
    if "1f1b" in by:
        base = by["1f1b"]
        idle_s = base[2] * base[5]  # type: ignore[operator]
        nominal_s = base[2] * base[6]  # type: ignore[operator]
        for name in ("interleaved_zb", "zbv", "dualpipev"):
            if name in by:
                gain = base[2] - by[name][2]  # type: ignore[operator]
                ideal_gain = base[8] - by[name][8]  # type: ignore[operator]
                verdict = "met" if gain >= idle_s / 2 else "NOT met"
                print(f"{name}: {gain * 1e3:.1f} ms below 1f1b's step ({ideal_gain * 1e3:.1f} ms with free "
                      f"communication); target >= half of 1f1b's idle bubble ({idle_s / 2 * 1e3:.1f} ms; half of its "
                      f"1 - nominal work/step: {nominal_s / 2 * 1e3:.1f} ms): {verdict}")
    worst = min(rows, key=lambda row: row[3])  # type: ignore[arg-type, return-value]
    print(f"every row vs raw torch on the same schedule: lowest {worst[3]:.3f}x ({worst[0]}); target >= 0.95x: "
          f"{'met' if worst[3] >= 0.95 else 'NOT met'}")  # type: ignore[operator]
    for name in names if f > 0 else ():  # a timeline's column is half a forward
        if SCHEDULE_TABLE[name].stages_per_rank > 1:
            r = results[name]
            per = r["per"]
            cost = {"F": per * f, "I": per * i, "W": per * w, "B": per * (i + w)}
            orders = {int(k): [tuple(a) for a in v] for k, v in r["orders"].items()}
            print(f"\n{name}, the schedule's order with the costs above and free communication (one column: "
                  f"{per * f * 1e3 / 2:g} ms):")
            print(picture(orders, 4, cost, per * f / 2))  # type: ignore[arg-type]
    print(machine_line())
    return 0


def _bubble(work: float, step: float) -> float:
    """``1 - work / step``; NaN for a step of no time (``--block-ms 0``: the ideal of no work)."""
    return 1 - work / step if step > 0 else float("nan")


def _busiest(result: dict[str, Any], who: str) -> float:
    """Median over the steps of the most seconds any rank was busy in the step (its blocks' sleeps as they ran).

    The busiest rank bounds the step from below; its idle time is what a schedule could fill, while another rank's
    extra idle time is only its sleeps having woken sooner. The median of busy time against the median step, as the
    nominal column's, so the idle bubble is never above ``1 - nominal work / step``: no sleep ends early."""
    per_step = zip(*(rank[who] for rank in result["busy"]))
    return statistics.median(max(ranks) for ranks in per_step)


def picture(orders: dict[int, list[tuple[str, int, int]]], stages: int, cost: dict[str, float], unit: float) -> str:
    """Text timeline of ``orders`` run as :func:`ideal_step` runs them: per rank one line, each action drawn as its kind
    and micro-batch over its length in ``unit`` columns (F3 = forward of micro-batch 3; B a whole backward, I and W its
    input- and weight-gradient halves; lower case: the rank's second stage), ``.`` idle."""
    starts: dict[int, list[tuple[float, str, int, int]]] = {}
    ideal_step(orders, stages, cost, starts)
    lines = []
    for rank in sorted(starts):
        mine = sorted({s for _, _, s, _ in starts[rank]})
        row: list[str] = []
        for start, kind, s, m in sorted(starts[rank]):
            at = round(start / unit)
            row += ["."] * (at - len(row))
            label = (kind if s == mine[0] else kind.lower()) + str(m)
            width = round(cost[kind] / unit)
            row += list(label.ljust(width, "-"))[:width] if width >= len(label) else list(label[:width])
        lines.append(f"rank {rank}: " + "".join(row))
    return "\n".join(lines)


if __name__ == "__main__":
    from types import SimpleNamespace

    _worker(SimpleNamespace(**json.loads(sys.argv[1])))
