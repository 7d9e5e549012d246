"""``lightning-accel bench pipeline --schedules auto``: ``schedule="auto"`` against every hand-set choice it could make.

The workload is the schedule table's (:mod:`lightning_accel.benchmarks.pipeline_schedules`): blocks that
sleep a known time in forward, input gradient and weight gradient; here that time is given for a
micro-batch of ``--chunks`` and scales with a micro-batch's rows, plus ``--overhead`` ms per action
(a real stage's time has a part per row and a part per call: more micro-batches shrink the bubble
and add calls, so the best count is inside the range, not at its end). ``--skew X`` makes the blocks of the
start schedule's last stage sleep X times as long (one stage X times slower). On 2 gloo ranks:

- the sweep: every candidate ``auto`` considers (each schedule of the start's placement x each
  ``chunks`` up to ``--auto-max-chunks`` dividing ``--schedule-rows``), each run on its own
  :class:`~lightning_accel.pipeline.distributed.RankPipeline` for 1 warm-up and ``--steps`` timed steps;
- ``auto``: a fresh pipeline at the start, driven by :class:`~lightning_accel.pipeline.schedule_tuner.ScheduleTuner`
  through its measurement and its one switch, then ``--steps`` timed steps of what it chose.

The verdict: auto's median step after the switch against the sweep's best median (target: within 5%).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_accel.bench import format_table, machine_line
from lightning_accel.benchmarks.pipeline_schedules import SleepNet
from lightning_accel.benchmarks.two_ranks import rank_result, run_two_ranks
from lightning_accel.pipeline.auto_schedule import AutoSchedule, candidates
from lightning_accel.pipeline.schedule import SCHEDULE_TABLE

__all__ = ["run_auto"]


def _net(args: Any, start: str) -> SleepNet:
    torch.manual_seed(0)
    net = SleepNet(args.depth, args.width, args.cost_f / 1e3, args.cost_i / 1e3, args.cost_w / 1e3)
    stages = SCHEDULE_TABLE[start].stages_per_rank * 2
    for block in net.blocks:  # the costs given are those of a micro-batch at --chunks, scaled by rows, + the overhead
        block.rows, block.overhead = args.rows // args.chunks, args.overhead / 1e3
    for block in net.blocks[args.depth - args.depth // stages:]:  # the start's last stage, X times slower
        block.f, block.i, block.w = block.f * args.skew, block.i * args.skew, block.w * args.skew
        block.overhead *= args.skew
    return net


def _pipe(args: Any, start: str, name: str, chunks: int) -> tuple[Any, Any, Any]:
    from lightning_accel.pipeline.distributed import RankPipeline

    net = _net(args, start)
    stages = SCHEDULE_TABLE[name].stages_per_rank * 2
    pipe = RankPipeline(net, [args.depth // stages] * stages, chunks, schedule=name)
    return net, pipe, torch.optim.SGD(pipe.parameters(), lr=1e-3)


def _step(net: Any, pipe: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    xs, ys = x.chunk(pipe.chunks), y.chunk(pipe.chunks)
    dist.barrier()
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    pipe.train_step(lambda k: F.mse_loss(net(xs[k]), ys[k]))
    opt.step()
    dist.barrier()
    return time.perf_counter() - start


def _worker(args: Any) -> None:
    """One of the 2 ranks: the sweep, then auto, per start; rank 0 prints the result."""
    from lightning_accel.pipeline.schedule_tuner import ScheduleTuner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    x, y = torch.randn(args.rows, args.width), torch.randn(args.rows, args.width)
    results: dict[str, Any] = {}
    for start in args.starts:
        stages = SCHEDULE_TABLE[start].stages_per_rank * 2
        sweep = {}
        for name, chunks in candidates(start, args.rows, stages, args.max_chunks):
            net, pipe, opt = _pipe(args, start, name, chunks)
            times = [_step(net, pipe, opt, x, y) for _ in range(1 + args.steps)][1:]
            sweep[f"{name}/{chunks}"] = statistics.median(times)
            pipe.restore()
        net, pipe, opt = _pipe(args, start, start, args.chunks)
        tuner, probe = ScheduleTuner(pipe, AutoSchedule(start, args.auto_steps, max_chunks=args.max_chunks)), 0
        while not tuner.done:
            tuner.before_step(args.rows)
            tuner.after_step(_step(net, pipe, opt, x, y))
            probe += 1
        after = [_step(net, pipe, opt, x, y) for _ in range(1 + args.steps)][1:]  # the first: the chosen's warm-up
        assert tuner.choice is not None
        results[start] = {"sweep": sweep, "auto": statistics.median(after), "probe_steps": probe,
                          "report": tuner.choice.report(), "chosen": list(tuner.choice.chosen)}
        pipe.restore()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as benchmarks.pipeline_schedules._worker: skip the teardown with gloo groups still referenced


def run_auto(args: Any) -> int:
    """Print, per ``--auto-start``, the sweep's rows, auto's row and the verdict."""
    starts = args.auto_start.split(",")
    unknown = [s for s in starts if s not in SCHEDULE_TABLE]
    if unknown or args.schedule_depth % 4 or args.schedule_rows % args.chunks:
        raise SystemExit(f"--auto-start {args.auto_start} / --schedule-depth {args.schedule_depth} / --chunks {args.chunks}: "
                         "need known schedules, depth a multiple of 4 and rows divisible by chunks")
    job = dict(starts=starts, depth=args.schedule_depth, width=args.schedule_width, rows=args.schedule_rows,
               chunks=args.chunks, steps=args.steps, cost_f=args.cost_f, cost_i=args.cost_i, cost_w=args.cost_w,
               skew=args.skew, overhead=args.overhead, max_chunks=args.auto_max_chunks, auto_steps=args.auto_steps)
    outputs = run_two_ranks(["-m", "lightning_accel.benchmarks.pipeline_auto", json.dumps(job)], args.timeout)
    results = rank_result(outputs[0])
    print(f"schedule='auto' on 2 ranks (gloo, 1 thread each), {args.schedule_depth} sleeping blocks, "
          f"{args.schedule_rows} rows per step; per block and micro-batch: forward {args.cost_f:g} ms, input gradient "
          f"{args.cost_i:g} ms, weight gradient {args.cost_w:g} ms at chunks={args.chunks}, scaled by rows, + "
          f"{args.overhead:g} ms per action; the start's last stage x{args.skew:g}; "
          f"median of {args.steps} steps per row")
    for start in starts:
        r = results[start]
        best = min(r["sweep"], key=r["sweep"].get)
        rows: list[list[object]] = [[k, v, v / r["sweep"][best]] for k, v in sorted(r["sweep"].items(), key=lambda kv: kv[1])]
        rows.append([f"auto -> {'/'.join(map(str, r['chosen']))}", r["auto"], r["auto"] / r["sweep"][best]])
        print(f"\nstart {start}/chunks={args.chunks}:")
        print(format_table(["setting", "s/step", "vs best hand-set"], rows))
        ratio = r["auto"] / r["sweep"][best]
        print(f"auto {ratio:.3f}x the best hand-set ({best}) after {r['probe_steps']} steps of measurement; target "
              f"<= 1.05x: {'met' if ratio <= 1.05 else 'NOT met'}")
        print(r["report"])
    print(machine_line())
    return 0


if __name__ == "__main__":
    from types import SimpleNamespace

    _worker(SimpleNamespace(**json.loads(sys.argv[1])))
