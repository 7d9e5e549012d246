"""The prefetch benchmark on a shrunk workload: every contender runs, the table is complete."""

from __future__ import annotations

import pytest

from lightning_accel.bench import BENCHMARKS
from lightning_accel.benchmarks.prefetch import main


def test_shrunk_benchmark_prints_every_contender(capsys, tmp_path):
    csv = tmp_path / "trials.csv"
    assert main(["--steps", "24", "--latency", "0.03", "--step", "0.005", "--shape", "4,100,3", "--hand-workers", "4", "--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    for name in ("plain loop", "DataLoader defaults", "Lightning's suggestion", "hand-tuned (workers=4)", "PrefetchTuner, from defaults", "Ray Data"):
        assert name in out
    assert "PrefetchTuner: " in out and out.rstrip().splitlines()[-2].startswith("machine: ")
    assert csv.read_text().startswith("num_workers,prefetch_factor")
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    plain = float(rows["plain loop"].split()[2])
    # Plain loop waits the latency on every step (0.03 s); generous bounds for a shared machine.
    assert 0.02 < plain < 0.2


def test_registered_under_prefetch():
    assert BENCHMARKS["prefetch"][1] is main


def test_too_few_steps_is_rejected():
    with pytest.raises(SystemExit, match=r"--steps 2 is too few"):
        main(["--steps", "2"])
