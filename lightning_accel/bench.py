"""``lightning-accel bench NAME``: benchmarks that print a table of side-by-side ratios.

Each technique registers a benchmark here (offload, pipeline, prefetch, ddp). A benchmark
measures its contenders in one process, one after another on the same machine, and
prints ratios against a baseline measured in the same run, because absolute timings on
shared machines are noise; it ends with a line describing the machine.
"""

from __future__ import annotations

import importlib
import os
import platform
from collections.abc import Callable

import torch

from lightning_accel.config.errors import UserError, close_matches
from lightning_accel.table import format_table as format_table  # re-exported for the benchmarks

# name -> (one-line purpose, entry point taking the remaining argv, returning an exit code)
BENCHMARKS: dict[str, tuple[str, Callable[[list[str]], int]]] = {}

# Modules whose import registers benchmarks; imported on first use, not at CLI start-up.
BENCHMARK_MODULES: tuple[str, ...] = (
    "lightning_accel.benchmarks.offload",
    "lightning_accel.benchmarks.prefetch",
    "lightning_accel.benchmarks.ddp",
    "lightning_accel.benchmarks.pipeline",
    "lightning_accel.benchmarks.pipeline_init",
    "lightning_accel.benchmarks.finetune",
)


def load_benchmarks() -> dict[str, tuple[str, Callable[[list[str]], int]]]:
    """Import every benchmark module once and return the registry."""
    for module in BENCHMARK_MODULES:
        importlib.import_module(module)
    return BENCHMARKS


def register_benchmark(name: str, purpose: str) -> Callable[[Callable[[list[str]], int]], Callable[[list[str]], int]]:
    """Decorator: make ``fn`` available as ``lightning-accel bench NAME``."""

    def wrap(fn: Callable[[list[str]], int]) -> Callable[[list[str]], int]:
        BENCHMARKS[name] = (purpose, fn)
        return fn

    return wrap


def run_benchmark(name: str, args: list[str]) -> int:
    load_benchmarks()
    if name not in BENCHMARKS:
        known = sorted(BENCHMARKS)
        raise UserError(
            f"unknown benchmark '{name}'{close_matches(name, known)}; available: {', '.join(known) or '(none yet)'}"
        )
    return BENCHMARKS[name][1](args)


def machine_line() -> str:
    """One line naming the machine a table was measured on."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"machine: {platform.machine()} {os.cpu_count()} cores, {device}; python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


