"""Fixtures the strategy tests share."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank() -> Iterator[None]:
    """Lightning's process group of 1 in this process, destroyed afterwards (other tests make their own)."""
    saved = dict(os.environ)  # Lightning sets MASTER_PORT, LOCAL_RANK, WORLD_SIZE, ... for the group
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
