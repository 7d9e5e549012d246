"""The conformance runs, once per session: every selected feature under every selected strategy and its reference."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.conformance import FEATURES, STRATEGIES
from tests.support.conformance.launch import run_all


@pytest.fixture(scope="session")
def conformance(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """strategy -> feature -> what each rank saw, for the (feature, strategy) cells this session collected (a ``-k``
    selection runs only what it needs) and their references."""
    cells = {(i.callspec.params["feature"], i.callspec.params["strategy"]) for i in request.session.items
             if "conformance" in getattr(i, "fixturenames", ()) and hasattr(i, "callspec")}
    features = [f for f in FEATURES if any(f == feature for feature, _ in cells)]
    strategies = sorted({s for _, s in cells} | {STRATEGIES[s].reference for _, s in cells})
    return run_all(tmp_path_factory.mktemp("conformance"), strategies, features)
