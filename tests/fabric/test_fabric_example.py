"""examples/fabric_litgpt_loop.py runs on the CPU under each strategy, and its losses equal Fabric's own strategy's."""

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
    for strategy in ("l2l_offload", "gpipe"):
        losses = main(["--strategy", strategy, *common, str(tmp_path / f"{strategy}.ckpt")])
        assert losses == pytest.approx(reference, rel=1e-5), strategy
        assert (tmp_path / f"{strategy}.ckpt").is_file()
