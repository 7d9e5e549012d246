"""gpipe_distributed keeps the pipeline semantics of the reference GPipe (torchgpipe), on 2 gloo ranks in float64:
BatchNorm statistics, ragged batches, a stage's exception, tuples between stages; against plain Lightning, or
``gpipe`` in one process where micro-batches change the arithmetic (BatchNorm per micro-batch)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_accel.strategies.gpipe import GPipeStrategy

PIPELINE_TESTS = Path(__file__).resolve().parents[1] / "pipeline"
sys.path.insert(0, str(PIPELINE_TESTS))
from semantics_worker import SECTIONS, BatchNormBlocks, data, fit  # noqa: E402
from user_script import run_user_script  # noqa: E402


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("semantics")
    result = run_user_script(PIPELINE_TESTS / "semantics_worker.py", [str(out), ",".join(SECTIONS)], 300, "2-process semantics")
    assert result.returncode == 0, result.stdout[-6000:]
    return out


def _reference(case: str) -> dict[str, torch.Tensor]:
    """Plain Lightning at chunks=1; ``gpipe`` on 2 CPU devices in one process at more chunks (BatchNorm then sees
    micro-batches, which plain training does not)."""
    model, options, batch, n = {k: v for s in SECTIONS.values() for k, v in s().items()}[case]
    task = model()
    if options["chunks"] == 1:
        fit(task, DataLoader(data(n), batch_size=batch), "auto")
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the per-micro-batch BatchNorm notice
            fit(task, DataLoader(data(n), batch_size=batch), GPipeStrategy(devices=2, blocks=lambda net: list(net), **options))
    return task.state_dict()


BN_CASES = list(SECTIONS["batchnorm"]())


@pytest.mark.parametrize("case", BN_CASES)
def test_batch_norm_buffers_and_weights_equal_the_reference_after_fit(two_ranks, case):
    """Running statistics (and num_batches_tracked) once per micro-batch, or once per batch deferred, in every checkpoint
    mode, a BatchNorm a block of its own or inside one; neither recomputation nor torch's shape inference (a real
    forward and backward of micro-batch 0) leaves a trace, and dropout masks are plain training's. Before: 13 updates
    for 12 at chunks 4 "never", more with recomputation, and no deferred_batch_norm option."""
    assert (two_ranks / f"{case}-rank0.txt").read_text() == "ok"
    piped = torch.load(two_ranks / f"{case}.pt", weights_only=False)
    reference = _reference(case)
    assert piped.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(piped[name], value, rtol=1e-10, atol=1e-12, msg=f"{case}: {name}")
    _, options, _, _ = SECTIONS["batchnorm"]()[case]
    tracked = [v for k, v in piped.items() if k.endswith("num_batches_tracked")]
    per_step = 1 if options["deferred_batch_norm"] else options["chunks"]
    assert [int(t) for t in tracked] == [per_step * 3] * 2

