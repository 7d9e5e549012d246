"""``lightning-accel bench ddp``: seed 002's data-parallel communication options, side by side.

Two gloo processes on this machine train the same MLP on the same batches once per
option (:func:`lightning_accel.comm.probe`): plain DDP, fp16 compression, PowerSGD at two
ranks, small and large buckets, static graph, and 4-way gradient accumulation with and
without ``no_sync``. For each: the bytes one process hands to all-reduce per optimizer
step (metered in ``torch.distributed``; plain DDP is metered through torch's
``allreduce_hook``, which has DDP's own numerics), the all-reduce calls, the mean step
time, and how far its last loss lands from plain DDP's. Ratios are against plain DDP
measured in the same run: on a shared 2-core machine absolute times are noise, and gloo
over loopback makes communication far cheaper than a real network, so the bytes column is
the one that transfers to a cluster.
"""

from __future__ import annotations

import argparse

from lightning_accel.bench import format_table, machine_line, register_benchmark
from lightning_accel.comm import CommHookSpec, DDPOption, probe


def options(accumulate: int) -> list[DDPOption]:
    """The contenders, plain DDP first (the baseline of every ratio)."""
    return [
        DDPOption("plain DDP (allreduce)"),
        DDPOption("DDP built-in reducer", hook=CommHookSpec("none")),
        DDPOption("fp16 compress", hook=CommHookSpec("fp16")),
        DDPOption("PowerSGD rank 1", hook=CommHookSpec("powersgd", powersgd_rank=1)),
        DDPOption("PowerSGD rank 4", hook=CommHookSpec("powersgd", powersgd_rank=4)),
        DDPOption("PowerSGD r1 + fp16", hook=CommHookSpec("powersgd", powersgd_rank=1, powersgd_fp16=True)),
        DDPOption("bucket_cap_mb=1", bucket_cap_mb=1.0),
        DDPOption("bucket_cap_mb=100", bucket_cap_mb=100.0),
        DDPOption("static_graph", static_graph=True),
        DDPOption(f"accumulate {accumulate}, sync each", accumulate=accumulate, sync_every_micro_batch=True),
        DDPOption(f"accumulate {accumulate}, no_sync", accumulate=accumulate),
    ]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-accel bench ddp", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="measured optimizer steps per option (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (PowerSGD starts at step 2)")
    p.add_argument("--width", type=int, default=1024, help="MLP width (default 1024: ~4.2M parameters at depth 4)")
    p.add_argument("--depth", type=int, default=4, help="hidden layers (default 4)")
    p.add_argument("--batch", type=int, default=32, help="samples per process per optimizer step (default 32)")
    p.add_argument("--accumulate", type=int, default=4, help="micro-batches per step for the accumulation rows")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds before giving up (default 540)")
    return p


@register_benchmark("ddp", "seed 002: bytes all-reduced and step time per DDP comm option vs plain DDP (2 gloo processes)")
def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    for name in ("steps", "width", "depth", "batch", "accumulate"):
        if getattr(args, name) < 1:
            _parser().error(f"--{name} must be >= 1; e.g. --{name} 4")
    if args.batch % args.accumulate:
        _parser().error(f"--batch {args.batch} must be divisible by --accumulate {args.accumulate}; e.g. --batch {args.accumulate * 8}")
    contenders = options(args.accumulate)
    results = probe(
        contenders, steps=args.steps, warmup=args.warmup, batch=args.batch, width=args.width, depth=args.depth,
        return_params=False, timeout_s=args.timeout,
    )
    base = results[0]
    params = args.depth * (args.width * args.width + args.width) + args.width + 1
    rows = []
    for r in results:
        metered = r.calls_per_step > 0
        rows.append(
            (
                r.label,
                f"{r.bytes_per_step / 1e6:.2f}" if metered else "(C++)",
                f"{r.bytes_per_step / base.bytes_per_step:.3f}" if metered else "-",
                f"{r.calls_per_step:.1f}" if metered else "-",
                r.step_seconds * 1e3,
                r.step_seconds / base.step_seconds,
                f"{(r.losses[-1] - base.losses[-1]) / abs(base.losses[-1]):+.1e}",
            )
        )
    print(
        f"bench ddp: 2 gloo processes, MLP {args.depth}x{args.width} ({params / 1e6:.2f}M parameters, "
        f"{params * 4 / 1e6:.1f} MB fp32 gradients), batch {args.batch}/process, {args.steps} steps after {args.warmup} warm-up"
    )
    print(
        format_table(
            ("option", "MB all-reduced/step", "x plain", "all-reduce calls/step", "step ms", "x plain", "last loss vs plain"),
            rows,
        )
    )
    print("(C++): DDP's built-in reducer all-reduces outside Python, so it is not metered; its numerics equal plain DDP's.")
    print(machine_line())
    return 0
