"""A pipeline step's gradients set aside until the trainer's backward adds them (the collective paths run in the 2-rank tests)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_accel.pipeline.gradients import add_gradients, set_aside


def test_gradients_set_aside_then_added_with_accumulation_scaling():
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 10.0)  # from an earlier accumulated batch
    with set_aside([p]) as grads:
        assert p.grad is None
        (p * 3).sum().backward()
    assert torch.equal(p.grad, torch.full((2,), 10.0)) and torch.equal(grads[0], torch.full((2,), 3.0))
    add_gradients([p], grads, divide_by=2)
    assert torch.equal(p.grad, torch.full((2,), 11.5))
