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
of a shared machine does not move it. Every row runs once per round, ``--repeat`` rounds
back to back, so the rows share the machine's load drift; the table gives each row's median
fit time and its range, and the ratios are against the best hand-set median (the target
line adds each round's tuner fit over that round's best hand-set one). The load average is
printed with the machine.
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
    p.add_argument(
        "--repeat", type=int, default=3, help="rounds of every row, back to back: fit time is the median, its range beside it"
    )
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
class _Contender:
    """One row: a fresh loader (and fresh callbacks) for each of its fits."""

    name: str
    make: Callable[[], object]
    callbacks: Callable[[], list] = list
    hand_workers: int | None = None  # set for the rows of the hand-set sweep


@dataclass
class _Row:
    """A contender's fits, one per round: medians in the table, the range beside them."""

    name: str
    runs: list[tuple[list[float], float]]  # (waits, fit seconds) per round
    hand_workers: int | None = None

    @property
    def walls(self) -> list[float]:
        return [wall for _, wall in self.runs]

    @property
    def wall_s(self) -> float:
        return statistics.median(self.walls)

    @property
    def waits(self) -> list[float]:
        """The waits of the round with the median fit time."""
        order = sorted(range(len(self.runs)), key=lambda i: self.runs[i][1])
        return self.runs[order[(len(order) - 1) // 2]][0]

    def mean_wait(self) -> float:
        return statistics.median(sum(w) / len(w) if w else float("nan") for w, _ in self.runs)

    def steady(self, last: int) -> float:
        return statistics.median(statistics.median(w[-min(last, max(1, len(w) // 2)) :]) for w, _ in self.runs)


def _run_rounds(contenders: list[_Contender], step_s: float, steps: int, repeat: int) -> list[_Row]:
    """Every contender once per round, rounds back to back: rows side by side under the same load drift."""
    rows = [_Row(c.name, [], c.hand_workers) for c in contenders]
    for _ in range(repeat):
        for contender, row in zip(contenders, rows):
            monitor, wall = _fit(contender.make(), step_s, steps, contender.callbacks())
            row.runs.append((monitor.meter.waits[: len(monitor.meter.steps)], wall))
    return rows


def _tuned(tuners: list[PrefetchTuner], **kwargs: object) -> Callable[[], list]:
    """Callbacks with a fresh PrefetchTuner per fit; ``tuners`` collects them for the report."""

    def make() -> list:
        tuners.append(PrefetchTuner(**kwargs))  # type: ignore[arg-type]
        return [tuners[-1]]

    return make


def _standard(make: Callable[[int], DataLoader], sweep: list[int], tuners: list[PrefetchTuner]) -> list[_Contender]:
    """Defaults, Lightning's suggestion, the hand-set sweep, the tuner from defaults, in this order."""
    suggested = suggested_max_num_workers(1)
    return [
        _Contender("DataLoader defaults (workers=0)", lambda: make(0)),
        _Contender(f"Lightning's suggestion (workers={suggested})", lambda: make(suggested)),
        *[_Contender(f"hand-set workers={w}", lambda w=w: make(w), hand_workers=w) for w in sweep],
        _Contender("PrefetchTuner, from defaults", lambda: make(0), _tuned(tuners)),
    ]


def _table(rows: list[_Row], steady_steps: int) -> tuple[str, float]:
    """The table, and the best hand-set fit time (median over the rounds) every ratio is against."""
    reference = min(r.wall_s for r in rows if r.hand_workers is not None)
    out = []
    for r in rows:
        mark = " <- best hand-set" if r.hand_workers is not None and r.wall_s == reference else ""
        # the same 3 decimals as the median beside it: at 2 a median of 0.117 sat outside its range "0.12-0.13"
        spread = f"{min(r.walls):.3f}-{max(r.walls):.3f}" if len(r.runs) > 1 else "-"
        out.append([r.name, r.mean_wait(), r.steady(steady_steps), r.wall_s, spread, f"{r.wall_s / reference:.2f}x{mark}"])
    rounds = len(rows[0].runs)
    fit = "fit s" if rounds == 1 else f"fit s (median of {rounds})"
    return format_table(["contender", "mean wait s", "steady wait s", fit, "fit range s", "fit vs best hand-set"], out), reference


def _tuner_line(tuners: list[PrefetchTuner]) -> str:
    lines = []
    for i, tuner in enumerate(tuners):
        chosen = tuner.chosen.label() if tuner.chosen is not None else "(kept defaults)"
        which = f"round {i + 1}: " if len(tuners) > 1 else ""
        lines.append(f"  tuner {which}{chosen}; {tuner.reason}; search over by step {tuner.finished_step}")
    notes = {t.cpu_note for t in tuners if t.cpu_note}
    return "\n".join(lines + [f"  {note}" for note in sorted(notes)])


def _fit_target(name: str, rows: list[_Row], reference: float) -> tuple[str, bool]:
    tuned = next(r for r in rows if r.name.startswith("PrefetchTuner, from defaults"))
    ok = tuned.wall_s <= 1.05 * reference
    line = f"{name}: tuner fit {tuned.wall_s / reference:.3f}x best hand-set (<= 1.05: {'yes' if ok else 'no'})"
    if len(tuned.runs) > 1:  # each round against that round's best hand-set fit
        hand = [r for r in rows if r.hand_workers is not None]
        paired = [tuned.walls[i] / min(r.walls[i] for r in hand) for i in range(len(tuned.runs))]
        line += "; per round " + " ".join(f"{x:.2f}x" for x in paired)
    return line, ok


def _seed004(args: argparse.Namespace, tmp: str) -> list[str]:
    dataset = SyntheticArrays(args.steps, shape=args.shape, latency_s=args.latency)
    tuners: list[PrefetchTuner] = []
    seconds: list[PrefetchTuner] = []

    def first() -> list:
        # A fresh cache each round, so the first tuner searches; the second run of the round reads it.
        tuners.append(PrefetchTuner(cache_path=str(Path(tmp) / f"prefetch_tuned_{len(tuners)}.json")))
        return [tuners[-1]]

    def second() -> list:
        seconds.append(PrefetchTuner(cache_path=tuners[-1].options.cache_path))
        return [seconds[-1]]

    def make(w: int) -> DataLoader:
        return DataLoader(dataset, batch_size=1, num_workers=w, persistent_workers=w > 0)

    sweep = sorted(set(args.sweep) | {args.hand_workers})
    contenders = [_Contender("plain loop", lambda: _PlainLoop(dataset))]
    contenders += _standard(make, sweep, [])
    contenders[-1].callbacks = first
    contenders.append(_Contender("PrefetchTuner, from cache (second run)", lambda: make(0), second))
    if _ray_available():
        contenders.append(_Contender("Ray Data (its defaults)", lambda: _RayData(dataset)))
    rows = _run_rounds(contenders, args.step, args.steps, args.repeat)
    if _ray_available():
        import ray

        ray.shutdown()
    table, reference = _table(rows, args.steady_steps)
    if not _ray_available():
        table += "\nRay Data: not measured: pip install 'lightning-accel[ray]'"
    tuned = next(r for r in rows if r.name == "PrefetchTuner, from defaults")
    target, _ = _fit_target("seed004", rows, reference)
    tuner = tuners[-1]
    lines = [
        f"== seed004: batch {tuple(args.shape)} float32, {args.latency} s latency, {args.step} s step, {args.steps} steps",
        table,
        _tuner_line(tuners),
        f"  second run: {seconds[-1].reason}",
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
    tuners: list[PrefetchTuner] = []

    def make(w: int) -> DataLoader:
        return DataLoader(LatencyStream(args.stream_latency), batch_size=1, num_workers=w, persistent_workers=w > 0)

    rows = _run_rounds(_standard(make, args.sweep, tuners), args.stream_step, args.stream_steps, args.repeat)
    table, reference = _table(rows, args.steady_steps)
    tuned = next(r for r in rows if r.name == "PrefetchTuner, from defaults")
    waits = tuned.waits
    window = waits[100:120] if len(waits) >= 120 else waits[-args.steady_steps :]
    where = "steps 100-120" if len(waits) >= 120 else f"the last {len(window)} steps"
    steady = statistics.median(window)
    target, _ = _fit_target("stream", rows, reference)
    return [
        f"== stream: endless IterableDataset, {args.stream_latency} s I/O latency per item, batch 1, "
        f"{args.stream_step} s step, {args.stream_steps} steps in one epoch",
        table,
        _tuner_line(tuners),
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
    tuners: list[PrefetchTuner] = []

    def make(w: int) -> DataLoader:
        return DataLoader(
            dataset, batch_size=args.jpeg_batch, shuffle=not tar, num_workers=w, persistent_workers=w > 0, drop_last=True
        )

    rows = _run_rounds(_standard(make, args.sweep, tuners), args.jpeg_step, args.jpeg_steps, args.repeat)
    table, reference = _table(rows, args.steady_steps)
    target, _ = _fit_target("jpeg-tar" if tar else "jpeg", rows, reference)
    return [
        f"== {'jpeg-tar' if tar else 'jpeg'}: 320x240 JPEGs decoded with Pillow + random resized crop to "
        f"{args.jpeg_size}, flip, normalise; {what}; batch {args.jpeg_batch}, {args.jpeg_step} s step, {args.jpeg_steps} steps",
        table,
        _tuner_line(tuners),
        f"  targets: {target}",
    ]


@register_benchmark("prefetch", "data wait and fit time: DataLoader settings vs PrefetchTuner (seed 004, a stream, JPEG decoding)")
def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--stream-steps", args.stream_steps), ("--jpeg-steps", args.jpeg_steps)):
        if value < 4:
            raise SystemExit(f"{flag} {value} is too few to see a steady state; pass {flag} 4 or more")
    if args.repeat < 1:
        raise SystemExit(f"--repeat {args.repeat} must be at least 1; pass e.g. --repeat 3")
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
