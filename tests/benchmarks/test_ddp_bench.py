"""``lightning-accel bench ddp`` on a tiny MLP: the table's byte ratios follow from arithmetic."""

from __future__ import annotations

import re

import pytest

from lightning_accel.benchmarks.ddp import main


def _row(out: str, label: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return re.split(r"\s{2,}", line.strip())


def test_bench_ddp_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--steps", "2", "--warmup", "2", "--width", "32", "--depth", "2", "--batch", "8", "--accumulate", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 gloo processes, MLP 2x32" in out and out.rstrip().splitlines()[-1].startswith("machine:")
    plain = _row(out, "plain DDP (allreduce)")
    params = 2 * (32 * 32 + 32) + 32 + 1
    assert float(plain[1]) == pytest.approx(params * 4 / 1e6, abs=0.005)
    assert _row(out, "fp16 compress")[2] == "0.500"          # 2 bytes per gradient element instead of 4
    assert _row(out, "accumulate 2, sync each")[2] == "2.000"  # one all-reduce per micro-batch
    assert _row(out, "accumulate 2, no_sync")[2] == "1.000"    # one per optimizer step
    assert _row(out, "bucket_cap_mb=100")[2] == "1.000"
    assert float(_row(out, "PowerSGD rank 1")[2]) < 0.5
    assert _row(out, "DDP built-in reducer")[1] == "(C++)"


def test_bench_ddp_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--batch", "6", "--accumulate", "4"])
    assert "--batch 6 must be divisible by --accumulate 4; e.g. --batch 32" in capsys.readouterr().err
