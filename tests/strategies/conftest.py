"""Fixtures the strategy tests share."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.support.user_script import run_user_script
from tests.support.workers import WORKERS
from tests.support.workers.semantics_worker import SECTIONS


@pytest.fixture
def one_rank() -> Iterator[None]:
    """Lightning's process group of 1 in this process, destroyed afterwards (other tests make their own)."""
    saved = dict(os.environ)  # Lightning sets MASTER_PORT, LOCAL_RANK, WORLD_SIZE, ... for the group
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def semantics_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank ``gpipe_distributed`` launch of ``workers/semantics_worker.py`` for every section (the pipeline's
    semantics, Lightning's features, a mixture of experts where transformers is installed, a stage raising last): the
    ranks' start-up is paid once for test_gpipe_distributed_semantics.py and test_gpipe_distributed_lightning.py."""
    out = tmp_path_factory.mktemp("semantics")
    moe = ["moe"] if importlib.util.find_spec("transformers") else []
    sections = ",".join([*SECTIONS, "features", *moe, "raising"])
    result = run_user_script(WORKERS / "semantics_worker.py", [str(out), sections], 300, "2-process semantics")
    assert result.returncode == 0, result.stdout[-6000:]
    return out
