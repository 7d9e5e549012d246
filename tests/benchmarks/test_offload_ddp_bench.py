"""``lightning-accel bench offload --devices 2`` on a tiny GPT: the three contenders, each rank's share of the optimizer
state and the bytes columns, from 2 real gloo processes."""

from __future__ import annotations

import re

import pytest

from lightning_accel.benchmarks.offload import main

_TINY = ["--devices", "2", "--layers", "4", "--seq", "16", "--batch", "2", "--steps", "4", "--warmup", "1", "--rounds", "1"]


def _row(out: str, label: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return re.split(r"\s{2,}", line.strip())


@pytest.mark.slow
def test_data_parallel_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_TINY) == 0
    out = capsys.readouterr().out
    assert "2 gloo processes on the CPU" in out
    ddp, part, repl = _row(out, "plain DDP"), _row(out, "l2l_offload_ddp, partitioned"), _row(out, "l2l_offload_ddp, replicated")
    assert ddp[2] == "1.00" and float(part[2]) > 0 and float(repl[2]) > 0
    # host optimizer state per rank: half each partitioned (4 equal blocks), all of it on each rank replicated
    halves = [float(v) for v in part[3].split("/")]
    fulls = [float(v) for v in repl[3].split("/")]
    assert halves[0] == halves[1] and fulls[0] == fulls[1] and halves[0] == pytest.approx(fulls[0] / 2, abs=0.01)
    # the same gradient payload is averaged every way; only the partitioned step sends weights back
    assert float(part[6]) > 0 and float(repl[6]) > 0 and float(ddp[6]) > 0
    assert float(part[7]) > 0 and float(repl[7]) == 0 and float(ddp[7]) == 0
    assert out.rstrip().splitlines()[-1].startswith("machine:")


def test_bad_device_count_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--devices", "0"])
    assert "--devices must be >= 1, got 0; e.g. --devices 2" in capsys.readouterr().err
