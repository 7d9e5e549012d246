"""``lightning-accel bench offload``: L2L offload against plain training, side by side.

Every contender trains the same GPT on the same random tokens for the same steps in this
process, one after another, and the table reports ratios against plain Lightning
measured in the same run (absolute times on shared machines are noise).

- On a CPU-only machine (device = host): step time of ``l2l_offload`` over plain
  training, with and without block checkpointing, with the one-step delayed update
  (the host step runs beside the next step's compute, here on the same cores) and with
  the block-boundary activations parked in host memory (here a pure extra copy). The
  target is at most 1.3x. A Fabric row runs ``Fabric(strategy="l2l_offload")`` in a hand-written loop on the same
  model and steps (:mod:`.offload_fabric`), and a closing line gives its ratio to the Trainer's row (target 1.05x). With ``--contenders``, the offloads a user would pick instead
  (:mod:`.offload_contenders`: FSDP2 CPU offload one unit per block, DeepSpeed ZeRO-3
  offload) beside plain training and ``l2l_offload``, in fp32; a contender that cannot run
  here is listed with the reason.
- On a CUDA machine: for each GPT depth, tokens/s and peak device memory of plain
  Lightning (bf16-mixed), per-block FSDP2 CPU offload, ZeRO-3 offload (not Lightning's
  ``fsdp_cpu_offload``, which moves the whole model as one unit) and ``l2l_offload`` with
  ``OffloadPrecision("bf16-mixed")``; plus the host-to-device bandwidth the offload
  achieved against a plain pinned copy on the same machine. Sizes that do not fit
  without offload are reported as "OOM", contenders that cannot run as "n/a" with the reason.
- With ``--devices N``: ``l2l_offload_ddp`` on N gloo processes against plain DDP
  (:mod:`.offload_ddp`): step time, optimizer state and host weights per rank, bytes reduced
  and gathered per step, with the host optimizer partitioned and replicated.
- Everywhere: the host optimizer step (:mod:`.offload_host_step`): Mparam/s of
  ``l2l_offload``'s host step against torch's default and fused AdamW, DeepSpeedCPUAdam
  where importable and a plain memory copy; one call per block against one call for all;
  the bf16 shadows written in the update's pass against a separate pass; and the time in
  ``AdamW.step`` inside a fit against plain training with ``AdamW(fused=True)``, in fp32
  and in bf16-mixed.
- With ``--nvme``: the NVMe tier (:mod:`.offload_nvme`, its own options): step time with the
  optimizer state and masters on disk against the same model in RAM and against the disk's I/O floor.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_accel.bench import format_table, machine_line, register_benchmark
from lightning_accel.benchmarks.offload_fabric import fabric_measure
from lightning_accel.fabric import L2LOffloadStrategy as FabricL2LOffloadStrategy
from lightning_accel.benchmarks.offload_workload import StepTimer, pinned_bandwidth_gbs, token_data
from lightning_accel.models import GPT, LanguageModelTask
from lightning_accel.plugins.precision import OffloadPrecision
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy


def _measure(net_kwargs: dict[str, Any], strategy: Any, plugins: list[Any], precision: Any, accelerator: str,
             batch: int, seq: int, steps: int, warmup: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = LanguageModelTask(GPT(**net_kwargs, block_size=seq))
    timer = StepTimer(warmup)
    trainer = pl.Trainer(
        accelerator=accelerator, devices=1, strategy=strategy, plugins=plugins, precision=precision,
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer],
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer.fit(model, token_data(batch, seq, steps))
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"step_s": float("nan"), "oom": True}
    step_s = sorted(timer.times)[len(timer.times) // 2]  # median: robust to a noisy neighbour
    result = {"step_s": step_s, "tokens_per_s": batch * seq / step_s, "oom": False,
              "params": sum(p.numel() for p in model.parameters())}
    if torch.cuda.is_available():
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    stats = getattr(trainer.strategy, "offload_stats", None)
    if stats is not None:
        result["stats"] = stats
    return result


FABRIC_ROW = "l2l_offload (defaults), Fabric loop"


def _cpu_table(args: argparse.Namespace) -> str:
    net = {"preset": args.preset, "n_layer": args.layers}
    run = dict(accelerator="cpu", batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup)
    if args.contenders:
        return _cpu_contenders_table(args, net, run)
    contenders = {
        "plain Lightning": ("auto", None),
        "l2l_offload (defaults)": (L2LOffloadStrategy, {}),
        "l2l_offload, host step overlapped": (L2LOffloadStrategy, {"overlap_step": True}),
        "l2l_offload, no checkpointing": (L2LOffloadStrategy, {"checkpoint_blocks": False}),
        "l2l_offload, delayed update": (L2LOffloadStrategy, {"delayed_update": True, "delayed_update_warmup": 0}),
        "l2l_offload, activations on host": (L2LOffloadStrategy, {"offload_activations": True}),
    }
    # Rounds interleave the contenders (A B C D A B C D ...) so a noisy neighbour hits all
    # of them alike; each contender's figure is the median over its rounds.
    times: dict[str, list[float]] = {name: [] for name in contenders}
    peaks: dict[str, str] = {}
    parked: dict[str, str] = {}
    params = 0
    for _ in range(args.rounds):
        for name, (strategy, kwargs) in contenders.items():
            got = _measure(net, strategy(**kwargs) if kwargs is not None else strategy, [], "32-true", **run)
            times[name].append(got["step_s"])
            params = got["params"]
            peaks[name] = str(got["stats"].peak_resident_blocks) if "stats" in got else "-"
            act = got["stats"].activation_d2h_bytes_per_step if "stats" in got else 0
            parked[name] = f"{act / 2**20:.1f}" if act else "-"
        # the same model and steps in a Fabric loop (lightning_accel.fabric): what the second front door costs
        got = fabric_measure(net, FabricL2LOffloadStrategy(), **run)
        times.setdefault(FABRIC_ROW, []).append(got["step_s"])
        peaks[FABRIC_ROW], parked[FABRIC_ROW] = str(got["stats"].peak_resident_blocks), "-"
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    base = median["plain Lightning"]
    rows = [[name, f"{median[name]:.3f}", f"{median[name] / base:.2f}", peaks[name], parked[name]] for name in times]
    header = ["contender", "step s (median)", "x plain", "peak blocks", "act MiB/step to host"]
    title = (f"GPT {args.preset} x{args.layers} layers ({params / 1e6:.1f}M params), batch {args.batch}x{args.seq}, "
             f"CPU device, {args.rounds} interleaved rounds of {args.steps} steps; target <= 1.30x")
    fabric = (f"\nFabric loop / Trainer, l2l_offload (defaults): {median[FABRIC_ROW] / median['l2l_offload (defaults)']:.2f}x "
              "(target <= 1.05x: the same mechanism)")
    return title + "\n" + format_table(header, rows) + fabric


def _cpu_contenders_table(args: argparse.Namespace, net: dict[str, Any], run: dict[str, Any]) -> str:
    """``--contenders``: plain Lightning, ``l2l_offload`` and the offloads a user would pick instead, in fp32."""
    from lightning_accel.benchmarks.offload_contenders import CONTENDERS

    times: dict[str, list[float]] = {"plain Lightning": [], "l2l_offload (defaults)": [], **{name: [] for name in CONTENDERS}}
    skipped: dict[str, str] = {}
    params = 0
    for _ in range(args.rounds):  # interleaved, as the table above
        times["plain Lightning"].append(_measure(net, "auto", [], "32-true", **run)["step_s"])
        got = _measure(net, L2LOffloadStrategy(), [], "32-true", **run)
        times["l2l_offload (defaults)"].append(got["step_s"])
        params = got["params"]
        for name, contender in CONTENDERS.items():
            if name not in skipped:
                row = contender(net, "32-true", **run)
                if "skipped" in row:
                    skipped[name] = row["skipped"]
                else:
                    times[name].append(row["step_s"])
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items() if t}
    base = median["plain Lightning"]
    rows = [[name, f"{median[name]:.3f}", f"{median[name] / base:.2f}"] if name in median else [name, "not run", "-"]
            for name in times]
    title = (f"offload contenders: GPT {args.preset} x{args.layers} layers ({params / 1e6:.1f}M params), batch {args.batch}x{args.seq}, "
             f"CPU device, fp32, {args.rounds} interleaved rounds of {args.steps} steps")
    notes = "".join(f"\n{name}: not run, {why}" for name, why in skipped.items())
    return title + "\n" + format_table(["contender", "step s (median)", "x plain"], rows) + notes


def _cuda_table(args: argparse.Namespace) -> str:
    from lightning_accel.benchmarks.offload_contenders import CONTENDERS

    bandwidth = pinned_bandwidth_gbs()
    rows = []
    skipped: dict[str, str] = {}
    run = dict(accelerator="gpu", batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup)

    def ran(r: dict[str, Any]) -> bool:
        return not r["oom"] and "skipped" not in r

    def cell(r: dict[str, Any]) -> str:
        return "OOM" if r["oom"] else "n/a" if "skipped" in r else f"{r['tokens_per_s']:.0f}"

    def mem(r: dict[str, Any]) -> str:
        return f"{r['peak_gib']:.1f}" if ran(r) else "-"

    for layers in args.gpu_layers:
        net = {"preset": "gpt2-xl", "n_layer": layers}
        plain = _measure(net, "auto", [], "bf16-mixed", **run)
        others = {name: contender(net, "bf16-mixed", **run) for name, contender in CONTENDERS.items()}
        skipped.update({name: r["skipped"] for name, r in others.items() if "skipped" in r})
        fsdp2, zero3 = others["FSDP2 offload, per block"], others["ZeRO-3 offload"]
        l2l = _measure(net, L2LOffloadStrategy(), [OffloadPrecision("bf16-mixed")], None, **run)
        stats = l2l.get("stats")
        achieved = stats.h2d_bytes_per_step / max(stats.copy_seconds / max(stats.steps, 1), 1e-9) / 1e9 if stats else float("nan")
        ratio_plain = f"{l2l['tokens_per_s'] / plain['tokens_per_s']:.2f}" if ran(plain) and ran(l2l) else "-"
        fastest = max((r["tokens_per_s"] for r in others.values() if ran(r)), default=None)
        ratio_best = f"{l2l['tokens_per_s'] / fastest:.2f}" if fastest and ran(l2l) else "-"
        rows.append([str(layers), f"{l2l.get('params', 0) / 1e9:.2f}B", cell(plain), cell(fsdp2), cell(zero3), cell(l2l),
                     ratio_plain, ratio_best, mem(plain), mem(fsdp2), mem(zero3), mem(l2l), f"{achieved:.1f}"])
    header = ["layers", "params", "plain tok/s", "fsdp2 tok/s", "zero3 tok/s", "l2l tok/s", "l2l/plain", "l2l/best offload",
              "plain GiB", "fsdp2 GiB", "zero3 GiB", "l2l GiB", "l2l H2D GB/s"]
    notes = "".join(f"\n{name}: n/a, {why}" for name, why in skipped.items())
    return (f"GPT-2 XL width, bf16, batch {args.batch}x{args.seq}; pinned copy bandwidth {bandwidth:.1f} GB/s; fsdp2: FSDP2 CPU "
            "offload one unit per block; zero3: DeepSpeed ZeRO-3 params+optimizer offload; targets: l2l/plain >= 0.8, "
            "l2l/best offload >= 1.5, l2l GiB flat within 10%\n" + format_table(header, rows) + notes)


@register_benchmark("offload", "L2L offload vs plain Lightning (CPU) and vs per-block FSDP2 and ZeRO-3 offload (GPU)")
def main(argv: list[str]) -> int:
    if "--nvme" in argv:  # its own options (lightning-accel bench offload --nvme --help)
        from lightning_accel.benchmarks import offload_nvme

        return offload_nvme.main([a for a in argv if a != "--nvme"])
    parser = argparse.ArgumentParser(prog="lightning-accel bench offload")
    parser.add_argument("--preset", default="tiny", help="GPT preset for the CPU table (width, heads)")
    parser.add_argument("--layers", type=int, default=8, help="GPT depth for the CPU table")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (CPU table)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--contenders", action="store_true",
                        help="CPU table: plain, l2l_offload, per-block FSDP2 CPU offload and ZeRO-3 offload instead of l2l's variants")
    parser.add_argument("--gpu-layers", type=int, nargs="+", default=[12, 24, 48], help="GPT depths for the CUDA table")
    parser.add_argument("--only", choices=["all", "fit", "host-step", "in-fit"], default="all",
                        help="fit: the training tables only; host-step: the host optimizer step tables only; in-fit: "
                             "only the host-step report's time in AdamW.step inside a fit (--fit-* and --rounds)")
    parser.add_argument("--host-params", type=float, nargs="+", default=[50, 200],
                        help="sizes (millions of parameters) of the host-step table")
    parser.add_argument("--host-rounds", type=int, default=5, help="interleaved rounds of the host-step tables")
    parser.add_argument("--host-width", type=int, default=1024, help="GPT width whose block shapes the host-step table uses")
    parser.add_argument("--fit-preset", default="gpt2", help="GPT preset (width) of the in-fit step timing")
    parser.add_argument("--fit-layers", type=int, default=4, help="GPT (gpt2 width) depth of the in-fit step timing")
    parser.add_argument("--fit-seq", type=int, default=32, help="sequence length of the in-fit step timing (batch 1)")
    parser.add_argument("--fit-steps", type=int, default=10, help="steps per round of the in-fit step timing")
    parser.add_argument("--devices", type=int, default=1,
                        help="N > 1: l2l_offload_ddp (partitioned and replicated host step) against plain DDP on N gloo "
                             "processes on the CPU, instead of the one-device tables")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds before giving up on the N-process run")
    parser.add_argument("--nvme", action="store_true", help="the NVMe tier against in-RAM L2L and the disk's I/O floor, "
                        "instead of the other tables (its own options: bench offload --nvme --help)")
    args = parser.parse_args(argv)
    if args.devices < 1:
        parser.error(f"--devices must be >= 1, got {args.devices}; e.g. --devices 2")
    if args.devices > 1:
        from lightning_accel.benchmarks.offload_ddp import ddp_table

        print(ddp_table(args))
        print(machine_line())
        return 0
    for flag in ("host_params", "host_rounds", "host_width", "fit_layers", "fit_seq", "fit_steps", "rounds"):
        values = getattr(args, flag)
        if any(v <= 0 for v in (values if isinstance(values, list) else [values])):
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {values}; e.g. --host-params 50 200 --host-rounds 5")
    if args.fit_steps <= args.warmup:
        parser.error(f"--fit-steps {args.fit_steps} must exceed --warmup {args.warmup} (steps after the warm-up are timed)")
    if args.only == "in-fit":  # minutes instead of the whole host-step report's tens of minutes
        from lightning_accel.benchmarks.offload_host_step import in_fit_table

        print(in_fit_table(args)[0])
        print(machine_line())
        return 0
    if args.only != "host-step":
        print(_cuda_table(args) if torch.cuda.is_available() else _cpu_table(args))
    if args.only != "fit":
        from lightning_accel.benchmarks.offload_host_step import host_step_report

        print(host_step_report(args))
    print(machine_line())
    return 0
