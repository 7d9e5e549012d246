"""What a step appends to its module's lists becomes one item per batch (:mod:`lightning_accel.pipeline.kept_outputs`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_accel.pipeline.kept_outputs import KeptLists, merge_items


def test_merged_items_are_what_one_step_on_the_whole_batch_appends():
    x = torch.arange(12.0).reshape(6, 2)
    parts, sizes = [x[:2], x[2:6]], [2, 4]
    losses = [part.pow(2).mean() for part in parts]
    assert torch.equal(merge_items(parts, sizes, "mean"), x)  # per-sample rows, joined in order
    torch.testing.assert_close(merge_items(losses, sizes, "mean"), x.pow(2).mean())  # a mean, weighted by size
    torch.testing.assert_close(merge_items(losses, sizes, "sum"), losses[0] + losses[1])
    assert merge_items([torch.tensor(3), torch.tensor(4)], sizes, "mean").item() == 7  # a count: summed
    assert merge_items([5, 5], sizes, "mean") == 5  # the same in every run (a batch index): itself
    assert merge_items([0.5, 1.5], sizes, "mean") == pytest.approx(0.5 / 3 + 1.5 * 2 / 3)
    merged = merge_items([{"loss": losses[0], "p": parts[0]}, {"loss": losses[1], "p": parts[1]}], sizes, "mean")
    assert merged.keys() == {"loss", "p"} and torch.equal(merged["p"], x)
    assert merge_items([("a", parts[0]), ("b", parts[1])], sizes, "mean")[0] == "b"  # not a number: the last run's


class Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.outputs: list = [torch.tensor(9.0)]  # an earlier batch's
        self.seen: list = []


def test_every_rank_ends_with_the_last_ranks_items_and_none_of_its_own_runs():
    last, other = Module(), Module()
    kept_last, kept_other = KeptLists(last), KeptLists(other)
    for part in (torch.ones(2), torch.full((4,), 2.0)):  # the last rank: two micro-batch runs to the end
        with kept_last.recording():
            last.seen.append(7)
            last.outputs.append(part.mean())
    with pytest.raises(KeyboardInterrupt):  # another rank's run, stopped at its stage's end (a BaseException)
        with kept_other.recording():
            other.seen.append(7)
            raise KeyboardInterrupt
    appended = kept_last.merged([2, 4], "mean")
    assert appended["seen"] == [7]
    torch.testing.assert_close(appended["outputs"][0], torch.tensor(2 / 6 + 2.0 * 4 / 6))
    for module, kept in ((last, kept_last), (other, kept_other)):
        kept.settle(appended, torch.device("cpu"))
        assert module.seen == [7] and len(module.outputs) == 2 and module.outputs[0].item() == 9.0
        torch.testing.assert_close(module.outputs[1], appended["outputs"][0])
