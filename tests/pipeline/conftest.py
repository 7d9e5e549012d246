"""Fixtures the pipeline tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A 1-rank gloo group in this process: enough for the checks that run before any exchange, and for a pipeline of
    one stage (first and last) whose step runs torch's schedule without a neighbour."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
