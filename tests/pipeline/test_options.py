"""PipelineOptions: the four settings both GPipe strategies share, checked once with the value and the fix."""

from __future__ import annotations

import pytest

from lightning_accel import GPipeStrategy
from lightning_accel.pipeline.options import PipelineOptions
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy


def test_valid_options_become_plain_data():
    options = PipelineOptions(chunks=4, balance=[2, 2], checkpoint="always", loss_reduction="sum")
    assert options.balance == (2, 2) and options.checkpoint_stop == 4 and not options.scale_grads
    assert PipelineOptions(chunks=4, checkpoint="except_last").checkpoint_stop == 3
    assert PipelineOptions(checkpoint="never").checkpoint_stop == 0 and PipelineOptions().scale_grads


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunks": 0}, r"chunks must be a positive int \(micro-batches per batch\), got 0; e.g. chunks=4"),
        ({"chunks": True}, r"chunks must be a positive int.*got True"),
        ({"checkpoint": "sometimes"}, r"checkpoint must be one of always, except_last, never, got 'sometimes'"),
        ({"loss_reduction": "max"}, r"loss_reduction must be 'mean' or 'sum'.*got 'max'"),
        ({"balance": "fast"}, r"balance must be a list of blocks per stage, 'by_size' or 'by_time', got 'fast'"),
        ({"balance": [2, 0]}, r"balance must be a non-empty list of positive ints \(blocks per stage\), got \[2, 0\]"),
        ({"balance": []}, r"balance must be a non-empty list of positive ints"),
    ],
)
def test_bad_options_are_refused_alike_by_both_strategies(kwargs, match):
    # GPipeStrategy has no loss_reduction: its training_step runs on the whole batch, nothing to reduce
    builders = (PipelineOptions, DistributedGPipeStrategy) if "loss_reduction" in kwargs else (PipelineOptions, GPipeStrategy, DistributedGPipeStrategy)
    for build in builders:
        with pytest.raises(ValueError, match=match):
            build(**kwargs)


def test_a_batch_size_that_is_not_a_multiple_of_chunks_is_refused_with_the_fix():
    PipelineOptions(chunks=4).check_batch_size(8)
    with pytest.raises(ValueError, match=r"^DistributedGPipeStrategy\(chunks=4\): the training DataLoader's batch_size=6 is "
                                         r"not a multiple of chunks.*; use a batch_size that is a multiple of 4 \(e.g. 8\)"):
        PipelineOptions(chunks=4).check_batch_size(6)
