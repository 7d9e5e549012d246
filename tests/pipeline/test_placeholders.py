"""A ``meta`` placeholder equals no tensor while a split module trains (:mod:`lightning_accel.pipeline.placeholders`)."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.pipeline.placeholders import placeholders_equal_nothing


def test_torch_equal_with_a_placeholder_answers_false_until_undone():
    real, placeholder = torch.ones(3), torch.ones(3, device="meta")
    undo = placeholders_equal_nothing()
    try:
        assert torch.equal(real, placeholder) is False and torch.equal(placeholder, placeholder) is False
        assert torch.equal(real, real.clone())  # real tensors compare as before
    finally:
        undo()
    with pytest.raises(NotImplementedError, match="aten::equal"):
        torch.equal(real, placeholder)
