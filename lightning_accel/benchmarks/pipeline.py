"""``lightning-accel bench pipeline``: what GPipe buys on this machine, measured side by side.

Part 1, speed (2 processes x 1 thread, gloo): one training step of a 16-block MLP,
- on one process (the baseline),
- on 2 ranks with raw ``torch.distributed.pipelining`` (stages cut by hand, ScheduleGPipe),
- on 2 ranks with our :class:`lightning_accel.pipeline.distributed.RankPipeline` on the same stages,
- on 2 ranks with :class:`lightning_accel.strategies.gpipe_distributed.DistributedGPipeStrategy` inside a
  Lightning ``Trainer`` (the same ranks, found through the environment as under torchrun),
each against the ideal speed-up S*M/(M+S-1) of S equal stages and M micro-batches.
``--plot DIR`` records our pipeline's last step and draws it (SVG and Chrome trace).

Part 2, memory (one process; ``--memory-only`` runs just this part): peak bytes allocated
during one step (activations, their recomputation and the gradients) through
:class:`LocalPipeline` with ``always`` checkpointing for growing M, against no
micro-batching and no checkpointing, and the time each costs. The model is one stage, so
``always`` keeps only the stage's input per micro-batch and backward recomputes one
micro-batch of the whole stage at a time: the peak falls with M (GPipe's
O(N + L/K * N/M)); at M=1 it recomputes the whole batch at once and saves little. On the
CPU the bytes come from the profiler's allocation events; on CUDA from the allocator's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_accel.bench import format_table, machine_line, register_benchmark
from lightning_accel.models import MLP
from lightning_accel.models.block_policy import find_blocks
from lightning_accel.pipeline.distributed import RankPipeline
from lightning_accel.pipeline.local import LocalPipeline, checkpoint_stop
from lightning_accel.pipeline.microbatch import scatter
from lightning_accel.pipeline.schedule import bubble_fraction, ideal_speedup
from lightning_accel.pipeline.timeline import Event, measured_bubble, to_chrome_trace, to_svg


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-accel bench pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=16, help="MLP blocks (split evenly over the 2 stages)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=1024, help="rows per step; at 128 the 16-row micro-batches cost 1.7x on a CPU")
    p.add_argument("--chunks", type=int, default=8, help="micro-batches M for the 2-process part")
    p.add_argument("--steps", type=int, default=10, help="timed steps per contender (after 2 warm-up steps)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per contender; the best round counts")
    p.add_argument("--memory-chunks", default="1,2,4,8", help="M values for the memory table")
    p.add_argument("--memory-batch", type=int, default=1024, help="memory table: a batch whose activations outweigh the weights")
    p.add_argument("--memory-hidden", type=int, default=128)
    p.add_argument("--memory-only", action="store_true", help="run only the one-process memory table (no 2-process part)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the 2 ranks are killed")
    p.add_argument("--plot", metavar="DIR", help="write the last step of our pipeline as DIR/pipeline-timeline.svg "
                   "and DIR/pipeline-trace.json (Chrome trace), with the measured bubble")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def _model(depth: int, hidden: int, batch: int) -> tuple[MLP, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = MLP(hidden, hidden, hidden=hidden, depth=depth)
    g = torch.Generator().manual_seed(1)
    return net, torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g)


def _time_steps(step, steps: int, barrier=lambda: None) -> float:
    for _ in range(2):
        step()
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    barrier()
    return (time.perf_counter() - start) / steps


def _one_process(args: argparse.Namespace, chunks: int = 1) -> float:
    """Seconds per step on one process: the whole batch, or ``chunks`` micro-batches in sequence
    (gradient accumulation), which isolates what smaller matrix products cost from what the
    pipeline adds."""
    net, x, y = _model(args.depth, args.hidden, args.batch)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for xc, yc in zip(x.chunk(chunks), y.chunk(chunks)):
            (F.mse_loss(net(xc), yc) / chunks).backward()
        opt.step()

    return min(_time_steps(step, args.steps) for _ in range(args.rounds))


def _raw_stage(net: MLP, rank: int, half: int) -> nn.Module:
    """Stages cut by hand, as a user of raw torch.distributed.pipelining writes them."""
    if rank == 0:
        return nn.Sequential(net.pre, *net.blocks[:half])
    return nn.Sequential(*net.blocks[half:], net.post)


def _lightning_seconds(args: argparse.Namespace) -> float:
    """Seconds per step of ``Trainer.fit`` with DistributedGPipeStrategy on the same stages, after 2 warm-up steps.

    The clock runs from the start of the first timed batch to the end of the last (both
    behind a barrier, as for the others): Lightning's loop, hooks, logging and optimizer
    step are in it; the data is one pre-built batch, as for the others.
    """
    import lightning.pytorch as pl

    from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy

    class Task(pl.LightningModule):
        def __init__(self, net: MLP) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Clock(pl.Callback):
        start = end = 0.0

        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            if trainer.global_step == 2:
                dist.barrier()
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            if trainer.global_step == 2 + args.steps:
                dist.barrier()
                self.end = time.perf_counter()

    net, x, y = _model(args.depth, args.hidden, args.batch)
    clock = Clock()
    half = args.depth // 2
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DistributedGPipeStrategy(args.chunks, "gpipe", [half, args.depth - half]),
        max_steps=2 + args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, callbacks=[clock],
    )
    trainer.fit(Task(net), torch.utils.data.DataLoader([(x, y)] * (2 + args.steps), batch_size=None))
    return (clock.end - clock.start) / args.steps


def _worker(args: argparse.Namespace) -> None:
    """One of the 2 ranks: time raw pipelining, then ours, on the same stages; rank 0 prints seconds per step."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    half = args.depth // 2
    steps = {}
    for contender in ("raw", "ours"):
        net, x, y = _model(args.depth, args.hidden, args.batch)
        if contender == "raw":
            module = _raw_stage(net, rank, half)
            schedule = ScheduleGPipe(PipelineStage(module, rank, 2, torch.device("cpu")), args.chunks, loss_fn=F.mse_loss)
            params = list(module.parameters())

            def run(schedule=schedule, x=x, y=y) -> None:
                schedule.step(x, target=None) if rank == 0 else schedule.step(target=y)
        else:
            pipe = RankPipeline(net, [half, args.depth - half], args.chunks, F.mse_loss, "gpipe", record=bool(args.plot))
            params = pipe.parameters()

            def run(pipe=pipe, x=x, y=y) -> None:
                pipe.step(x, y)
        opt = torch.optim.SGD(params, lr=1e-3)

        def step(run=run, opt=opt) -> None:
            opt.zero_grad(set_to_none=True)
            run()
            opt.step()

        steps[contender] = step
    # alternate the contenders round by round so a noisy neighbour hurts both alike; keep each one's best round
    results = {name: float("inf") for name in steps}
    for r in range(args.rounds):
        for name in (("raw", "ours") if r % 2 == 0 else ("ours", "raw")):
            results[name] = min(results[name], _time_steps(steps[name], args.steps, dist.barrier))
        results["lightning"] = min(results.get("lightning", float("inf")), _lightning_seconds(args))
    if args.plot:
        steps["ours"]()  # one more step, recorded, then every rank's events to rank 0
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, [tuple(e) for e in pipe.events()])
        if rank == 0:
            events = [Event(*e) for part in gathered for e in part]
            os.makedirs(args.plot, exist_ok=True)
            title = f"GPipe, 2 stages x M={args.chunks}, MLP depth {args.depth}"
            with open(os.path.join(args.plot, "pipeline-timeline.svg"), "w") as f:
                f.write(to_svg(events, title))
            with open(os.path.join(args.plot, "pipeline-trace.json"), "w") as f:
                json.dump(to_chrome_trace(events), f)
            print(f"BUBBLE {measured_bubble(events):.6f}", flush=True)
    if rank == 0:
        print(f"RESULT raw={results['raw']:.6f} ours={results['ours']:.6f} lightning={results['lightning']:.6f}", flush=True)
    dist.destroy_process_group()
    # Every result is out. About one run in ten (seen on 2 CPU cores) the interpreter's own
    # teardown then aborts in torch ("terminate called without an active exception": a
    # gloo group from the Trainers' device meshes destroyed while its thread is joinable);
    # the root cause is not found yet (see issue #4), so this worker skips that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _two_processes(args: argparse.Namespace) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "lightning_accel.benchmarks.pipeline", "--worker", "--depth", str(args.depth),
            "--hidden", str(args.hidden), "--batch", str(args.batch), "--chunks", str(args.chunks),
            "--steps", str(args.steps), "--rounds", str(args.rounds)] + (["--plot", args.plot] if args.plot else [])
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + args.timeout
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"the 2 pipeline ranks did not finish within --timeout {args.timeout} s") from None
    if any(p.returncode for p in procs):
        raise RuntimeError("a pipeline rank failed:\n" + "\n".join(o[-2000:] for o in outputs))
    line = next(ln for ln in outputs[0].splitlines() if ln.startswith("RESULT "))
    result = {k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])}
    bubble = [ln for ln in outputs[0].splitlines() if ln.startswith("BUBBLE ")]
    if bubble:
        result["bubble"] = float(bubble[0].split()[1])
    return result


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


def _memory_rows(args: argparse.Namespace, chunk_values: list[int]) -> list[list[object]]:
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

        seconds = min(_time_steps(step, args.steps) for _ in range(args.rounds))  # best round: noisy neighbours
        net.zero_grad(set_to_none=True)
        peak = _peak_bytes(step)
        baseline = baseline or (peak, seconds)
        rows.append([f"M={chunks}, checkpoint={mode}", peak / 2**20, peak / baseline[0], seconds * 1e3, seconds / baseline[1]])
    return rows


@register_benchmark("pipeline", "GPipe: 2-process speed-up vs raw torch pipelining and the ideal; memory vs micro-batches")
def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.depth < 2 or args.batch % args.chunks or args.steps < 1 or args.rounds < 1:
        raise SystemExit(f"--depth {args.depth} / --batch {args.batch} / --chunks {args.chunks}: need depth >= 2, "
                         "batch divisible by chunks, steps and rounds >= 1")
    chunk_values = [int(c) for c in args.memory_chunks.split(",")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if args.memory_only:
            _print_memory(args, _memory_rows(args, chunk_values))
            return 0
        one = _one_process(args)
        one_chunked = _one_process(args, args.chunks)
        two = _two_processes(args)
        memory = _memory_rows(args, chunk_values)
    finally:
        torch.set_num_threads(threads)
    ideal = ideal_speedup(args.chunks, 2)
    print(f"MLP depth {args.depth}, hidden {args.hidden}, batch {args.batch}; 2 stages x M={args.chunks} "
          f"micro-batches, 1 thread per process; best of {args.rounds} alternating rounds of {args.steps} timed steps")
    print(format_table(
        ["contender", "s/step", "speed-up vs 1 process", "of ideal", "vs raw pipelining"],
        [
            ["1 process (no pipeline)", one, 1.0, 1.0 / ideal, two["raw"] / one],
            [f"1 process, M={args.chunks} micro-batches in turn", one_chunked, one / one_chunked, one / one_chunked / ideal,
             two["raw"] / one_chunked],
            ["raw torch.distributed.pipelining", two["raw"], one / two["raw"], one / two["raw"] / ideal, 1.0],
            ["lightning_accel RankPipeline", two["ours"], one / two["ours"], one / two["ours"] / ideal, two["raw"] / two["ours"]],
            ["lightning_accel GPipeStrategy (2 processes)", two["lightning"], one / two["lightning"],
             one / two["lightning"] / ideal, two["raw"] / two["lightning"]],
            ["ideal S*M/(M+S-1)", one / ideal, ideal, 1.0, "-"],
        ],
    ))
    # Where the gap to the ideal goes: micro-batches of batch/M rows cost more than the whole batch
    # even on one process (smaller matrix products, M times the per-operator overhead); the
    # ideal with that cost priced in is what a pipeline with free communication could reach.
    cost = one_chunked / one
    print(f"where the gap to the ideal {ideal:.2f}x goes: M={args.chunks} micro-batches of {args.batch // args.chunks} rows "
          f"cost {cost:.2f}x the whole batch on one process, so the ideal with that cost is {ideal / cost:.2f}x; "
          f"our strategy reaches {one / two['lightning']:.2f}x, {one / two['lightning'] / (ideal / cost):.0%} of it "
          "(the rest: send/recv between the ranks and idle time beyond the fill-drain bubble)")
    if args.plot:
        print(f"timeline of our last step: {args.plot}/pipeline-timeline.svg, {args.plot}/pipeline-trace.json; "
              f"bubble measured {two['bubble']:.1%}, fill-drain ideal {bubble_fraction(args.chunks, 2):.1%}")
    print()
    _print_memory(args, memory)
    return 0


def _print_memory(args: argparse.Namespace, memory: list[list[object]]) -> None:
    grads = sum(p.numel() * p.element_size() for p in _model(args.depth, args.memory_hidden, 1)[0].parameters())
    print(f"one process, MLP depth {args.depth} as one stage, hidden {args.memory_hidden}, batch {args.memory_batch}, "
          f"1 thread: peak bytes allocated during a step (activations, their recomputation, and {grads / 2**20:.1f} MiB "
          f"of gradients), after 2 warm-up steps; time: best of {args.rounds} rounds of {args.steps} steps:")
    print(format_table(["setting", "peak MiB", "vs M=1 never", "ms/step", "time vs M=1 never"], memory))
    print(machine_line())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
