"""``lightning-accel bench offload --only host-step`` on tiny sizes: every row, the ratios and the closing line."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch import nn

from lightning_accel.benchmarks import offload_host_step
from lightning_accel.benchmarks.offload import main
from lightning_accel.offload import shadow_kernel

# three host-step rounds: each row's median drops one slow call (in two whole-suite runs one call of the fp32 host step
# took 3.2 s against ~5 ms, printed as 0.00x fused; not reproduced alone, nor with a large heap beside it)
_TINY = ["--only", "host-step", "--host-params", "0.5", "1", "--host-width", "32", "--host-rounds", "3", "--rounds", "1",
         "--fit-preset", "tiny", "--fit-layers", "2", "--fit-seq", "8", "--fit-steps", "3", "--warmup", "1"]


def _row(out: str, label: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return re.split(r"\s{2,}", line.strip())


def test_host_step_tables(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # the memory-limit rows run eagerly here: their two compilations cost ~5 s on a cold cache
    eager = functools.partial(offload_host_step._stream_rows, compile=lambda fn, **_: fn)
    monkeypatch.setattr(offload_host_step, "_stream_rows", eager)
    assert main(_TINY) == 0
    out = capsys.readouterr().out
    assert "host optimizer step, blocks shaped like GPT blocks of width 32" in out
    assert _row(out, "torch AdamW(fused=True)")[3:] == ["1.00", "1.00"]  # the baseline of the "x fused" columns
    for label in ("torch AdamW, foreach/fused unset", "l2l_offload host step (fp32", "  same, one optimizer call per block",
                  "fused step, then bf16 shadow refresh", "l2l_offload host step, bf16 shadows folded (", "host memory copy",
                  "fused kernel in 1 MiB chunks, each cast to bf16", "  AdamW's bytes at trivial arithmetic",
                  "  the compiled fold's bytes at trivial arithmetic (its memory limit)",
                  "in-place a += b"):
        assert all(float(v) > 0 for v in _row(out, label)[1:]), (label, _row(out, label))
    assert "(no DeepSpeedCPUAdam row: " in out or "DeepSpeedCPUAdam " in out
    if shadow_kernel.kernel() is not None:  # the C kernel's row and the compiled fold's, side by side
        assert all(float(v) > 0 for v in _row(out, "  same, folded by torch.compile (no C kernel)")[1:])
        assert _row(out, "l2l_offload host step, bf16 shadows folded (C kernel)")
    assert _row(out, "tiny")[2] != "0"  # the per-call table
    assert _row(out, "l2l_offload, AdamW() (default)")
    assert float(_row(out, "plain Lightning bf16-mixed, AdamW(fused=True)")[2]) == 1.0  # the bf16 rows' baseline
    assert float(_row(out, "l2l_offload bf16-mixed, AdamW() (default)")[2]) > 0
    closing = out.rstrip().splitlines()[-2]
    assert re.fullmatch(r"host step: [\d.]+ Mparam/s = \d+\.\d\d x fused AdamW, \d+% of copy bandwidth; "
                        r"bf16 shadows folded: \d+\.\d\d x fused AdamW(; by torch.compile: \d+\.\d\d)? \(its memory limit: \d+\.\d\d\); "
                        r"in a fit: \d+\.\d\dx plain AdamW\(fused=True\)'s time in step, bf16: \d+\.\d\dx", closing), closing
    assert out.rstrip().splitlines()[-1].startswith("machine:")


def test_only_in_fit_runs_the_in_fit_table_alone(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # (the table itself runs in test_host_step_tables; here only which tables --only in-fit prints)
    seen = {}

    def in_fit_table(args: object) -> tuple[str, float, float]:
        seen["args"] = args
        return "the in-fit table", 1.0, 1.0

    monkeypatch.setattr(offload_host_step, "in_fit_table", in_fit_table)
    assert main(["--only", "in-fit", "--fit-steps", "5", "--rounds", "2"]) == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[0] == "the in-fit table" and len(lines) == 2 and lines[1].startswith("machine:")
    assert (seen["args"].fit_steps, seen["args"].rounds) == (5, 2)


@pytest.mark.parametrize(("argv", "says"), [
    (["--host-params", "0"], "--host-params must be > 0, got [0.0]"),
    (["--fit-steps", "2", "--warmup", "2"], "--fit-steps 2 must exceed --warmup 2"),
])
def test_bad_arguments(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert says in capsys.readouterr().err


def test_chunked_contender_steps_as_the_two_pass_path() -> None:
    """The chunked row computes what a fused step then a cast computes, bit for bit (a ragged last chunk too)."""
    runs = []
    for chunked in (False, True):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(offload_host_step._CHUNK + 100)), nn.Parameter(torch.randn(3, 7))]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
        shadows = {params[0]: torch.empty(offload_host_step._CHUNK + 100, dtype=torch.bfloat16)}
        opt.step()  # creates the state
        for _ in range(2):
            if chunked:
                offload_host_step._chunked(opt, shadows)()
            else:
                opt.step()
                shadows[params[0]].copy_(params[0])
        runs.append([*params, shadows[params[0]], *(t for p in params for t in opt.state[p].values())])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
