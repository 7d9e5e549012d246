"""The benchmarks' own ranks (``python -m lightning_accel.benchmarks...``, started with ``sys.executable``) start warm here."""

from __future__ import annotations

import sys

import pytest

from tests.support.warm_python import python as warm_python


@pytest.fixture(autouse=True)
def _warm_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sys.executable`` is the warm launcher (tests/support/warm_python.py) while a bench test runs: the worker ranks
    that benchmarks/two_ranks.py, offload_ddp and pipeline_init start from it skip the ~7 s import each. Their timings
    compare rows of one run, all started alike; ``-c`` and multiprocessing's spawn still get the real interpreter."""
    monkeypatch.setattr(sys, "executable", warm_python())
