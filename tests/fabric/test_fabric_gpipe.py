"""``Fabric(strategy="gpipe")``: the model's call, with grad, runs as micro-batches through the stages and is joined,
so the loop's loss and ``fabric.backward`` see the whole batch (weights equal Fabric's default strategy in float64);
a call without grad runs whole; what micro-batching would train otherwise is refused at ``fabric.setup``."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

import lightning_accel  # noqa: F401  (registers the names with Fabric)
from lightning_accel.fabric import GPipeStrategy

from tests.support.fabric_loops import max_difference, weights
from tests.support.offload_nets import Net


def _train(strategy: Any, calls: list[int] | None = None) -> Any:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = Net(depth=4, width=8).double()
    if calls is not None:
        model.layers[0].register_forward_hook(lambda *_: calls.append(1))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 1, generator=g, dtype=torch.float64)
        with fabric.no_backward_sync(model, enabled=i % 2 == 0):
            fabric.backward(nn.functional.mse_loss(model(x), y) / 2)
        if i % 2:
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()
    return model


def test_micro_batches_through_the_stages_equal_fabrics_default_strategy() -> None:
    calls: list[int] = []
    model = _train(GPipeStrategy(chunks=4, devices=["cpu", "cpu"], checkpoint="never"), calls)
    assert len(calls) == 4 * 4  # four micro-batches a batch (no re-materialization with checkpoint="never")
    assert max_difference(weights(_train("auto")), weights(model)) < 1e-14
    calls.clear()
    with torch.no_grad():
        model(torch.randn(8, 4, dtype=torch.float64))
    assert len(calls) == 1  # inference: the call runs whole


def test_by_name_with_recomputation_equals_fabrics_default_strategy() -> None:
    assert max_difference(weights(_train("auto")), weights(_train("gpipe"))) < 1e-14


def test_batch_norm_micro_batched_is_refused_at_setup() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=GPipeStrategy(chunks=2, devices=["cpu", "cpu"]))
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    with pytest.raises(ValueError, match=r"^GPipeStrategy\(chunks=2\): .*BatchNorm1d\) normalizes each of the 2 micro-batches"):
        fabric.setup(model)
