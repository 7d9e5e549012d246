"""A step in which a stage raised (:mod:`lightning_accel.pipeline.step_failure`): the stand-ins a failed stage sends, what
its peers read in the store, and what every rank raises. Two ranks end to end: tests/pipeline/test_distributed.py
(``raise``) and the strategy's on_exception and detect_anomaly conformance cells."""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_accel.pipeline.step_failure import StepFailure, default_store, stand_in


class MyError(Exception):
    """The user's own exception type."""


class NeedsTwo(Exception):
    """An exception that pickling cannot rebuild (its ``__init__`` takes two arguments, its ``args`` hold one)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a} and {b}")


def _failure(rank: int) -> StepFailure:
    return StepFailure("test/pipeline-error/0,1", rank, None, torch.device("cpu"))


def test_stand_ins_are_zeros_shaped_as_the_stages_outputs_or_one_zero_before_they_are_known():
    # imported here: torch 2.9 (the XLA lane's, which collects every test file) has no _TensorMeta
    from torch.distributed.pipelining._utils import _TensorMeta

    metas = [_TensorMeta.from_tensor(torch.ones(2, 3, dtype=torch.float64, requires_grad=True)),
             _TensorMeta.from_tensor(torch.ones(4, dtype=torch.int64))]
    first, second = stand_in(metas, torch.device("cpu"))
    assert (first.shape, first.dtype, first.requires_grad, first.abs().sum().item()) == ((2, 3), torch.float64, True, 0.0)
    assert (second.shape, second.dtype, second.requires_grad) == ((4,), torch.int64, False)
    one = stand_in([metas[0]], torch.device("cpu"))
    assert isinstance(one, torch.Tensor) and one.shape == (2, 3)
    unknown = stand_in(None, torch.device("cpu"))  # the first step's shape inference: the same on every failed rank
    assert unknown.shape == (1,) and unknown.requires_grad


def test_the_raising_rank_raises_its_own_error_naming_where_and_the_next_step_starts_clean(one_rank_group):
    failure = _failure(0)
    failure.start()
    assert not failure.stopped() and failure.settle() is None
    failure.start()
    err = MyError("boom")
    failure.record(err, stage=1, backward=True)
    failure.record(MyError("later"), stage=1, backward=False)  # the first one counts
    assert failure.stopped() and failure.in_backward
    said = pickle.loads(default_store().get(failure.key))
    assert said["line"] == "rank 0 (stage 1) raised MyError: boom (raised by pipeline stage 1 on rank 0)"
    assert failure.settle() is err and str(err) == "boom (raised by pipeline stage 1 on rank 0)" and failure.settled
    assert not default_store().check([failure.key])  # read by every rank, then deleted
    failure.start()
    assert not failure.stopped() and not failure.settled


def test_a_peer_stops_at_once_and_raises_a_copy_or_one_line_where_the_error_cannot_be_copied(one_rank_group):
    raiser, peer = _failure(1), _failure(0)
    for error, expected in [
        (MyError("boom"), (MyError, "boom (raised by pipeline stage 3 on rank 1)")),
        (NeedsTwo("a", "b"), (RuntimeError, "pipeline step stopped on rank 0: rank 1 (stage 3) raised NeedsTwo: a and b "
                                            "(raised by pipeline stage 3 on rank 1); its log has the traceback")),
    ]:
        raiser.start(), peer.start()
        assert not peer.stopped()
        raiser.record(error, stage=3, backward=False)
        assert peer.stopped()  # before its next forward or backward: the user's code does not run again
        copy = peer._peer_copy()
        assert (type(copy), str(copy)) == expected and copy is not error
        assert not peer.in_backward


def test_without_a_process_group_a_failure_is_still_kept_on_its_rank():
    failure = _failure(0)
    failure.start()
    failure.record(ValueError(), stage=0, backward=False)  # no message: the place goes in a note
    assert failure.stopped() and failure.error.__notes__ == ["raised by pipeline stage 0 on rank 0"]
    with pytest.raises(ValueError):
        raise failure.error
