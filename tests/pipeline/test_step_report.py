"""What a pipeline step reports: step logs reduced like the loss, evaluation logs replayed elsewhere, metric state
carried to another rank, and the step result's float64 path (which values ride in it bit for bit, when the
signature changes).

The 2-rank exchange itself (logs that come and go, a changed name, a non-number, on every
rank) is tested through the strategy: tests/strategies/test_gpipe_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchmetrics import MeanMetric

from lightning_accel.pipeline.step_report import (
    EvalLogs,
    MicroBatchLogs,
    load_metric_state,
    metric_state,
    number_spec,
    reduce_logs,
    silenced,
    step_signature,
    unpack_number,
)
from tests.support.workers.step_report_worker import bits


class Logged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    def log(self, name, value, *a, **kw):
        self.seen.append((name, value, kw))


def test_micro_batch_logs_reduce_like_the_loss_and_the_real_log_comes_back():
    module = Logged()
    logs = MicroBatchLogs(2)
    for i, (value, n) in enumerate([(1.0, 2), (4.0, 6)]):
        with logs.recording(module, i):
            module.log("loss", torch.tensor(value), batch_size=n)
    with logs.recording(module, 1):  # a micro-batch run again: its last run counts
        module.log("loss", torch.tensor(4.0), batch_size=6)
    assert module.seen == [] and "log" not in vars(module)
    [(name, value, kw)] = logs.reduced([2, 6], "mean")
    assert name == "loss" and float(value) == 3.25 and kw == {"batch_size": 8}
    with silenced(module):
        module.log("x", 1.0)
    assert module.seen == []


def test_the_loss_logged_with_any_reduce_fx_is_the_batch_loss_and_other_values_keep_their_reduce_fx():
    """training_step logs its loss (the tensor it returns, or a detached view) with reduce_fx="max": the step's value is
    the batch's loss (the micro-batches' mean), as plain Lightning logs it, and max then reduces the epoch's steps;
    before, the larger micro-batch loss (the log_reduce_fx conformance cell: 2.18 vs 1.39 at the epoch's end). A value
    that is not the loss keeps its reduce_fx over the micro-batches (a per-sample maximum stays a maximum)."""
    module, logs = Logged(), MicroBatchLogs(2)
    for i, (loss, worst) in enumerate([(torch.tensor(1.0, requires_grad=True), 3.0), (torch.tensor(2.0, requires_grad=True), 5.0)]):
        with logs.recording(module, i):
            module.log("loss_max", loss, reduce_fx="max")
            module.log("loss_sum", loss.detach(), reduce_fx="sum")
            module.log("worst", torch.tensor(worst), reduce_fx="max")
            module.log("copy", loss.detach().clone(), reduce_fx="max")  # another tensor: not the loss itself
        logs.mark_loss(i, loss)
    assert logs.losses == [{"loss_max", "loss_sum"}] * 2
    reduced = {name: float(value) for name, value, _ in logs.reduced([2, 2], "mean")}
    assert reduced == {"loss_max": 1.5, "loss_sum": 1.5, "worst": 5.0, "copy": 2.0}


def test_a_constant_batch_size_stays_constant_and_the_micro_batches_sizes_become_the_batchs():
    """batch_size=1 on every step weighs the steps alike, as plain Lightning does, also on a ragged last batch whose
    micro-batches hold 1 sample each (before: the batch's sample count, so the epoch mean was weighted: 0.8466 vs
    0.8549 in the log_batch_size cell); batch_size=len(batch) of each micro-batch becomes the whole batch's."""
    constant: set[str] = set()
    for sizes in ([2, 2], [1, 1]):
        records = [[("unweighted", 1.0, {"batch_size": 1}), ("weighted", 1.0, {"batch_size": n})] for n in sizes]
        kwargs = {name: kw["batch_size"] for name, _, kw in reduce_logs(records, sizes, "mean", constant_sizes=constant)}
        assert kwargs == {"unweighted": 1, "weighted": sum(sizes)}
    assert constant == {"unweighted"}


def test_eval_logs_are_logged_for_real_and_replayed_elsewhere():
    source, other = Logged(), Logged()
    logs = EvalLogs(source, "validation_step")
    with logs.recording():
        source.log("val/loss", torch.tensor(2.5), on_epoch=True)
    assert [n for n, _, _ in source.seen] == ["val/loss"]
    EvalLogs.replay(other, logs.records, torch.device("cpu"))
    assert [(n, float(v), kw) for n, v, kw in other.seen] == [("val/loss", 2.5, {"on_epoch": True})]


def test_a_metric_state_loaded_on_another_rank_computes_the_same_value():
    source, other = MeanMetric(), MeanMetric()
    source.update(torch.tensor([1.0, 2.0, 6.0]))
    source.update(torch.tensor(3.0), weight=2.0)
    load_metric_state(other, metric_state(source), torch.device("cpu"))
    assert float(other.compute()) == float(source.compute()) == 3.0
    assert other._update_count == source._update_count == 2


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor(1 / 3), torch.tensor(1 / 3, dtype=torch.float64), torch.tensor(1 / 3, dtype=torch.bfloat16),
        torch.tensor([65504.0], dtype=torch.float16), torch.tensor(float("nan")), torch.tensor(-float("inf")),
        torch.tensor(2**53, dtype=torch.int64), torch.tensor([[-7]], dtype=torch.int32), 1 / 3, -(2**53), 0.0,
    ],
)
def test_a_step_number_rides_in_float64_and_comes_back_bit_for_bit(value):
    spec = number_spec(value)
    assert spec is not None
    assert bits(unpack_number(float(value), spec)) == bits(value)


@pytest.mark.parametrize(
    "value", [True, 2**53 + 1, torch.tensor(2**60), torch.ones(2), torch.tensor(1.0, requires_grad=True), "x", None]
)
def test_what_float64_cannot_hold_exactly_goes_as_an_object(value):
    assert number_spec(value) is None
    assert step_signature((torch.tensor(1.0), [("v", value, {})], False)) is None


def test_the_step_signature_changes_with_names_options_and_kinds_not_values():
    def result(name="a", value=1.0, kw=None):
        return (torch.tensor(2.0), [(name, torch.tensor(value), kw or {})], False)

    assert step_signature(result(value=1.0)) == step_signature(result(value=5.0))
    for other in (result(name="b"), result(kw={"prog_bar": True}), (torch.tensor(2.0), [], False), result()[:2] + (True,)):
        assert step_signature(other) != step_signature(result())
    assert step_signature((torch.tensor(2.0), [("a", torch.tensor(1.0, dtype=torch.float64), {})], False)) != (
        step_signature(result())
    )
