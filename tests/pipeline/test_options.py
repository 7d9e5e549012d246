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


def test_a_batch_size_no_micro_batch_count_fits_is_refused_with_the_fix():
    """A batch chunks does not divide runs in equal micro-batches of another count (fewer where one fits); a size no
    count the schedule runs divides is refused, naming drop_last=True for a last batch or the batch size that works."""
    assert PipelineOptions(chunks=4).check_batch_size(8, "1f1b", 2) == 4
    assert PipelineOptions(chunks=4).check_batch_size(6, "1f1b", 2) == 3
    assert PipelineOptions(chunks=4).check_batch_size(2, "gpipe", 2) == 2
    assert PipelineOptions(chunks=4).check_batch_size(7, "1f1b", 2) == 7  # 1 micro-batch cannot feed 2 stages
    with pytest.raises(ValueError, match=r"^DistributedGPipeStrategy\(chunks=4, schedule='1f1b'\): the training DataLoader's "
                                         r"last batch of 1 cannot be split .* on 2 stages \(it needs at least 2\); use "
                                         r"drop_last=True on the DataLoader, or schedule='gpipe'$"):
        PipelineOptions(chunks=4).check_batch_size(1, "1f1b", 2, what="last batch")
    with pytest.raises(ValueError, match=r"batch_size of 3 cannot be split .*; use a batch_size of at least 4, or"):
        PipelineOptions(chunks=4).check_batch_size(3, "interleaved_1f1b", 4)
