"""``lightning-accel bench pipeline``: what GPipe buys on this machine, measured side by side.

Part 1, speed (2 processes x 1 thread, gloo): one training step of a 16-block MLP
(``--model mlp``, the default) or of a transformers ``LlamaForCausalLM`` with 8 decoder
layers (``--model llama``; :mod:`lightning_accel.benchmarks.pipeline_workload`),
- on one process (the baseline),
- on 2 ranks with raw ``torch.distributed.pipelining`` (stages cut by hand, ScheduleGPipe;
  Llama's in :mod:`lightning_accel.benchmarks.pipeline_llama`, since torch's tracer fails on it),
- on 2 ranks with our :class:`lightning_accel.pipeline.distributed.RankPipeline` on the same stages,
- on 2 ranks with :class:`lightning_accel.strategies.gpipe_distributed.DistributedGPipeStrategy` inside a
  Lightning ``Trainer`` (the same ranks, found through the environment as under torchrun),
each against the ideal speed-up S*M/(M+S-1) of S equal stages and M micro-batches. The three
2-process contenders run in one Lightning fit: after each of its steps the same two
processes run one raw step and one RankPipeline step (see :func:`_paired_fit`), and each is
compared with the raw step beside it; the median of those per-step ratios is the verdict on
"within 5% of raw".
``--plot DIR`` records our pipeline's last step and draws it (SVG and Chrome trace).

Part 2, memory (one process, the MLP; ``--memory-only`` runs just this part): peak bytes allocated
during one step through :class:`LocalPipeline` with ``always`` checkpointing for growing M
(:mod:`lightning_accel.benchmarks.pipeline_memory`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_accel.bench import format_table, machine_line, register_benchmark
from lightning_accel.benchmarks.pipeline_memory import memory_rows, print_memory
from lightning_accel.benchmarks.two_ranks import rank_result, run_two_ranks
from lightning_accel.benchmarks.pipeline_workload import DEFAULTS, MODELS, Workload, step_times, workload
from lightning_accel.pipeline.distributed import RankPipeline
from lightning_accel.pipeline.microbatch import scatter
from lightning_accel.pipeline.schedule import bubble_fraction, ideal_speedup
from lightning_accel.pipeline.timeline import Event, measured_bubble, to_chrome_trace, to_svg


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-accel bench pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="mlp", help="what the 2-process part trains: our MLP, or a random-init "
                   "transformers LlamaForCausalLM (needs the hf extra; the memory table then does not run)")
    p.add_argument("--depth", type=int, help="blocks, split evenly over the 2 stages: MLP blocks (default 16) or Llama "
                   "decoder layers (default 8)")
    p.add_argument("--hidden", type=int, help="width (default: MLP 512, Llama 256, in heads of 64)")
    p.add_argument("--batch", type=int, help="rows per step (default: MLP 1024, Llama 16 sequences); at 128 the MLP's "
                   "16-row micro-batches cost 1.7x on a CPU")
    p.add_argument("--seq", type=int, default=64, help="Llama: tokens per sequence")
    p.add_argument("--vocab", type=int, default=2048, help="Llama: vocabulary size")
    p.add_argument("--chunks", type=int, default=8, help="micro-batches M for the 2-process part")
    p.add_argument("--steps", type=int, default=10, help="timed steps per contender and round (after 2 warm-up steps)")
    p.add_argument("--rounds", type=int, default=3, help="rounds: each contender times steps x rounds steps, and the median counts")
    p.add_argument("--memory-chunks", default="1,2,4,8", help="M values for the memory table (the MLP, --depth blocks)")
    p.add_argument("--memory-batch", type=int, default=1024, help="memory table: a batch whose activations outweigh the weights")
    p.add_argument("--memory-hidden", type=int, default=128)
    p.add_argument("--memory-only", action="store_true", help="run only the one-process memory table (no 2-process part)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the 2 ranks are killed (the defaults take "
                   "1-2 min on a quiet 2-core machine, 5x that under heavy load from other jobs)")
    p.add_argument("--plot", metavar="DIR", help="write the last step of our pipeline as DIR/pipeline-timeline.svg "
                   "and DIR/pipeline-trace.json (Chrome trace), with the measured bubble")
    p.add_argument("--schedules", metavar="NAMES", help="instead: one row per schedule ('all', or a comma-separated list; 'auto': schedule='auto' vs the sweep) "
                   "on blocks of known cost, raw torch vs ours, bubble measured vs ideal, peak activations per rank "
                   "(lightning_accel.benchmarks.pipeline_schedules)")
    p.add_argument("--schedule-depth", type=int, default=4, help="--schedules: sleeping blocks (a multiple of 4)")
    p.add_argument("--schedule-width", type=int, default=64, help="--schedules: block width")
    p.add_argument("--schedule-rows", type=int, default=64, help="--schedules: rows per step")
    p.add_argument("--block-ms", type=float, help="--schedules: ms each block sleeps per micro-batch in each of forward, "
                   "input gradient and weight gradient (default: 25 for the table, a real model's block, see "
                   "pipeline_schedules.TABLE_BLOCK_MS; 5 for 'auto'); --cost-f/-i/-w set one of them")
    p.add_argument("--cost-f", type=float, help="--schedules: ms each block sleeps per micro-batch in forward (default --block-ms)")
    p.add_argument("--cost-i", type=float, help="--schedules: ms in the input-gradient half of backward (default --block-ms)")
    p.add_argument("--cost-w", type=float, help="--schedules: ms in the weight-gradient half of backward (default --block-ms)")
    p.add_argument("--skew", type=float, default=1.0, help="--schedules auto: the start's last stage sleeps this many times as long")
    p.add_argument("--overhead", type=float, default=1.0, help="--schedules auto: ms each block adds per action and micro-batch")
    p.add_argument("--auto-start", default="1f1b", help="--schedules auto: the schedules auto starts from (comma-separated)")
    p.add_argument("--auto-max-chunks", type=int, default=16, help="--schedules auto: the most micro-batches considered")
    p.add_argument("--auto-steps", type=int, default=4, help="--schedules auto: measured steps per micro-batch count")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def _workload(args: argparse.Namespace) -> Workload:
    return workload(args.model, args.depth, args.hidden, args.batch, args.seq, args.vocab)


def _one_process(args: argparse.Namespace, chunks: int = 1) -> float:
    """Median seconds per step on one process: the whole batch, or ``chunks`` micro-batches in
    sequence (gradient accumulation), which isolates what smaller matrix products cost from
    what the pipeline adds."""
    work = _workload(args)
    net, x, y = work.build()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for xc, yc in zip(x.chunk(chunks), y.chunk(chunks)):
            (work.loss(net, xc, yc) / chunks).backward()
        opt.step()

    return statistics.median(step_times(step, args.steps * args.rounds))


def _contender_steps(args: argparse.Namespace, rank: int) -> tuple[dict[str, Any], RankPipeline]:
    """One optimizer step of raw pipelining and one of RankPipeline, each on its own copy of the same stages.

    RankPipeline runs the user's loss through the model's own forward (what the Trainer's
    step runs too); raw pipelining runs the stages cut by hand and the loss on their output."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    work = _workload(args)
    half = args.depth // 2
    steps: dict[str, Any] = {}
    net, x, y = work.build()
    module = work.raw_stage(net, rank, half)
    schedule = ScheduleGPipe(PipelineStage(module, rank, 2, torch.device("cpu")), args.chunks, loss_fn=work.raw_loss)
    raw_opt = torch.optim.SGD(module.parameters(), lr=1e-3)

    def raw() -> None:
        raw_opt.zero_grad(set_to_none=True)
        schedule.step(x, target=None) if rank == 0 else schedule.step(target=y)
        raw_opt.step()

    net2, x2, y2 = work.build()
    pipe = RankPipeline(net2, [half, args.depth - half], args.chunks, schedule="gpipe", record=bool(args.plot))
    ours_opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    xs, ys = scatter(x2, args.chunks), scatter(y2, args.chunks)

    def ours() -> None:
        ours_opt.zero_grad(set_to_none=True)
        pipe.train_step(lambda i: work.loss(net2, xs[i], ys[i]))
        ours_opt.step()

    steps["raw"], steps["ours"] = raw, ours
    return steps, pipe


def _paired_fit(args: argparse.Namespace, steps: dict[str, Any]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds of each step of ``Trainer.fit`` with DistributedGPipeStrategy, each followed by one raw and one
    RankPipeline step (in alternating order) in the same two processes: per-step triples, in wall-clock seconds
    and in this process's CPU seconds.

    Why interleave steps rather than time whole runs one after the other: on 2 shared cores
    a neighbour's burst lasts seconds and moves whole runs by 5-10%, more than the gap under
    test; adjacent steps see the same machine, so each step's ratio is a fair comparison
    and their median a robust one. A Lightning step is timed from the end of the contenders'
    steps before it to a barrier in its ``on_train_batch_end``: Lightning's loop, the batch
    fetch, its hooks, the loss/log broadcast and the optimizer step are all in it. Each step
    of the other two runs between barriers too. The first 2 steps of each are warm-up.
    CPU seconds (``time.process_time``) count the work a contender does on this rank and
    not the time other tenants hold the cores, which under load is most of a step's wall
    time; they do not count a rank's idle wait for its neighbour.
    """
    import lightning.pytorch as pl

    from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy

    work = _workload(args)

    class Task(pl.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = work.loss(self.net, x, y)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    times: dict[str, list[float]] = {"lightning": [], "raw": [], "ours": []}
    cpu: dict[str, list[float]] = {"lightning": [], "raw": [], "ours": []}

    class Interleave(pl.Callback):
        mark: tuple[float, float] | None = None  # wall and CPU clock when the contenders' steps ended

        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            dist.barrier()
            warm = trainer.global_step > 2
            if warm and self.mark is not None:
                times["lightning"].append(time.perf_counter() - self.mark[0])
                cpu["lightning"].append(time.process_time() - self.mark[1])
            for name in ("raw", "ours") if trainer.global_step % 2 else ("ours", "raw"):
                start, start_cpu = time.perf_counter(), time.process_time()
                steps[name]()
                dist.barrier()
                if warm:
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
            self.mark = (time.perf_counter(), time.process_time())

    total = 2 + args.steps * args.rounds
    net, x, y = work.build()
    half = args.depth // 2
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DistributedGPipeStrategy(args.chunks, "gpipe", [half, args.depth - half]),
        max_steps=total, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, callbacks=[Interleave()],
    )
    trainer.fit(Task(net), torch.utils.data.DataLoader([(x, y)] * total, batch_size=None))
    return times, cpu


def _worker(args: argparse.Namespace) -> None:
    """One of the 2 ranks: interleaved steps of the three contenders; rank 0 prints the per-step seconds and each
    rank's median CPU seconds per step."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    steps, pipe = _contender_steps(args, rank)
    times, cpu = _paired_fit(args, steps)
    cpu_ranks: list[Any] = [None, None]
    dist.all_gather_object(cpu_ranks, {name: statistics.median(values) for name, values in cpu.items()})
    if args.plot:
        steps["ours"]()  # one more step, recorded, then every rank's events to rank 0
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, [tuple(e) for e in pipe.events()])
        if rank == 0:
            events = [Event(*e) for part in gathered for e in part]
            os.makedirs(args.plot, exist_ok=True)
            title = f"GPipe, 2 stages x M={args.chunks}, {_workload(args).title}"
            with open(os.path.join(args.plot, "pipeline-timeline.svg"), "w") as f:
                f.write(to_svg(events, title))
            with open(os.path.join(args.plot, "pipeline-trace.json"), "w") as f:
                json.dump(to_chrome_trace(events), f)
            print(f"BUBBLE {measured_bubble(events):.6f}", flush=True)
    if rank == 0:
        print("RESULT " + json.dumps({"wall": times, "cpu": cpu_ranks}), flush=True)
    dist.destroy_process_group()
    # Every result is out; skip the interpreter's teardown. A gloo group still referenced at
    # exit (here: the raw schedule's stages hold the default group) keeps worker threads that
    # may need the GIL while Python 3.11 finalizes, and such a thread is ended with
    # std::terminate ("terminate called without an active exception"; the race: pytorch/pytorch#179291).
    # DistributedGPipeStrategy releases its own device meshes before exit (_release_meshes).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _two_processes(args: argparse.Namespace) -> tuple[dict[str, list[float]], list[dict[str, float]], float | None]:
    """Per-step seconds of each 2-process contender (from rank 0), each rank's median CPU seconds per step of each,
    and the measured bubble with ``--plot``."""
    argv = ["-m", "lightning_accel.benchmarks.pipeline", "--worker", "--model", args.model,
            "--depth", str(args.depth), "--hidden", str(args.hidden), "--batch", str(args.batch), "--seq", str(args.seq),
            "--vocab", str(args.vocab), "--chunks", str(args.chunks), "--steps", str(args.steps),
            "--rounds", str(args.rounds)] + (["--plot", args.plot] if args.plot else [])
    outputs = run_two_ranks(argv, args.timeout)
    bubble = [float(ln.split()[1]) for ln in outputs[0].splitlines() if ln.startswith("BUBBLE ")]
    result = rank_result(outputs[0])
    return result["wall"], result["cpu"], (bubble[0] if bubble else None)


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    """25th, 50th and 75th percentile (one value: itself three times)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _block_costs(args: argparse.Namespace, default_ms: float) -> None:
    """Set each of ``--cost-f/-i/-w`` left unset to ``--block-ms``, or without it to ``default_ms``."""
    block = default_ms if args.block_ms is None else args.block_ms
    for key in ("cost_f", "cost_i", "cost_w"):
        if getattr(args, key) is None:
            setattr(args, key, block)


@register_benchmark("pipeline", "GPipe on an MLP or a transformers Llama (--model): 2-process speed-up vs raw torch "
                    "pipelining and the ideal; memory vs micro-batches")
def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    for key, value in DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.worker:
        _worker(args)
        return 0
    if args.schedules == "auto":  # schedule="auto" against the sweep of what it could choose
        from lightning_accel.benchmarks.pipeline_auto import run_auto

        _block_costs(args, 5.0)  # the cost auto's runs in docs/pipeline.md were measured at
        return run_auto(args)
    if args.schedules:
        from lightning_accel.benchmarks.pipeline_schedules import TABLE_BLOCK_MS, run_schedules

        _block_costs(args, TABLE_BLOCK_MS)
        return run_schedules(args)
    if args.depth < 2 or args.batch % args.chunks or args.steps < 1 or args.rounds < 1:
        raise SystemExit(f"--depth {args.depth} / --batch {args.batch} / --chunks {args.chunks}: need depth >= 2, "
                         "batch divisible by chunks, steps and rounds >= 1")
    if args.model == "llama" and args.memory_only:
        raise SystemExit("--memory-only measures the MLP; drop --model llama (the memory table does not run on Llama)")
    if args.model == "llama" and (args.hidden % 64 and args.hidden > 64 or args.seq < 2 or args.vocab < 2):
        raise SystemExit(f"--model llama --hidden {args.hidden} --seq {args.seq} --vocab {args.vocab}: need hidden a "
                         "multiple of 64 (heads of 64) or at most 64, seq >= 2 and vocab >= 2")
    work = _workload(args)  # a missing transformers is one line here, before any process starts
    chunk_values = [int(c) for c in args.memory_chunks.split(",")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if args.memory_only:
            print_memory(args, memory_rows(args, chunk_values))
            return 0
        one = _one_process(args)
        one_chunked = _one_process(args, args.chunks)
        two = _two_processes(args)
        memory = memory_rows(args, chunk_values) if args.model == "mlp" else None
    finally:
        torch.set_num_threads(threads)
    ideal = ideal_speedup(args.chunks, 2)
    times, cpu, bubble = two
    median = {name: statistics.median(values) for name, values in times.items()}
    # each 2-process step against the raw step next to it (same machine state): the median of those ratios
    paired = {name: _quartiles([r / t for r, t in zip(times["raw"], values)]) for name, values in times.items()}
    count = len(times["raw"])
    print(f"{work.title}; 2 stages x M={args.chunks} "
          f"micro-batches, 1 thread per process; median of {count} steps each (2 processes: the three contenders' "
          "steps interleaved in one run; vs raw: the median of per-step ratios to the raw step beside it, and their middle half)")
    rows: list[list[object]] = [
        ["1 process (no pipeline)", one, 1.0, 1.0 / ideal, median["raw"] / one, "-"],
        [f"1 process, M={args.chunks} micro-batches in turn", one_chunked, one / one_chunked, one / one_chunked / ideal,
         median["raw"] / one_chunked, "-"],
    ]
    for name, label in (("raw", "raw torch.distributed.pipelining"), ("ours", "lightning_accel RankPipeline"),
                        ("lightning", "lightning_accel GPipeStrategy (2 processes)")):
        low, mid, high = paired[name]
        rows.append([label, median[name], one / median[name], one / median[name] / ideal, mid, f"{low:.3f}-{high:.3f}"])
    rows.append(["ideal S*M/(M+S-1)", one / ideal, ideal, 1.0, "-", "-"])
    print(format_table(["contender", "s/step", "speed-up vs 1 process", "of ideal", "vs raw pipelining", "middle half"], rows))
    low, mid, high = paired["lightning"]
    verdict = "met" if mid >= 0.95 else "NOT met"
    print(f"GPipeStrategy in a Trainer vs raw pipelining: {mid:.3f}x per step (median of {count}; middle half "
          f"{low:.3f}-{high:.3f}); target >= 0.95x: {verdict}")
    # CPU time: what each contender computes on each rank, which other tenants do not stretch (wall time under load
    # is mostly waiting for a core); the overhead of ours over raw in work done, apart from the machine's load
    extra = [" / ".join(f"{rank[name] / rank['raw']:.3f}x" for rank in cpu) for name in ("ours", "lightning")]
    ms = {name: " / ".join(f"{rank[name] * 1e3:.2f}" for rank in cpu) for name in ("raw", "ours", "lightning")}
    print(f"CPU ms per step on rank 0 / rank 1 (median; the work done, not stretched by other tenants' load): raw {ms['raw']}; "
          f"RankPipeline {ms['ours']} ({extra[0]} raw's); GPipeStrategy {ms['lightning']} ({extra[1]} raw's)")
    # Where the gap to the ideal goes: micro-batches of batch/M rows cost more than the whole batch
    # even on one process (smaller matrix products, M times the per-operator overhead); the
    # ideal with that cost priced in is what a pipeline with free communication could reach.
    cost = one_chunked / one
    reached = one / median["lightning"]
    print(f"where the gap to the ideal {ideal:.2f}x goes: M={args.chunks} micro-batches of {args.batch // args.chunks} {work.unit} "
          f"cost {cost:.2f}x the whole batch on one process, so the ideal with that cost is {ideal / cost:.2f}x; "
          f"our strategy reaches {reached:.2f}x, {reached / (ideal / cost):.0%} of it "
          "(the rest: send/recv between the ranks and idle time beyond the fill-drain bubble)")
    if args.plot and bubble is not None:
        print(f"timeline of our last step: {args.plot}/pipeline-timeline.svg, {args.plot}/pipeline-trace.json; "
              f"bubble measured {bubble:.1%}, fill-drain ideal {bubble_fraction(args.chunks, 2):.1%}")
    if memory is None:
        print(machine_line())
        return 0
    print()
    print_memory(args, memory)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
