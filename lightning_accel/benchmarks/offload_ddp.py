"""``lightning-accel bench offload --devices N``: L2L offload data parallel against plain DDP, N gloo processes.

The parent process starts ``python -m lightning_accel.benchmarks.offload_ddp OUT ...`` (Lightning's
launcher starts the other ranks from it); each rank trains the same GPT on its shard of the same
random tokens with plain Lightning DDP, ``l2l_offload_ddp`` with the partitioned host step, with
the replicated one, and partitioned without block checkpointing, in interleaved rounds, and writes what it measured; the parent prints
the table. Per contender: the median step time and its ratio to DDP in the same run (absolute
times on a shared machine are noise), the optimizer state each rank holds (for the parameters
offloaded to the host, and in all), the host weights each rank holds (fp32 masters and
low-precision copies), and the payload of the gradient collectives and the weight broadcast of
one optimizer step. On a CPU "device" the host is the device: the time column shows the cost of
the mechanism, not of a bus; the bytes columns are what transfers to a GPU node.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.bench import format_table
from lightning_accel.models import GPT, LanguageModelTask
from lightning_accel.strategies.l2l_offload_ddp import L2LOffloadDDPStrategy

# name -> L2LOffloadDDPStrategy arguments (None: Lightning's DDP); plain DDP first, the baseline of the ratios
CONTENDERS: dict[str, dict[str, Any] | None] = {
    "plain DDP": None,
    "l2l_offload_ddp, partitioned": {"host_step": "partitioned"},
    "l2l_offload_ddp, replicated": {"host_step": "replicated"},
    # without the recomputation of each block in backward: what the data-parallel mechanism itself costs
    "l2l_offload_ddp, partitioned, no checkpointing": {"host_step": "partitioned", "checkpoint_blocks": False},
}


class _Meter(pl.Callback):
    """Step times after ``warmup`` steps; the strategy's and optimizer's bytes at the last step."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.bytes = warmup, [], {}
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)
        optimizer = trainer.optimizers[0]
        total = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
        strategy = trainer.strategy
        if isinstance(strategy, L2LOffloadDDPStrategy):
            self.bytes = {"host_opt": strategy.host_optimizer_bytes(), "opt": total, "host_weights": strategy.host_weight_bytes(),
                          "reduced": strategy.reduced_bytes, "gathered": strategy.gathered_bytes}
        else:  # DDP all-reduces every gradient; nothing lives on the host apart from the device
            grads = sum(p.numel() * p.element_size() for p in trainer.lightning_module.parameters() if p.requires_grad)
            self.bytes = {"host_opt": 0, "opt": total, "host_weights": 0, "reduced": grads, "gathered": 0}


def _fit(name: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = LanguageModelTask(GPT(args.preset, n_layer=args.layers, block_size=args.seq))
    tokens = torch.randint(0, 256, (args.batch * args.steps * args.devices, args.seq + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)
    kwargs = CONTENDERS[name]
    strategy: Any = "ddp" if kwargs is None else L2LOffloadDDPStrategy(**kwargs)
    meter = _Meter(args.warmup)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[meter])
    trainer.fit(model, data)
    return {"times": meter.times, **meter.bytes, "params": sum(p.numel() for p in model.parameters()), "rank": trainer.global_rank}


def _worker(out: str, args: argparse.Namespace) -> None:
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTENDERS}
    rank = 0
    for _ in range(args.rounds):  # interleaved: a noisy neighbour hits every contender alike
        for name in CONTENDERS:
            got = _fit(name, args)
            rank = got["rank"]
            results[name].append(got)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def _argv(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("devices", "preset", "layers", "batch", "seq", "steps", "warmup", "rounds")]


def ddp_table(args: argparse.Namespace) -> str:
    """Run the N-process worker and format its table."""
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)  # a fresh launch
        proc = subprocess.run([sys.executable, "-m", "lightning_accel.benchmarks.offload_ddp", out, *_argv(args)],
                              env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"bench offload --devices {args.devices}: the worker failed:\n{proc.stderr[-3000:]}")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.devices)]
    mib = 2**20
    times = {n: sorted(t for r in ranks[0][n] for t in r["times"]) for n in CONTENDERS}
    median = {n: t[len(t) // 2] for n, t in times.items()}
    rows = []
    for name in CONTENDERS:
        per_rank = [rank[name][-1] for rank in ranks]
        held = [r["host_opt"] for r in per_rank]
        rows.append([
            name, f"{median[name]:.3f}", f"{median[name] / median['plain DDP']:.2f}",
            "/".join(f"{h / mib:.2f}" for h in held) if any(held) else "-",
            f"{max(r['opt'] for r in per_rank) / mib:.2f}",
            f"{per_rank[0]['host_weights'] / mib:.2f}" if per_rank[0]["host_weights"] else "-",
            f"{per_rank[0]['reduced'] / 1e6:.2f}", f"{per_rank[0]['gathered'] / 1e6:.2f}",
        ])
    params = ranks[0]["plain DDP"][0]["params"]
    header = ["contender", "step s (median)", "x DDP", "host opt. state MiB per rank", "opt. state MiB (max rank)",
              "host weights MiB/rank", "MB reduced/step", "MB gathered/step"]
    title = (f"GPT {args.preset} x{args.layers} layers ({params / 1e6:.1f}M params), {args.devices} gloo processes on the CPU, "
             f"batch {args.batch}x{args.seq} per rank, {args.rounds} interleaved rounds of {args.steps} steps")
    return title + "\n" + format_table(header, rows)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lightning_accel.benchmarks.offload_ddp")
    p.add_argument("out")
    for flag, kind, default in (("devices", int, 2), ("preset", str, "tiny"), ("layers", int, 8), ("batch", int, 8), ("seq", int, 128),
                                ("steps", int, 12), ("warmup", int, 2), ("rounds", int, 3)):
        p.add_argument(f"--{flag}", type=kind, default=default)
    return p


if __name__ == "__main__":
    parsed = _parser().parse_args()
    torch.set_num_threads(1)
    _worker(parsed.out, parsed)
