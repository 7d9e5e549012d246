"""choose_balance: a list as given, by size, by time (measured once), and its refusals."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_accel.pipeline.rank_balance import choose_balance


def test_balance_choice_and_its_refusals():
    blocks = [nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(4, 4)]
    never = lambda: pytest.fail("measured")  # noqa: E731
    assert choose_balance([1, 2], blocks, 2, 2, "Net", never) == ([1, 2], None)
    assert choose_balance("by_size", blocks, 2, 2, "Net", never)[0] in ([1, 2], [2, 1])
    assert choose_balance("by_time", blocks, 2, 2, "Net", lambda: [1.0, 1.0, 2.0]) == ([2, 1], [1.0, 1.0, 2.0])
    with pytest.raises(ValueError, match=r"2 ranks per pipeline run 4 stages but Net has 3 blocks"):
        choose_balance("by_size", blocks, 4, 2, "Net", never)
    with pytest.raises(ValueError, match=r"balance='by_time' times every block of Net on rank 0.*; use balance='by_size'"):
        choose_balance("by_time", blocks, 2, 2, "Net", never, on_meta=True)
