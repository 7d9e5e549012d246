"""``lightning-accel bench offload --nvme``: L2L's NVMe tier against the same model in RAM, and against the disk.

A GPT whose optimizer state and fp32 masters do not fit the ``host_budget`` the bench sets (by
default the least the tier's plan accepts: every block's state and masters on disk) trains with
``l2l_offload`` twice per configuration, in RAM and with ``nvme_path``, on the CPU device. Side by
side in one run:

- the step time of each (median over the steps after the warm-up, and over rounds);
- the I/O floor: the bytes the tier read and wrote per step (``OffloadStats.nvme_read_bytes`` /
  ``nvme_write_bytes``) at the read and write bandwidth of this disk, measured in the same run
  through the tier's own path and request size (:func:`~lightning_accel.offload.disk_io.measure_bandwidth`),
  read time plus write time: one disk serves both;
- the ratios tier / in-RAM and tier / max(in-RAM, floor), against issue 49's targets: within 1.25x
  of max(in-RAM step, I/O floor), and where compute dominates within 1.10x of the in-RAM step;
- where each step's time goes: the optimizer's update (the fused kernel, timed by the optimizer's
  step hooks on whichever thread runs it), the time waiting on the disk (``nvme_seconds``), the rest
  (forward, backward, the tier's bookkeeping), and the process's user and system CPU seconds per step
  (system time is where O_DIRECT reads and writes cost CPU on a virtual disk);
- the host bytes kept: ``host_bytes + host_optimizer_bytes`` after the last step, and
  ``OffloadStats.peak_host_bytes`` as the stats report it.

Four configurations share the weights: little compute per byte on disk (I/O-bound) and a larger batch
(compute-bound), each with every block's state and masters on disk and with the fp32 masters kept in
RAM (a budget that spills the optimizer state alone: on a CPU device the forward and backward compute
on the masters, so masters on disk are read through the tier's map as well, in page faults the tier's
counters do not see; the kernel's per-process I/O counters and major faults do). Rounds interleave the sides (A B, then B A) so that a noisy
neighbour on a shared machine hits both alike; the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_accel.bench import format_table, machine_line
from lightning_accel.benchmarks.offload_workload import token_data
from lightning_accel.estimate.tier import module_tier
from lightning_accel.models import GPT, LanguageModelTask
from lightning_accel.offload.disk_io import CHUNK, THREADS, measure_bandwidth
from lightning_accel.offload.tier_plan import MIN_CHUNK, TierPlan, parse_bytes, parse_chunk
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy

IO_TARGET = 1.25  # tier step / max(in-RAM step, I/O floor)
COMPUTE_TARGET = 1.10  # tier step / in-RAM step, where compute dominates
MB = 1e6


@dataclass(frozen=True)
class Config:
    """One row: the batch shape, the tier's budget, and the target that applies."""

    name: str
    batch: int
    seq: int
    budget: int
    compute_bound: bool
    chunk: int | None = None  # strategy.nvme_chunk (None: the plan's)


@dataclass(frozen=True)
class Fit:
    """One fit's per-step figures, each the median over its timed steps."""

    step_s: float
    forward_s: float  # from the step's start to its backward
    update_s: float  # inside the optimizer's step (hooks), all threads
    wait_s: float  # waiting on the disk (OffloadStats.nvme_seconds)
    busy_s: float  # with a read or write of the tier in flight
    forward_busy_s: float  # of those, during the forward
    user_s: float  # process CPU seconds
    sys_s: float
    read_bytes: float  # through the tier (OffloadStats.nvme_read_bytes)
    write_bytes: float
    kernel_read: float  # fetched from storage for this process (/proc/self/io: the tier's and page faults')
    kernel_write: float
    major_faults: float
    host_kept: int  # host_bytes + host_optimizer_bytes after the last step
    peak_host: int  # OffloadStats.peak_host_bytes


def _proc_io() -> tuple[float, float]:
    """(read, written) bytes this process made the storage layer move (Linux; NaN elsewhere)."""
    try:
        with open("/proc/self/io") as f:
            counters = dict(line.split(": ") for line in f.read().splitlines())
        return float(counters["read_bytes"]), float(counters["write_bytes"])
    except (OSError, KeyError, ValueError):
        return float("nan"), float("nan")


class _Probe(pl.Callback):
    """Per timed step (after ``warmup``): wall time, the forward's share, time inside the optimizer's step, the tier's
    disk counters and the time it had a request in flight, the kernel's I/O counters, CPU time."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.steps: list[dict[str, float]] = []
        self._update = 0.0
        self._lock = threading.Lock()
        self._started = threading.local()
        self._hooks: list[Any] = []
        self._at: dict[str, float] = {}
        self._io: list[list[float]] = []  # [submitted, done] of every read and write of the tier
        self._backward = 0.0

    def _pre(self, *_: Any) -> None:
        self._started.t = time.perf_counter()

    def _post(self, *_: Any) -> None:
        with self._lock:
            self._update += time.perf_counter() - self._started.t

    def _timed(self, call: Callable[..., Future[None]]) -> Callable[..., Future[None]]:
        def timed(*args: Any, **kwargs: Any) -> Future[None]:
            span = [time.perf_counter(), float("inf")]
            with self._lock:
                self._io.append(span)
            future = call(*args, **kwargs)
            future.add_done_callback(lambda _: span.__setitem__(1, time.perf_counter()))
            return future
        return timed

    def _now(self, trainer: pl.Trainer) -> dict[str, float]:
        assert isinstance(trainer.strategy, L2LOffloadStrategy)
        stats = trainer.strategy.offload_stats
        usage = resource.getrusage(resource.RUSAGE_SELF)
        disk_read, disk_write = _proc_io()
        return {"t": time.perf_counter(), "update": self._update, "wait": stats.nvme_seconds, "user": usage.ru_utime,
                "sys": usage.ru_stime, "read": stats.nvme_read_bytes, "write": stats.nvme_write_bytes,
                "kernel_read": disk_read, "kernel_write": disk_write, "faults": usage.ru_majflt}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        self._hooks = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]
        # the tier's reads and writes, timed on this fit's own instance (no public handle: measurement only)
        tier = getattr(getattr(trainer.strategy, "_executor", None), "tier", None)
        if tier is not None:
            tier.io.read_spans, tier.io.write_spans = self._timed(tier.io.read_spans), self._timed(tier.io.write_spans)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        with self._lock:
            self._io = []
        self._at = self._now(trainer)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._backward = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            now = self._now(trainer)
            step = {k: now[k] - self._at[k] for k in now}
            step["forward"] = self._backward - self._at["t"]
            with self._lock:
                step["busy"] = busy_seconds(self._io, self._at["t"], now["t"])
                step["forward_busy"] = busy_seconds(self._io, self._at["t"], self._backward)
            self.steps.append(step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for hook in self._hooks:
            hook.remove()


def busy_seconds(spans: list[list[float]], start: float, end: float) -> float:
    """Seconds of [start, end] during which at least one of ``spans`` ([begin, end] each) was in flight."""
    total, reach = 0.0, start
    for begin, finish in sorted((max(b, start), min(f, end)) for b, f in spans):
        if finish > reach:
            total += finish - max(begin, reach)
            reach = finish
    return total


def _model(args: argparse.Namespace) -> LanguageModelTask:
    """The bench's GPT, one for every configuration (its positions sized to the longest sequence: the same weights)."""
    torch.manual_seed(0)
    seq = max(args.io_shape[1], args.compute_shape[1])
    return LanguageModelTask(GPT("gpt2", n_layer=args.layers, n_embd=args.width, n_head=args.heads, block_size=seq))


def _strategy(args: argparse.Namespace, nvme_path: str | None, budget: int | None = None, chunk: int | None = None) -> L2LOffloadStrategy:
    """The strategy a fit runs with (in RAM: ``nvme_path`` None), and whose plan sizes the budgets (:func:`budgets`)."""
    return L2LOffloadStrategy(overlap_step=args.overlap_step == "on", nvme_path=nvme_path,
                              host_budget=budget if nvme_path is not None else None,
                              nvme_chunk=chunk if nvme_path is not None else None)


def _fit(args: argparse.Namespace, config: Config, nvme_path: str | None) -> Fit:
    """``config`` trained for the warm-up and the timed steps, in RAM (``nvme_path`` None) or with the tier."""
    strategy = _strategy(args, nvme_path, config.budget, config.chunk)
    probe = _Probe(args.warmup)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=args.warmup + args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[probe])
    trainer.fit(_model(args), token_data(config.batch, config.seq, args.warmup + args.steps))
    stats = strategy.offload_stats

    def median(key: str) -> float:
        return statistics.median(s[key] for s in probe.steps)

    return Fit(step_s=median("t"), forward_s=median("forward"), update_s=median("update"), wait_s=median("wait"),
               busy_s=median("busy"), forward_busy_s=median("forward_busy"), user_s=median("user"), sys_s=median("sys"),
               read_bytes=median("read"), write_bytes=median("write"), kernel_read=median("kernel_read"),
               kernel_write=median("kernel_write"), major_faults=median("faults"),
               host_kept=stats.host_bytes + stats.host_optimizer_bytes, peak_host=stats.peak_host_bytes)


def budgets(args: argparse.Namespace, nvme_path: str, chunk: int | None = None) -> tuple[int, int, int, list[str]]:
    """The least ``host_budget`` the tier's plan accepts for the bench's model with step buffers of ``chunk`` (None: a
    whole block), every block's optimizer state and fp32 masters on disk; the least with the masters in RAM (the state
    alone on disk); the chunk; both plan lines. Each is the plan the fit's own strategy makes at set-up for the fit's
    own model (:func:`~lightning_accel.estimate.tier.module_tier`), under the budget the fit is given. The fits pass
    the chunk as ``nvme_chunk``: with a budget the plan's own would be a share of it instead."""
    task = _model(args)

    def plan(budget: int | None, size: int | None) -> TierPlan:
        found = module_tier(_strategy(args, nvme_path, budget, size), task, torch.float32, cuda=False)
        assert found is not None
        return found

    least = plan(None, chunk)  # no budget: everything the tier can move on disk
    if chunk is None:  # a whole block in each step buffer (the plan's choice without a budget), said as the chunk
        return budgets(args, nvme_path, max(MIN_CHUNK, least.step_buffer))
    n = len(least.units)
    state_only = dataclasses.replace(least, masters_on_disk=(False,) * n).host_bytes
    spilled, kept = plan(least.host_bytes, chunk), plan(state_only, chunk)  # the fits' plans, under their budgets
    assert spilled == dataclasses.replace(least, budget=least.host_bytes), (spilled.describe(), least.describe())
    assert not any(kept.masters_on_disk) and all(kept.state_on_disk), kept.describe()
    return least.host_bytes, state_only, chunk, [f"everything on disk: {spilled.describe()}", f"masters in RAM: {kept.describe()}"]


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB"


def _shape(text: str) -> tuple[int, int]:
    try:
        batch, seq = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not BATCHxSEQ; write e.g. 1x16") from None
    if batch < 1 or seq < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch and sequence must be >= 1; write e.g. 1x16")
    return batch, seq


def _chunk(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return parse_chunk(text)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err).replace("strategy.nvme_chunk", "--chunk")) from None


def _median_fit(fits: list[Fit]) -> Fit:
    """Each field's median over rounds."""
    return Fit(**{k: statistics.median(getattr(f, k) for f in fits) for k in Fit.__dataclass_fields__})


def floor_s(fit: Fit, read_bw: float, write_bw: float) -> float:
    """Seconds the disk needs for a step's bytes at the measured bandwidths (reads then writes: one disk serves both)."""
    return fit.read_bytes / read_bw + fit.write_bytes / write_bw


Rounds = list[tuple[Fit, Fit]]  # (in RAM, tier) of one configuration, round by round


def rows_of(fits: dict[Config, Rounds], read_bw: float, write_bw: float) -> list[list[list[str]]]:
    """The rows of the verdict, time and bytes tables. The ratios are the median over rounds of each round's ratio
    (its two fits ran back to back: the machine's drift between rounds cancels); the other figures are medians."""
    verdicts, times, nbytes = [], [], []
    for config, rounds in fits.items():
        ram, tier = _median_fit([r for r, _ in rounds]), _median_fit([t for _, t in rounds])
        floor = floor_s(tier, read_bw, write_bw)
        to_ram = [t.step_s / r.step_s for r, t in rounds]
        to_bound = [t.step_s / max(r.step_s, floor) for r, t in rounds]
        ratio, limit = (statistics.median(to_ram), COMPUTE_TARGET) if config.compute_bound else (statistics.median(to_bound), IO_TARGET)
        target = f"<= {limit:.2f}x {'in-RAM' if config.compute_bound else 'max'}"
        verdicts.append([config.name, f"{config.batch}x{config.seq}", f"{config.budget / MB:.1f}", f"{ram.step_s:.3f}",
                         f"{tier.step_s:.3f}", f"{floor:.3f}", f"{statistics.median(to_ram):.2f}", f"{statistics.median(to_bound):.2f}",
                         " ".join(f"{x:.2f}" for x in (to_ram if config.compute_bound else to_bound)), target,
                         "met" if ratio <= limit else "NOT MET"])
        for side, fit in (("in RAM", ram), ("tier", tier)):
            times.append([config.name, side, f"{fit.step_s:.3f}", f"{fit.forward_s:.3f}", f"{fit.update_s:.3f}",
                          f"{fit.wait_s:.3f}", f"{fit.busy_s:.3f}", f"{fit.user_s:.2f}", f"{fit.sys_s:.2f}"])
            nbytes.append([config.name, side, f"{fit.read_bytes / MB:.1f}", f"{fit.write_bytes / MB:.1f}",
                           f"{fit.kernel_read / MB:.1f}", f"{fit.kernel_write / MB:.1f}", f"{fit.major_faults:.0f}",
                           f"{fit.host_kept / MB:.1f}", f"{fit.peak_host / MB:.1f}"])
    return [verdicts, times, nbytes]


def _limits(fits: dict[Config, Rounds], read_bw: float, write_bw: float) -> list[str]:
    """Where each configuration's tier step went beyond the in-RAM one, from the tables' columns."""
    out = []
    for config, rounds in fits.items():
        ram, tier = _median_fit([r for r, _ in rounds]), _median_fit([t for _, t in rounds])
        out.append(
            f"{config.name}: tier - in-RAM {tier.step_s - ram.step_s:+.3f} s/step (forward {tier.forward_s - ram.forward_s:+.3f}, "
            f"update {tier.update_s - ram.update_s:+.3f}, disk wait {tier.wait_s:+.3f}, system CPU {tier.sys_s - ram.sys_s:+.2f}); "
            f"the tier's I/O in flight {tier.busy_s:.3f} s of the step (floor {floor_s(tier, read_bw, write_bw):.3f} s), "
            f"{tier.forward_busy_s:.3f} s of it during the forward; storage read {(tier.kernel_read - tier.read_bytes) / MB:.1f} MB "
            f"a step beyond the tier's reads, {tier.major_faults - ram.major_faults:+.0f} major faults")
    return out


def nvme_table(args: argparse.Namespace) -> str:
    """Every configuration in interleaved rounds; the tables and their notes."""
    load = os.getloadavg()
    owned = args.nvme_path is None
    root = tempfile.mkdtemp(prefix="lightning-accel-bench-nvme-") if owned else args.nvme_path
    try:
        least, state_only, chunk, plans = budgets(args, root, args.chunk)
        budget = least if args.host_budget is None else parse_bytes(args.host_budget, "--host-budget")
        configs = [Config(f"{name}{kept}", shape[0], shape[1], limit, name == "compute-bound", chunk)
                   for name, shape in (("io-bound", args.io_shape), ("compute-bound", args.compute_shape))
                   for kept, limit in (("", budget), (", masters in RAM", state_only))]
        if args.small_chunk is not None:  # what the chunk costs: the io-bound row again, every unit stepped in small chunks
            small, _, _, small_plans = budgets(args, root, args.small_chunk)
            plans.append(small_plans[0].replace("everything on disk:", f"everything on disk, {_mib(args.small_chunk)} chunks:"))
            configs.insert(1, Config(f"io-bound, {_mib(args.small_chunk)} chunks", args.io_shape[0], args.io_shape[1], small, False,
                                     args.small_chunk))
        fits: dict[Config, Rounds] = {c: [] for c in configs}
        bandwidth: list[tuple[float, float]] = []
        for r in range(args.rounds):
            bandwidth.append(measure_bandwidth(root, args.probe_mb << 20))
            for config, rounds in fits.items():
                paths = [None, root] if r % 2 == 0 else [root, None]
                got = {path: _fit(args, config, path) for path in paths}
                rounds.append((got[None], got[root]))
        read_bw = statistics.median(b[0] for b in bandwidth)
        write_bw = statistics.median(b[1] for b in bandwidth)
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)
    verdicts, times, nbytes = rows_of(fits, read_bw, write_bw)
    after = os.getloadavg()
    params = sum(p.numel() for p in _model(args).parameters())
    return "\n".join([
        f"NVMe tier: GPT {args.layers} x width {args.width} ({params / 1e6:.1f}M params), CPU device, fp32, AdamW, overlap_step "
        f"{args.overlap_step}, {args.rounds} interleaved rounds of {args.warmup} + {args.steps} steps; nvme_path on the disk of "
        f"{tempfile.gettempdir() if owned else root}: read {read_bw / MB:.0f} MB/s, write {write_bw / MB:.0f} MB/s "
        f"({CHUNK >> 20} MiB requests x {THREADS} threads, O_DIRECT, {args.probe_mb} MiB, median of read/write "
        + ", ".join(f"{r / MB:.0f}/{w / MB:.0f}" for r, w in bandwidth) + ")",
        *(f"plan, {line}" for line in plans),
        "step times: medians; ratios: the median over rounds of each round's ratio (both fits of a round back to back), "
        "then the judged ratio round by round",
        format_table(["configuration", "batch", "budget MB", "in-RAM s", "tier s", "I/O floor s", "tier/in-RAM",
                      "tier/max(in-RAM,floor)", "per round", "target", "verdict"], verdicts),
        "where a step's time goes (medians per step; forward: to the backward's start; update: inside the optimizer's step, "
        "every thread; disk wait: OffloadStats.nvme_seconds; disk busy: a read or write of the tier in flight; CPU: this process)",
        format_table(["configuration", "side", "step s", "forward s", "update s", "disk wait s", "disk busy s", "user CPU s",
                      "sys CPU s"], times),
        "bytes per step (tier: OffloadStats.nvme_*; storage: /proc/self/io; host kept: host_bytes + host_optimizer_bytes "
        "after the last step; peak_host: OffloadStats.peak_host_bytes)",
        format_table(["configuration", "side", "tier read MB", "tier written MB", "storage read MB", "storage written MB",
                      "major faults", "host kept MB", "peak_host MB"], nbytes),
        *_limits(fits, read_bw, write_bw),
        f"load average (1 min) {load[0]:.2f} before, {after[0]:.2f} after",
    ])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-accel bench offload --nvme")
    p.add_argument("--nvme-path", default=None, help="directory on the disk to measure (default: a fresh one under the temp dir)")
    p.add_argument("--host-budget", default=None, help="host_budget of the io-bound and compute-bound rows, e.g. 300MB "
                   "(default: the least the plan accepts, every block's state and masters on disk)")
    p.add_argument("--layers", type=int, default=12, help="GPT depth (one block per layer)")
    p.add_argument("--width", type=int, default=512, help="GPT width: a block holds 12 x width^2 parameters")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--io-shape", type=_shape, default=(1, 16), help="BATCHxSEQ of the I/O-bound configurations")
    p.add_argument("--compute-shape", type=_shape, default=(4, 64), help="BATCHxSEQ of the compute-bound configuration")
    p.add_argument("--chunk", type=_chunk, default=None, help="nvme_chunk of the four configurations, e.g. 64MiB (default: the "
                   "plan's, here a whole block: the step buffers each hold one block's state and masters)")
    p.add_argument("--small-chunk", type=_chunk, default=4 << 20, help="the io-bound row again with every unit stepped in "
                   "chunks of this size: what the chunk costs (default 4MiB; 'none' leaves the row out)")
    p.add_argument("--overlap-step", choices=["on", "off"], default="on",
                   help="on: blocks step during the backward, each unit's read started as the backward begins (both sides)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=3, help="timed steps per fit, after the warm-up")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per fit (the first step creates the state)")
    p.add_argument("--probe-mb", type=int, default=256, help="MiB written then read to measure the disk, each round")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    for flag in ("layers", "width", "heads", "rounds", "steps", "warmup", "probe_mb"):
        if getattr(args, flag) < 1:
            parser().error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}; e.g. --rounds 3 --steps 3")
    print(nvme_table(args))
    print(machine_line())
    return 0
