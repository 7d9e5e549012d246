"""Step logs recorded per micro-batch and reduced like the loss; evaluation logs recorded and replayed elsewhere."""

from __future__ import annotations

import torch
from torch import nn

from lightning_accel.pipeline.step_logs import EvalLogs, MicroBatchLogs, silenced


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


def test_eval_logs_are_logged_for_real_and_replayed_elsewhere():
    source, other = Logged(), Logged()
    logs = EvalLogs(source, "validation_step")
    with logs.recording():
        source.log("val/loss", torch.tensor(2.5), on_epoch=True)
    assert [n for n, _, _ in source.seen] == ["val/loss"]
    EvalLogs.replay(other, logs.records, torch.device("cpu"))
    assert [(n, float(v), kw) for n, v, kw in other.seen] == [("val/loss", 2.5, {"on_epoch": True})]
