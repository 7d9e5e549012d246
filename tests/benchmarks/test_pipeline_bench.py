"""The pipeline benchmark on a shrunk workload: every contender runs and the tables are complete."""

from __future__ import annotations

import json

import pytest

from lightning_accel.bench import BENCHMARKS
from lightning_accel.benchmarks.pipeline import main


def test_shrunk_benchmark_prints_every_row_and_draws_the_timeline(capsys, tmp_path):
    args = ["--plot", str(tmp_path / "plot"), "--depth", "4", "--hidden", "32", "--batch", "16", "--chunks", "4", "--steps", "1", "--rounds", "1",
            "--memory-chunks", "1,4", "--memory-batch", "64", "--memory-hidden", "64", "--timeout", "120"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for name in ("1 process (no pipeline)", "1 process, M=4 micro-batches in turn", "raw torch.distributed.pipelining", "lightning_accel RankPipeline",
                 "lightning_accel GPipeStrategy (2 processes)",
                 "ideal S*M/(M+S-1)", "M=1, checkpoint=never", "M=1, checkpoint=always", "M=4, checkpoint=always"):
        assert name in out
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()}
    assert float(rows["ideal S*M/(M+S-1)"][-4]) == pytest.approx(8 / 5, abs=1e-3)  # S=2, M=4
    assert rows["raw torch.distributed.pipelining"][-2:] == ["1.000", "1.000-1.000"]  # vs itself, step by step
    assert "GPipeStrategy in a Trainer vs raw pipelining: " in out and "target >= 0.95x: " in out
    assert "where the gap to the ideal 1.60x goes: M=4 micro-batches of 4 rows cost" in out
    assert out.rstrip().splitlines()[-1].startswith("machine: ")
    assert "bubble measured" in out and "fill-drain ideal 20.0%" in out  # (S-1)/(M+S-1) = 1/5
    svg = (tmp_path / "plot" / "pipeline-timeline.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<rect") == 2 * 2 * 4  # 2 stages x (F + B) x 4 micro-batches
    trace = json.loads((tmp_path / "plot" / "pipeline-trace.json").read_text())
    assert sorted({(e["tid"], e["name"]) for e in trace["traceEvents"]}) == sorted(
        (s, f"{k}{m}") for s in range(2) for k in "FB" for m in range(4))


def test_registered_under_pipeline():
    assert BENCHMARKS["pipeline"][1] is main


def test_batch_not_divisible_by_chunks_is_rejected():
    with pytest.raises(SystemExit, match=r"--batch 10 / --chunks 4.*batch divisible by chunks"):
        main(["--batch", "10", "--chunks", "4"])


def test_memory_only_table_peak_falls_with_micro_batches(capsys):
    args = ["--memory-only", "--depth", "8", "--steps", "1", "--memory-chunks", "1,4", "--memory-batch", "256",
            "--memory-hidden", "64"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "raw torch.distributed.pipelining" not in out  # the 2-process part did not run
    peak = {line.split("  ")[0].strip(): float(line.split()[-4]) for line in out.splitlines() if "checkpoint=" in line}
    assert set(peak) == {"M=1, checkpoint=never", "M=1, checkpoint=always", "M=4, checkpoint=always"}
    # one stage checkpointed per micro-batch: backward recomputes a quarter of the batch at a time
    assert peak["M=4, checkpoint=always"] < 0.6 * peak["M=1, checkpoint=always"]
    assert peak["M=4, checkpoint=always"] < 0.6 * peak["M=1, checkpoint=never"]
    assert out.rstrip().splitlines()[-1].startswith("machine: ")
