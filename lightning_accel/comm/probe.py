"""Training a small model data-parallel under one communication option, and measuring it.

The equivalence tests and ``lightning-accel bench ddp`` need the same experiment: two
(or more) gloo processes train identical copies of one MLP on their own shards of the
same data, once per :class:`DDPOption`, and report the loss at every optimizer step,
the bytes each process all-reduced per step (:mod:`lightning_accel.comm.traffic`), the
mean step time, and the final weights. Every option sees the same initial weights and
the same batches, so any difference in the results is the option's doing.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_accel.comm.hooks import CommHookSpec, register_comm_hook
from lightning_accel.comm.rendezvous import held_store, store_env
from lightning_accel.comm.traffic import metered_all_reduce


@dataclasses.dataclass(frozen=True)
class DDPOption:
    """One way of running DDP: hook, bucket size, static graph, gradient accumulation."""

    label: str
    hook: CommHookSpec = CommHookSpec("allreduce")
    bucket_cap_mb: float = 25.0  # DDP's default; smaller buckets start all-reduce earlier in backward
    static_graph: bool = False
    accumulate: int = 1  # micro-batches per optimizer step
    # False: the first accumulate-1 micro-batches run under no_sync (one all-reduce per
    # step). True: all-reduce after every micro-batch -- the reference no_sync must equal.
    sync_every_micro_batch: bool = False


@dataclasses.dataclass
class ProbeResult:
    """What one option did, from rank 0's point of view (losses: mean over ranks)."""

    label: str
    losses: list[float]
    bytes_per_step: float
    calls_per_step: float
    step_seconds: float
    params: list[torch.Tensor]


def _mlp(width: int, depth: int, dtype: torch.dtype) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1)).to(dtype)


def _batch(step: int, rank: int, batch: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(batch, width, generator=g, dtype=dtype)
    return x, x[:, :4].sum(dim=1, keepdim=True).sin()  # a smooth target the MLP can fit


def _train(rank: int, option: DDPOption, cfg: dict[str, Any]) -> dict[str, Any]:
    dtype = getattr(torch, cfg["dtype"])
    torch.manual_seed(cfg["seed"])
    model = DistributedDataParallel(
        _mlp(cfg["width"], cfg["depth"], dtype),
        bucket_cap_mb=option.bucket_cap_mb,
        static_graph=option.static_graph,
        gradient_as_bucket_view=True,
    )
    register_comm_hook(model, option.hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    k = option.accumulate
    losses, seconds = [], []
    with metered_all_reduce() as traffic:
        for step in range(cfg["warmup"] + cfg["steps"]):
            if step == cfg["warmup"]:
                traffic.reset()
            x, y = _batch(step, rank, cfg["batch"], cfg["width"], dtype)
            started = time.perf_counter()
            total = 0.0
            for i, (xs, ys) in enumerate(zip(x.chunk(k), y.chunk(k))):
                last = i == k - 1
                with model.no_sync() if not (last or option.sync_every_micro_batch) else _nullcontext():
                    loss = nn.functional.mse_loss(model(xs), ys) / k
                    loss.backward()
                total += loss.item()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= cfg["warmup"]:
                seconds.append(time.perf_counter() - started)
                losses.append(total)
    steps = max(cfg["steps"], 1)
    return {
        "losses": losses,
        "bytes": traffic.bytes / steps,
        "calls": traffic.calls / steps,
        "seconds": sum(seconds) / len(seconds) if seconds else float("nan"),
        # numpy, not tensors: torch's queue pickler would pass tensors as shared-memory handles
        "params": [p.detach().numpy().copy() for p in model.module.parameters()] if cfg["return_params"] else [],
    }


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _worker(rank: int, world_size: int, port: int, options: Sequence[DDPOption], cfg: dict[str, Any], queue: Any) -> None:
    torch.set_num_threads(cfg["threads"])
    os.environ.update(store_env(port))  # a client of the store probe() holds
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for option in options:
            dist.barrier()  # start every option together, so step times are comparable
            out = _train(rank, option, cfg)
            queue.put((rank, option.label, out if rank == 0 else {"losses": out["losses"]}))
    finally:
        dist.destroy_process_group()


def _context() -> Any:
    """How the probe starts its processes: forkserver where the platform has one, preloading this module (so
    torch), so that every probe after the first forks a process that has imported torch already, where spawn
    imports it again in each (seconds per process); spawn elsewhere. Never plain fork: the caller may be running
    torch's or gloo's threads, which a forked child would inherit half-held."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # (read when this process starts its server: the first probe)
    return ctx


def probe(
    options: Sequence[DDPOption],
    *,
    world_size: int = 2,
    steps: int = 8,
    warmup: int = 2,
    batch: int = 16,
    width: int = 64,
    depth: int = 3,
    lr: float = 0.05,
    dtype: str = "float32",
    seed: int = 0,
    threads: int = 1,
    return_params: bool = True,
    timeout_s: float = 300.0,
) -> list[ProbeResult]:
    """Run every option in ``world_size`` gloo processes on this machine; one result per option.

    ``batch`` is per process and per optimizer step (split into ``accumulate`` micro-batches).
    """
    for option in options:
        if batch % option.accumulate:
            raise ValueError(f"batch={batch} must be divisible by {option.label}'s accumulate={option.accumulate}")
    cfg = dict(steps=steps, warmup=warmup, batch=batch, width=width, depth=depth, lr=lr, dtype=dtype, seed=seed,
               threads=threads, return_params=return_params)
    ctx = _context()
    queue = ctx.SimpleQueue()
    store = held_store(timeout_s)
    procs = [ctx.Process(target=_worker, args=(r, world_size, store.port, options, cfg, queue), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[str, dict[int, dict[str, Any]]] = {}
    deadline = time.monotonic() + timeout_s
    expected = len(options) * world_size
    received = 0
    try:
        while received < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"DDP probe did not finish in {timeout_s:.0f} s ({received}/{expected} results)")
            if queue.empty():
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a DDP probe process failed (exit codes {[p.exitcode for p in procs]})")
                time.sleep(0.05)
                continue
            rank, label, out = queue.get()
            results.setdefault(label, {})[rank] = out
            received += 1
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store
    out_list = []
    for option in options:
        per_rank = results[option.label]
        losses = [sum(per_rank[r]["losses"][i] for r in range(world_size)) / world_size for i in range(steps)]
        zero = per_rank[0]
        params = [torch.from_numpy(a) for a in zero["params"]]
        out_list.append(ProbeResult(option.label, losses, zero["bytes"], zero["calls"], zero["seconds"], params))
    return out_list
