"""``lightning-accel bench offload --nvme`` shrunk: the tables' shape, and every figure consistent with its inputs."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from lightning_accel.benchmarks import offload_nvme
from lightning_accel.benchmarks.offload import main
from lightning_accel.estimate.tier import tier_plan

# 8 blocks of 197k parameters (2.4 MB of AdamW state and masters each): whole in the four configurations' step buffers,
# in three 1 MiB chunks in the fifth's
_TINY = ["--nvme", "--layers", "8", "--width", "128", "--heads", "2", "--io-shape", "1x8", "--compute-shape", "2x8",
         "--rounds", "1", "--steps", "1", "--warmup", "1", "--probe-mb", "4", "--small-chunk", "1MiB"]
READ_BW, WRITE_BW = 1e9, 0.5e9  # the disk, as measure_bandwidth reports it here


def _rows(out: str, header: str) -> list[list[str]]:
    """The rows of the table whose header line matches ``header``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(header, line)) + 2
    rows = []
    for line in lines[start:]:
        if not re.match(r"(io|compute)-bound(, masters in RAM|, 1 MiB chunks)?\s{2,}", line):
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_nvme_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def rows_of(fits: Any, read_bw: float, write_bw: float) -> Any:
        seen["fits"] = fits
        return real_rows_of(fits, read_bw, write_bw)

    real_rows_of = offload_nvme.rows_of
    monkeypatch.setattr(offload_nvme, "rows_of", rows_of)
    monkeypatch.setattr(offload_nvme, "measure_bandwidth", lambda root, nbytes: (READ_BW, WRITE_BW))
    assert main(_TINY) == 0
    out = capsys.readouterr().out
    assert "read 1000 MB/s, write 500 MB/s (4 MiB requests x 4 threads, O_DIRECT, 4 MiB" in out
    verdicts = _rows(out, r"configuration\s+batch\s")
    times = _rows(out, r"configuration\s+side\s+step s")
    nbytes = _rows(out, r"configuration\s+side\s+tier read MB")
    assert [r[0] for r in verdicts] == ["io-bound", "io-bound, 1 MiB chunks", "io-bound, masters in RAM", "compute-bound",
                                        "compute-bound, masters in RAM"]
    assert [len(r) for r in verdicts] == [11] * 5 and [len(r) for r in times] == [9] * 10 and [len(r) for r in nbytes] == [9] * 10
    # what crosses the disk per step is the strategy's plan: every block's state and masters (read by the step, and the
    # masters by the forward and the recomputation: fp32 blocks on the CPU compute on them), or the state alone
    task = offload_nvme._model(offload_nvme.parser().parse_args(_TINY[1:]))
    optimizer = task.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer)
    least = tier_plan(task, [optimizer], nvme_path="unused", overlap_step=True)  # overlap_step on (the default)
    small = tier_plan(task, [optimizer], nvme_path="unused", overlap_step=True, nvme_chunk=2**20)
    assert least.step_buffer == least.step_span(0) > 2 * small.step_buffer == 2 * 2**20  # a block whole; a third of one
    assert small.host_bytes == least.host_bytes - 3 * (least.step_buffer - small.step_buffer)
    state = sum(u.state for u in least.units)
    assert least.step_read_bytes == least.disk_bytes + 15 * least.units[0].masters  # 7 blocks read twice, the last once
    everything = (least.step_read_bytes, least.disk_bytes)
    for (config, [(ram, tier)]), row, (read, disk) in zip(seen["fits"].items(), verdicts,
                                                          [everything, everything, (state, state), everything, (state, state)]):
        assert (tier.read_bytes, tier.write_bytes, ram.read_bytes, ram.write_bytes) == (read, disk, 0, 0)
        floor = read / READ_BW + disk / WRITE_BW
        assert row[1:6] == [f"{config.batch}x{config.seq}", f"{config.budget / 1e6:.1f}", f"{ram.step_s:.3f}",
                            f"{tier.step_s:.3f}", f"{floor:.3f}"]
        to_ram, to_bound = tier.step_s / ram.step_s, tier.step_s / max(ram.step_s, floor)
        assert row[6:8] == [f"{to_ram:.2f}", f"{to_bound:.2f}"]
        ratio, limit = (to_ram, 1.10) if config.compute_bound else (to_bound, 1.25)
        assert row[8:] == [f"{ratio:.2f}", f"<= {limit:.2f}x {'in-RAM' if config.compute_bound else 'max'}",
                           "met" if ratio <= limit else "NOT MET"]
        assert tier.host_kept < ram.host_kept and config.budget >= (small if config.chunk == 2**20 else least).host_bytes
    assert [r[2:4] for r in nbytes[1::2]] == [[f"{r / 1e6:.1f}", f"{d / 1e6:.1f}"]
                                              for r, d in [everything, everything, (state, state), everything, (state, state)]]
    assert all(0 <= float(r[6]) <= float(r[2]) for r in times)  # the disk in flight no longer than the step
    assert "plan, everything on disk: host " in out and "plan, masters in RAM: " in out and "fp32 masters of 0/8" in out
    assert f"plan, everything on disk, 1 MiB chunks: {small.describe()}" in out
    assert re.search(r"load average \(1 min\) [\d.]+ before, [\d.]+ after\nmachine: ", out)


def test_ratios_are_the_median_of_each_round_s_ratio() -> None:
    """A machine that drifts between rounds: the ratio of medians (1.5 / 1.0) would misjudge what each round saw (1.1)."""
    def fit(step: float, disk: float) -> offload_nvme.Fit:
        return offload_nvme.Fit(step, *[0.0] * 7, disk, disk, *[0.0] * 3, 0, 0)

    rounds = [(fit(1.0, 0), fit(1.1, 1e8)), (fit(2.0, 0), fit(2.2, 1e8)), (fit(1.0, 0), fit(1.5, 1e8))]
    compute = offload_nvme.Config("compute-bound", 4, 64, 10**8, True)
    io = offload_nvme.Config("io-bound", 1, 16, 10**8, False)
    [compute_row, io_row], _, _ = offload_nvme.rows_of({compute: rounds, io: rounds}, READ_BW, WRITE_BW)
    assert compute_row[3:] == ["1.000", "1.500", "0.300", "1.10", "1.10", "1.10 1.10 1.50", "<= 1.10x in-RAM", "met"]
    # floor 0.1 + 0.2 s below every in-RAM step: the same ratios, judged against 1.25
    assert io_row[6:] == ["1.10", "1.10", "1.10 1.10 1.50", "<= 1.25x max", "met"]


def test_busy_seconds_is_the_union_of_the_spans_inside_the_window() -> None:
    spans = [[0.0, 1.0], [0.5, 2.0], [3.0, 4.0], [-1.0, -0.5], [2.5, float("inf")]]
    assert offload_nvme.busy_seconds(spans, 0.0, 3.5) == pytest.approx(2.0 + 1.0)  # [0, 2] and [2.5, 3.5]
    assert offload_nvme.busy_seconds([], 0.0, 1.0) == 0.0


@pytest.mark.parametrize(("argv", "says"), [
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--io-shape", "1x"], "'1x' is not BATCHxSEQ; write e.g. 1x16"),
    (["--small-chunk", "64kB"], "--chunk='64kB' is less than the least chunk, 1 MiB"),
])
def test_bad_arguments(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--nvme", *argv])
    assert says in capsys.readouterr().err
