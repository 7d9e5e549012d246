"""Lightning's ModelSummary on a module split across pipeline ranks (:mod:`lightning_accel.strategies.gpipe_callbacks`):
its example input runs on meta, so the sizes and FLOPs are the whole model's; in one process, no Trainer."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import summarize
from torch import nn

from lightning_accel.strategies.gpipe_callbacks import _summary_on_meta


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
        self.example_input_array = torch.zeros(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Refuses(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:
            raise NotImplementedError("no meta kernel")
        return self.net(x)


def _table(summary) -> tuple:
    return summary._get_summary_data(), summary.total_flops, summary.total_parameters


def test_a_split_modules_summary_shows_the_whole_models_sizes_and_flops_and_keeps_its_tensors():
    whole = Net()
    reference = _table(summarize(whole, max_depth=2))
    assert reference[1] > 0 and "[3, 4]" in str(reference[0])  # the example input ran: sizes and FLOPs
    split = Net()
    split.net[2].to("meta")  # another rank's block: a placeholder here
    tensors = [*split.parameters(), *split.buffers()]
    callback = ModelSummary(max_depth=2)
    handle = _summary_on_meta(callback)
    try:
        assert _table(callback._summary(None, split)) == reference
    finally:
        handle.remove()
    assert [*split.parameters(), *split.buffers()] == tensors  # the same tensors, this rank's on the CPU again
    assert not split.net[0].weight.is_meta and split.net[2].weight.is_meta
    assert torch.equal(split.example_input_array, torch.zeros(3, 4))


def test_a_model_that_cannot_run_on_meta_is_summarized_without_sizes_said_once():
    callback = ModelSummary(max_depth=2)
    handle = _summary_on_meta(callback)
    try:
        with pytest.warns(UserWarning, match=r"ModelSummary: example_input_array could not run on the meta device "
                          r"\(NotImplementedError: no meta kernel\), so the summary leaves out in/out sizes and FLOPs"):
            data, flops, _ = _table(callback._summary(SimpleNamespace(strategy=None), Refuses()))
    finally:
        handle.remove()
    assert flops == 0 and "[3, 4]" not in str(data)
