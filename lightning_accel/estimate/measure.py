"""The estimate against a real run on this machine's GPUs: ``lightning-accel estimate RECIPE --measure STEPS``.

The recipe runs ``STEPS`` training steps through ``lightning-accel run`` (a process of its own,
launched as the recipe launches: DDP and pipeline ranks included) with one callback added,
:class:`DevicePeak`, which resets CUDA's peak statistics when the fit is set up and writes each
rank's ``torch.cuda.max_memory_allocated`` of every device it used when training ends. Each
measured device is then put beside the device peak the estimate gives its rank, in rank order
(every rank of a kind with ``count`` ranks, then the next kind), with the ratio; the goal is
within :data:`GOAL` (10%).

What ``max_memory_allocated`` holds is what the estimate counts: tensors of the caching
allocator. The CUDA context, cuBLAS/cuDNN workspaces allocated outside it and the allocator's
reserved-but-free blocks are in neither (``torch.cuda.max_memory_reserved`` is printed beside it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_accel.estimate.report import Estimate, gb

GOAL = 0.10  # the estimate within 10% of max_memory_allocated
CALLBACK = "lightning_accel.estimate.measure.DevicePeak"


class DevicePeak(pl.Callback):
    """Each rank's ``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``) per device it used over the fit,
    written to ``path/rank{global_rank}.json`` when training ends."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(i)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        peaks: dict[str, dict[str, int]] = {}
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                allocated = torch.cuda.max_memory_allocated(i)
                if allocated:
                    peaks[f"cuda:{i}"] = {"allocated": allocated, "reserved": torch.cuda.max_memory_reserved(i)}
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps({"rank": trainer.global_rank, "peaks": peaks}))


@dataclass(frozen=True)
class Row:
    kind: str  # the estimate's rank kind
    rank: int  # the process
    device: str
    estimate: int
    allocated: int
    reserved: int

    @property
    def ratio(self) -> float:
        return self.estimate / self.allocated if self.allocated else float("inf")

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1) <= GOAL


def compare(estimate: Estimate, runs: Sequence[dict[str, Any]]) -> list[Row]:
    """Each measured device beside its rank's estimate, in rank order then device order; refuses a count that differs."""
    measured = sorted(
        ((run["rank"], device, peak) for run in runs for device, peak in run["peaks"].items()),
        key=lambda m: (m[0], int(m[1].split(":")[1]) if ":" in m[1] else 0),
    )
    expected = [(r.kind, r.device_peak_bytes) for r in estimate.ranks for _ in range(r.count)]
    if len(measured) != len(expected):
        raise ValueError(
            f"the run used {len(measured)} CUDA device(s) ({', '.join(f'rank {r} {d}' for r, d, _ in measured) or 'none'}), "
            f"the estimate has {len(expected)} rank(s) with a device; run the recipe with the devices it states"
        )
    return [Row(kind, rank, device, nbytes, peak["allocated"], peak["reserved"])
            for (kind, nbytes), (rank, device, peak) in zip(expected, measured)]


def format_rows(rows: Sequence[Row]) -> str:
    from lightning_accel.table import format_table

    table = format_table(
        ("rank kind", "process", "device", "estimate", "max_memory_allocated", "estimate / measured", "max_memory_reserved"),
        [(r.kind, str(r.rank), r.device, gb(r.estimate), gb(r.allocated), f"{r.ratio:.3f}", gb(r.reserved)) for r in rows],
    )
    off = [r for r in rows if not r.within]
    verdict = (f"device estimate within {GOAL:.0%} of max_memory_allocated on every device" if not off else
               f"device estimate OUTSIDE {GOAL:.0%} of max_memory_allocated on {', '.join(f'rank {r.rank} {r.device}' for r in off)}")
    return f"{table}\n{verdict}"


def run_and_measure(recipe: str, overrides: Sequence[str], steps: int) -> list[dict[str, Any]]:
    """``steps`` training steps of the recipe through ``lightning-accel run`` with :class:`DevicePeak`; each rank's peaks."""
    with tempfile.TemporaryDirectory(prefix="estimate-measure-") as out:
        command = [sys.executable, "-m", "lightning_accel.cli", "run", recipe, *overrides, *measure_overrides(steps, out)]
        print("+ " + " ".join(command), flush=True)
        done = subprocess.run(command)
        if done.returncode != 0:
            raise RuntimeError(f"the measured run of {recipe} failed (exit {done.returncode}); its output is above")
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


def measure_overrides(steps: int, out: str) -> list[str]:
    """What the measured run adds to the recipe's overrides: its length and the callback."""
    return [f"trainer.max_steps={steps}", f"+callbacks.estimate_device_peak._target_={CALLBACK}",
            f"+callbacks.estimate_device_peak.path={out}"]
