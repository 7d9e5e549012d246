"""examples/fabric_litgpt_loop.py runs on the CPU with our strategy swapped in, and its losses equal Fabric's own
strategy's (the loop itself, under every strategy, is tests/fabric/test_fabric_litgpt.py's)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

pytest.importorskip("litgpt")

EXAMPLE = Path(__file__).parents[2] / "examples" / "fabric_litgpt_loop.py"


def test_the_example_trains_as_fabrics_own_strategy(tmp_path: Path) -> None:
    main = runpy.run_path(str(EXAMPLE))["main"]
    common = ["--steps", "2", "--out"]
    reference = main(["--strategy", "auto", *common, str(tmp_path / "auto.ckpt")])
    losses = main(["--strategy", "l2l_offload", *common, str(tmp_path / "l2l.ckpt")])
    assert losses == pytest.approx(reference, rel=1e-5)
    assert (tmp_path / "l2l.ckpt").is_file()
