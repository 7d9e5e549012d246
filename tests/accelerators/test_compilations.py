"""The compile-count summary, on counts written out by hand."""

from __future__ import annotations

from lightning_accel.accelerators.compilations import CompileLog


def _log(counts: list[int]) -> CompileLog:
    log = CompileLog()
    log.counts = counts
    return log


def test_stable_after_warmup_and_validation() -> None:
    # first step, steady step; validation after step 10 adds 6; the final step adds 2
    counts = [1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 8, 8, 8, 8, 8, 8, 8, 8, 8, 10]
    assert _log(counts).summary() == "xla: 10 graphs compiled in 20 steps, 0 of them in steps 14-19 (stable)"


def test_a_graph_per_step_is_called_out() -> None:
    summary = _log(list(range(1, 13))).summary()
    assert summary.startswith("xla: 12 graphs compiled in 12 steps, 4 of them in steps 8-11 (RECOMPILING")


def test_too_short_to_judge() -> None:
    assert _log([1, 2]).summary() == "xla: 2 graphs compiled in 2 steps"
