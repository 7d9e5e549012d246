"""A stage's own backward error reaches the user as itself (:mod:`lightning_accel.pipeline.torch_stage`), on one rank."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_accel.models import MLP
from lightning_accel.pipeline.distributed import RankPipeline
from lightning_accel.pipeline.torch_stage import own_error


class MyError(Exception):
    """The user's own exception type."""


class RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise MyError("bad gradient")


def test_anomaly_detection_on_a_nan_gradient_raises_its_own_error_first(one_rank_group):
    """``torch.autograd.detect_anomaly`` (Lightning's ``detect_anomaly=True``) on a loss whose gradient is NaN: the step
    raises anomaly mode's RuntimeError, its message first, then the rank and stage. Before: "pipeline step failed on
    rank 0 (stages [0]) while exchanging with rank(s) []: RuntimeError: Failed to run stage backward ..."."""
    torch.manual_seed(0)
    pipe = RankPipeline(MLP(6, 3, hidden=8, depth=2), [2], chunks=2, loss_fn=lambda out, y: F.mse_loss(out * float("nan"), y))
    with warnings.catch_warnings(), torch.autograd.detect_anomaly():
        warnings.simplefilter("ignore")  # anomaly mode's own notices (enabled; the forward's traceback)
        with pytest.raises(RuntimeError, match=r"^Function 'MseLossBackward0' returned nan values in its 0th output\. \(raised by pipeline stage 0 on rank 0\)$"):
            pipe.step(torch.randn(4, 6), torch.randn(4, 3))


def test_a_users_backward_raising_keeps_its_type(one_rank_group):
    """A user's autograd Function that raises in backward: the step raises that MyError, not torch's "Failed to run
    stage backward" RuntimeError around it."""
    net = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
    pipe = RankPipeline(net, [2], chunks=2, loss_fn=lambda out, y: F.mse_loss(RaisesInBackward.apply(out), y), blocks=lambda n: list(n))
    with pytest.raises(MyError, match=r"^bad gradient \(raised by pipeline stage 0 on rank 0\)$"):
        pipe.step(torch.randn(4, 6), torch.randn(4, 3))


def test_own_error_unwraps_torchs_stage_wrappers_only():
    cause = MyError("mine")
    try:
        try:
            raise cause
        except MyError as err:
            raise RuntimeError("\n        Failed to run stage backward:\n        Stage output: ...") from err
    except RuntimeError as wrapped:
        assert own_error(wrapped) is cause
    transport = RuntimeError("Connection closed by peer")
    transport.__cause__ = ValueError("x")
    assert own_error(transport) is transport
