"""``lightning-accel bench prefetch``: data wait and fit time, DataLoader settings vs PrefetchTuner, on four workloads.

Workloads (``--workloads``, all by default):

- ``seed004``: seed 004's experiment. Each batch is one (4, 1000000, 3) float32 array
  (48 MB) that takes 0.5 s of I/O latency to read; each training step takes 0.1 s.
  Extra contenders: a plain Python loop, the tuner's second run from its cache, and Ray
  Data with its own defaults when the ``ray`` extra is installed.
- ``stream``: issue 15's held-out stream, one endless epoch: an ``IterableDataset`` that
  yields forever, each item 0.2 s of I/O latency, batch of 1, a 0.05 s step.
- ``jpeg``: JPEG files written at bench time, decoded with Pillow plus a random resized
  crop, a flip and normalisation (CPU-bound), map-style, batches of 16.
- ``jpeg-tar``: the same images from webdataset-style tar shards, one endless stream.

Each workload trains the same model for the same steps under: DataLoader defaults,
Lightning's suggested worker count, each hand-set ``num_workers`` of ``--sweep`` (the
best by fit time is the reference), and PrefetchTuner starting from defaults. Steps
sleep (an accelerator's step leaves the host CPU free). :class:`DataWaitMonitor` measures
the wait for every batch; the steady wait is the median of the last waits, so one hiccup
of a shared machine does not move it. Timings are ratios against the best hand-set row
measured in the same run, and the load average is printed with the machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import suggested_max_num_workers
from torch.utils.data import DataLoader, default_collate

from lightning_accel.bench import format_table, machine_line, register_benchmark
from lightning_accel.benchmarks.decode_data import JpegFiles, JpegTarStream, LatencyStream, write_jpegs, write_shards
from lightning_accel.callbacks import DataWaitMonitor, PrefetchTuner
from lightning_accel.data.synthetic import SyntheticArrays

WORKLOADS = ("seed004", "stream", "jpeg", "jpeg-tar")


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
        loss = (self.weight * x[..., :1].mean() - y.float().mean()) ** 2  # touches the batch, costs ~nothing
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


def _ints(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"--sweep {text!r} is not positive integers separated by commas; e.g. 1,2,4,8")
    return sorted(set(values))


def _workloads(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--workloads {text!r}: unknown {unknown or 'none given'}; choose from {','.join(WORKLOADS)}")
    return names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-accel bench prefetch", description=__doc__.splitlines()[0])
    p.add_argument("--workloads", type=_workloads, default=list(WORKLOADS), help=f"comma-separated, of {','.join(WORKLOADS)}")
    p.add_argument("--sweep", type=_ints, default=[2, 4, 8], help="hand-set num_workers tried on each workload")
    p.add_argument("--steady-steps", type=int, default=20, help="steady wait: median over this many last steps")
    g = p.add_argument_group("seed004")
    g.add_argument("--steps", type=int, default=40, help="training steps")
    g.add_argument("--latency", type=float, default=0.5, help="seconds of I/O latency per batch")
    g.add_argument("--step", type=float, default=0.1, help="seconds of compute per training step")
    g.add_argument("--shape", type=_shape, default=(4, 1_000_000, 3), help="array per batch, e.g. 4,1000000,3")
    g.add_argument("--hand-workers", type=int, default=8, help="num_workers of seed 004's hand-tuned reference")
    g.add_argument("--csv", default=None, help="write the tuner's trials (throughput against settings) here")
    g.add_argument("--plot", default=None, help="write an SVG of throughput against the settings tried here")
    g = p.add_argument_group("stream")
    g.add_argument("--stream-steps", type=int, default=130, help="training steps (the target reads steps 100-120)")
    g.add_argument("--stream-latency", type=float, default=0.2, help="seconds of I/O latency per item")
    g.add_argument("--stream-step", type=float, default=0.05, help="seconds per training step")
    g = p.add_argument_group("jpeg, jpeg-tar")
    g.add_argument("--jpeg-steps", type=int, default=150, help="training steps")
    g.add_argument("--images", type=int, default=256, help="JPEG files written (320x240)")
    g.add_argument("--jpeg-batch", type=int, default=16, help="images per batch")
    g.add_argument("--jpeg-size", type=int, default=128, help="crop size after decoding")
    g.add_argument("--jpeg-step", type=float, default=0.01, help="seconds per training step (shorter than decoding a batch on one core)")
    return p


def _fit(loader, step_s: float, steps: int, callbacks: list) -> tuple[DataWaitMonitor, float]:
    monitor = DataWaitMonitor()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, monitor],
    )
    start = time.perf_counter()
    trainer.fit(_FixedStep(step_s), loader)
    return monitor, time.perf_counter() - start


@dataclass
class _Row:
    name: str
    waits: list[float]
    wall_s: float
    hand_workers: int | None = None  # set for the rows of the hand-set sweep

    def steady(self, last: int) -> float:
        return statistics.median(self.waits[-min(last, max(1, len(self.waits) // 2)) :])


def _run(name: str, make: Callable[[], object], step_s: float, steps: int, callbacks: list, hand: int | None = None) -> _Row:
    monitor, wall = _fit(make(), step_s, steps, callbacks)
    return _Row(name, monitor.meter.waits[: len(monitor.meter.steps)], wall, hand)


def _standard_rows(
    make: Callable[[int], DataLoader], step_s: float, steps: int, sweep: list[int], tuner: PrefetchTuner
) -> list[_Row]:
    """Defaults, Lightning's suggestion, the hand-set sweep, the tuner from defaults: one fit each, in this order."""
    suggested = suggested_max_num_workers(1)
    rows = [
        _run("DataLoader defaults (workers=0)", lambda: make(0), step_s, steps, []),
        _run(f"Lightning's suggestion (workers={suggested})", lambda: make(suggested), step_s, steps, []),
    ]
    for w in sweep:
        rows.append(_run(f"hand-set workers={w}", lambda w=w: make(w), step_s, steps, [], hand=w))
    rows.append(_run("PrefetchTuner, from defaults", lambda: make(0), step_s, steps, [tuner]))
    return rows


def _table(rows: list[_Row], steady_steps: int) -> tuple[str, float]:
    """The table, and the best hand-set fit time every ratio is against."""
    reference = min(r.wall_s for r in rows if r.hand_workers is not None)
    out = []
    for r in rows:
        mark = " <- best hand-set" if r.hand_workers is not None and r.wall_s == reference else ""
        mean = sum(r.waits) / len(r.waits) if r.waits else float("nan")
        out.append([r.name, mean, r.steady(steady_steps), r.wall_s, f"{r.wall_s / reference:.2f}x{mark}"])
    return format_table(["contender", "mean wait s", "steady wait s", "fit s", "fit vs best hand-set"], out), reference


def _tuner_line(tuner: PrefetchTuner) -> str:
    chosen = tuner.chosen.label() if tuner.chosen is not None else "(kept defaults)"
    line = f"  tuner: {chosen}; {tuner.reason}; search over by step {tuner.finished_step}"
    return line + (f"\n  {tuner.cpu_note}" if tuner.cpu_note else "")


def _fit_target(name: str, rows: list[_Row], reference: float) -> tuple[str, bool]:
    tuned = next(r for r in rows if r.name.startswith("PrefetchTuner, from defaults"))
    ok = tuned.wall_s <= 1.05 * reference
    return f"{name}: tuner fit {tuned.wall_s / reference:.3f}x best hand-set (<= 1.05: {'yes' if ok else 'no'})", ok


def _seed004(args: argparse.Namespace, tmp: str) -> list[str]:
    dataset = SyntheticArrays(args.steps, shape=args.shape, latency_s=args.latency)
    cache_path = str(Path(tmp) / "prefetch_tuned.json")  # fresh: the first tuner run searches
    tuner, second = PrefetchTuner(cache_path=cache_path), PrefetchTuner(cache_path=cache_path)

    def make(w: int) -> DataLoader:
        return DataLoader(dataset, batch_size=1, num_workers=w, persistent_workers=w > 0)

    sweep = sorted(set(args.sweep) | {args.hand_workers})
    rows = [_run("plain loop", lambda: _PlainLoop(dataset), args.step, args.steps, [])]
    rows += _standard_rows(make, args.step, args.steps, sweep, tuner)
    rows.append(_run("PrefetchTuner, from cache (second run)", lambda: make(0), args.step, args.steps, [second]))
    if _ray_available():
        rows.append(_run("Ray Data (its defaults)", lambda: _RayData(dataset), args.step, args.steps, []))
        import ray

        ray.shutdown()
    table, reference = _table(rows, args.steady_steps)
    if not _ray_available():
        table += "\nRay Data: not measured: pip install 'lightning-accel[ray]'"
    tuned = next(r for r in rows if r.name == "PrefetchTuner, from defaults")
    target, _ = _fit_target("seed004", rows, reference)
    lines = [
        f"== seed004: batch {tuple(args.shape)} float32, {args.latency} s latency, {args.step} s step, {args.steps} steps",
        table,
        _tuner_line(tuner),
        f"  second run: {second.reason}",
        f"  targets, tuner from defaults: steady wait {tuned.steady(args.steady_steps):.3f} s (<= 0.010: "
        f"{'yes' if tuned.steady(args.steady_steps) <= 0.01 else 'no'}); search over by step {tuner.finished_step}; {target}",
    ]
    if args.csv:
        Path(args.csv).write_text(tuner.trials_csv())
        lines.append(f"  tuner trials written to {args.csv}")
    if args.plot:
        Path(args.plot).write_text(tuner.trials_svg())
        lines.append(f"  throughput against the settings tried plotted to {args.plot}")
    return lines


def _stream(args: argparse.Namespace, tmp: str) -> list[str]:
    tuner = PrefetchTuner()

    def make(w: int) -> DataLoader:
        return DataLoader(LatencyStream(args.stream_latency), batch_size=1, num_workers=w, persistent_workers=w > 0)

    rows = _standard_rows(make, args.stream_step, args.stream_steps, args.sweep, tuner)
    table, reference = _table(rows, args.steady_steps)
    tuned = next(r for r in rows if r.name == "PrefetchTuner, from defaults")
    window = tuned.waits[100:120] if len(tuned.waits) >= 120 else tuned.waits[-args.steady_steps :]
    where = "steps 100-120" if len(tuned.waits) >= 120 else f"the last {len(window)} steps"
    steady = statistics.median(window)
    target, _ = _fit_target("stream", rows, reference)
    return [
        f"== stream: endless IterableDataset, {args.stream_latency} s I/O latency per item, batch 1, "
        f"{args.stream_step} s step, {args.stream_steps} steps in one epoch",
        table,
        _tuner_line(tuner),
        f"  targets: tuner steady wait over {where} {1000 * steady:.1f} ms (<= 20: {'yes' if steady <= 0.02 else 'no'}); {target}",
    ]


def _jpeg(args: argparse.Namespace, tmp: str, tar: bool) -> list[str]:
    images = Path(tmp) / "jpeg"
    paths = sorted(images.glob("*.jpg")) or write_jpegs(images, args.images)
    if tar:
        shards = sorted((Path(tmp) / "shards").glob("*.tar")) or write_shards(paths, Path(tmp) / "shards", 64)
        dataset: object = JpegTarStream(shards, out=args.jpeg_size)
        what = f"{len(shards)} webdataset-style tar shards of 64, one endless stream"
    else:
        dataset = JpegFiles(paths, out=args.jpeg_size)
        what = f"{len(paths)} files, map-style, shuffled"
    tuner = PrefetchTuner()

    def make(w: int) -> DataLoader:
        return DataLoader(
            dataset, batch_size=args.jpeg_batch, shuffle=not tar, num_workers=w, persistent_workers=w > 0, drop_last=True
        )

    rows = _standard_rows(make, args.jpeg_step, args.jpeg_steps, args.sweep, tuner)
    table, reference = _table(rows, args.steady_steps)
    target, _ = _fit_target("jpeg-tar" if tar else "jpeg", rows, reference)
    return [
        f"== {'jpeg-tar' if tar else 'jpeg'}: 320x240 JPEGs decoded with Pillow + random resized crop to "
        f"{args.jpeg_size}, flip, normalise; {what}; batch {args.jpeg_batch}, {args.jpeg_step} s step, {args.jpeg_steps} steps",
        table,
        _tuner_line(tuner),
        f"  targets: {target}",
    ]


@register_benchmark("prefetch", "data wait and fit time: DataLoader settings vs PrefetchTuner (seed 004, a stream, JPEG decoding)")
def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--stream-steps", args.stream_steps), ("--jpeg-steps", args.jpeg_steps)):
        if value < 4:
            raise SystemExit(f"{flag} {value} is too few to see a steady state; pass {flag} 4 or more")
    if args.steady_steps < 1:
        raise SystemExit(f"--steady-steps {args.steady_steps} must be at least 1; pass e.g. --steady-steps 20")
    if args.images < args.jpeg_batch:
        raise SystemExit(f"--images {args.images} is fewer than one batch (--jpeg-batch {args.jpeg_batch}); pass more images")
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads:
            if name == "seed004":
                lines = _seed004(args, tmp)
            elif name == "stream":
                lines = _stream(args, tmp)
            else:
                lines = _jpeg(args, tmp, tar=name == "jpeg-tar")
            print("\n".join(lines), flush=True)
    after = os.getloadavg()
    print(f"load average (1 min) {load[0]:.2f} before, {after[0]:.2f} after")
    print(machine_line())
    return 0
