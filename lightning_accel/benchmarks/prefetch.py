"""``lightning-accel bench prefetch``: seed 004's data-wait experiment through a real Trainer.

Each batch is one (4, 1000000, 3) float32 array (48 MB) that takes 0.5 s of I/O
latency to read; each training step takes 0.1 s. For each contender the same model
trains for the same steps, and :class:`DataWaitMonitor` measures the wait for every
batch. Contenders: a plain Python loop over the dataset, DataLoader defaults,
DataLoader with Lightning's suggested worker count, a hand-tuned DataLoader,
PrefetchTuner starting from defaults, PrefetchTuner again from the cache the first
run wrote (a second run of the same data on the same machine), and Ray Data with its
own defaults when the ``ray`` extra is installed (the seed's fourth contender).
Timings are ratios against the hand-tuned row, measured in the same run; the
steady-state wait is the median of the last waits, so one hiccup of a shared machine
does not move it.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from collections.abc import Iterator

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import suggested_max_num_workers
from torch.utils.data import DataLoader, default_collate

from lightning_accel.bench import format_table, machine_line, register_benchmark
from lightning_accel.callbacks import DataWaitMonitor, PrefetchTuner
from lightning_accel.data.synthetic import SyntheticArrays


class _PlainLoop:
    """``for i in range(n): yield dataset[i]``, batched by one: what a loop without a DataLoader does."""

    def __init__(self, dataset: SyntheticArrays) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator:
        for i in range(len(self.dataset)):
            yield default_collate([self.dataset[i]])


class _RayData:
    """The same items through Ray Data with its defaults: ``ray.data.range(n).map(...)``, one item per batch.

    Ray runs the ``map`` as tasks (its default concurrency follows the CPUs it was given)
    and ``iter_batches`` prefetches one batch, which is what a user gets without
    tuning, as the DataLoader-defaults row is for the DataLoader.
    """

    def __init__(self, dataset: SyntheticArrays) -> None:
        import ray
        import ray.data

        if not ray.is_initialized():
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # the table is the report; keep Ray's progress off the console
        context.print_on_execution_start = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator:
        import ray.data

        dataset = self.dataset

        def load(row: dict) -> dict:
            x, y = dataset[int(row["id"])]
            return {"x": x.numpy(), "y": y.numpy()}

        pipeline = ray.data.range(len(dataset)).map(load)
        # iter_batches + from_numpy is what iter_torch_batches does on the CPU, without
        # importing ray.train (which needs pydantic, not part of ray[data]).
        for batch in pipeline.iter_batches(batch_size=1, batch_format="numpy"):
            yield torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"])


def _ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


class _FixedStep(pl.LightningModule):
    """Reads the batch, then takes ``step_s`` of simulated compute (as in the seed experiment)."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.step_s = step_s

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.weight * x[..., :1].mean() - y.mean()) ** 2  # touches the batch, costs ~nothing
        time.sleep(self.step_s)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) <= 0:
        raise argparse.ArgumentTypeError(f"--shape {text!r} is not positive integers separated by commas; e.g. 4,1000000,3")
    return shape


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-accel bench prefetch", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="training steps per contender")
    p.add_argument("--latency", type=float, default=0.5, help="seconds of I/O latency per batch")
    p.add_argument("--step", type=float, default=0.1, help="seconds of compute per training step")
    p.add_argument("--shape", type=_shape, default=(4, 1_000_000, 3), help="array per batch, e.g. 4,1000000,3")
    p.add_argument("--hand-workers", type=int, default=8, help="num_workers of the hand-tuned reference")
    p.add_argument("--steady-steps", type=int, default=20, help="steady wait: median over this many last steps")
    p.add_argument("--csv", default=None, help="write the tuner's trials (throughput against settings) here")
    p.add_argument("--plot", default=None, help="write an SVG of throughput against the settings tried here")
    return p


def _fit(loader, step_s: float, steps: int, callbacks: list) -> tuple[DataWaitMonitor, float]:
    monitor = DataWaitMonitor()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, monitor],
    )
    start = time.perf_counter()
    trainer.fit(_FixedStep(step_s), loader)
    return monitor, time.perf_counter() - start


@register_benchmark("prefetch", "seed 004: wait for the next batch, plain loop vs DataLoader settings vs PrefetchTuner")
def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.steps < 4:
        raise SystemExit(f"--steps {args.steps} is too few to see a steady state; pass --steps 4 or more (default 60)")
    if args.steady_steps < 1:
        raise SystemExit(f"--steady-steps {args.steady_steps} must be at least 1; pass e.g. --steady-steps 20")
    dataset = SyntheticArrays(args.steps, shape=args.shape, latency_s=args.latency)
    suggested = suggested_max_num_workers(1)
    with tempfile.TemporaryDirectory() as tmp:
        cache_path = str(Path(tmp) / "prefetch_tuned.json")  # fresh: the first tuner run searches
        tuner, second = PrefetchTuner(cache_path=cache_path), PrefetchTuner(cache_path=cache_path)
        contenders = [
            ("plain loop", lambda: _PlainLoop(dataset), []),
            ("DataLoader defaults (workers=0)", lambda: DataLoader(dataset, batch_size=1), []),
            (f"DataLoader, Lightning's suggestion (workers={suggested})", lambda: DataLoader(dataset, batch_size=1, num_workers=suggested), []),
            (
                f"DataLoader, hand-tuned (workers={args.hand_workers})",
                lambda: DataLoader(dataset, batch_size=1, num_workers=args.hand_workers, persistent_workers=True),
                [],
            ),
            ("PrefetchTuner, from defaults", lambda: DataLoader(dataset, batch_size=1), [tuner]),
            ("PrefetchTuner, from cache (second run)", lambda: DataLoader(dataset, batch_size=1), [second]),
        ]
        if _ray_available():
            contenders.append(("Ray Data (its defaults)", lambda: _RayData(dataset), []))
        results = []
        for name, make, callbacks in contenders:
            monitor, wall = _fit(make(), args.step, args.steps, callbacks)
            waits = monitor.meter.waits[: len(monitor.meter.steps)]
            steady = statistics.median(waits[-min(args.steady_steps, max(1, len(waits) // 2)) :])
            results.append((name, sum(waits) / len(waits), steady, wall))
    if _ray_available():
        import ray

        ray.shutdown()
    reference = next(r[3] for r in results if r[0].startswith("DataLoader, hand-tuned"))
    rows = [[name, mean, steady, wall, f"{wall / reference:.2f}x"] for name, mean, steady, wall in results]
    if not _ray_available():
        rows.append(["Ray Data", "-", "-", "-", "not measured: pip install 'lightning-accel[ray]'"])
    print(
        f"seed 004 workload: batch {tuple(args.shape)} float32, {args.latency} s latency, {args.step} s step, "
        f"{args.steps} steps; steady wait: median of the last {min(args.steady_steps, max(1, args.steps // 2))} steps"
    )
    print(format_table(["contender", "mean wait s", "steady wait s", "fit s", "fit vs hand-tuned"], rows))
    print(tuner.report())
    print(f"second run: {second.reason}")
    tuned = next(r for r in results if r[0] == "PrefetchTuner, from defaults")
    print(
        f"targets, tuner from defaults: steady wait {tuned[2]:.3f} s (<= 0.010: {'yes' if tuned[2] <= 0.01 else 'no'}); "
        f"search over by step {tuner.finished_step} (<= 30: {'yes' if (tuner.finished_step or 0) <= 30 else 'no'}); "
        f"fit {tuned[3] / reference:.2f}x hand-tuned (<= 1.10: {'yes' if tuned[3] <= 1.1 * reference else 'no'})"
    )
    print(machine_line())
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(tuner.trials_csv())
        print(f"tuner trials written to {args.csv}")
    if args.plot:
        Path(args.plot).write_text(tuner.trials_svg())
        print(f"throughput against the settings tried plotted to {args.plot}")
    return 0
