"""The recipes' quoted memory figures are the estimate's: README.md's table and the recipes' comment blocks."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from lightning_accel.config.compose import recipe_names, recipes_dir
from lightning_accel.estimate.components import RankEstimate
from lightning_accel.estimate.regenerate import MARKER, comment_block, regenerate, rewrite_recipe, rewrite_table, table_cell
from lightning_accel.estimate.report import Estimate
from tests.support.warm_python import python as warm_python

# the checkout's README, beside these tests: CI installs the package itself (no README beside it)
README = Path(__file__).resolve().parents[2] / "README.md"

TABLE = """intro

| recipe | model | memory by estimate |
|---|---|---|
| `a_1gpu` | A | old |
| `b_cpu` | B | old |

after"""


def _estimate(on_cpu: bool = False, count: int = 1) -> Estimate:
    rank = RankEstimate("rank" if count > 1 else "device", count, device={"activations": 2_500_000_000, "blocks in flight (2)": 500_000_000},
                        host={"masters (fp32)": 30_000_000_000, "optimizer state": 60_000_000_000})
    if on_cpu:
        rank = RankEstimate("device", 1, host={"parameters": 3_000_000, "activations": 100_000_000})
    return Estimate("a_1gpu", "l2l_offload", [rank], device_memory=None, host_memory=None, on_cpu=on_cpu)


def test_table_cells_give_device_per_rank_and_host_of_the_machine() -> None:
    assert table_cell(_estimate()) == "device 3.00 GB, host 90.00 GB"
    assert table_cell(_estimate(count=8)) == "device 3.00 GB a rank, host 720.00 GB"
    assert table_cell(_estimate(on_cpu=True)) == "host 0.10 GB"


def test_rewrite_table_replaces_only_the_named_recipes_cells() -> None:
    out = rewrite_table(TABLE, {"a_1gpu": "device 3.00 GB, host 90.00 GB"})
    assert out == TABLE.replace("| `a_1gpu` | A | old |", "| `a_1gpu` | A | device 3.00 GB, host 90.00 GB |")
    with pytest.raises(ValueError, match="no recipe table with a 'memory by estimate' column"):
        rewrite_table("| recipe | model |\n|---|---|", {})


def test_comment_block_lists_every_component_and_replaces_the_old_block() -> None:
    block = comment_block(_estimate())
    assert block == [
        f"{MARKER} (python -m lightning_accel.estimate.regenerate writes it):",
        "#   device peak 3.00 GB: activations 2.50 GB, blocks in flight (2) 0.50 GB;",
        "#   host 90.00 GB: masters (fp32) 30.00 GB, optimizer state 60.00 GB.",
    ]
    recipe = f"# run it\n{MARKER}\n#   stale line\n#     stale continuation\n# Data: kept\ndefaults: []\n"
    assert rewrite_recipe(recipe, block) == "# run it\n" + "\n".join(block) + "\n# Data: kept\ndefaults: []\n"
    assert rewrite_recipe("# no block\n", block) == "# no block\n"


def test_no_hand_written_memory_arithmetic_is_left() -> None:
    """Memory figures are quoted from the estimate only (the hand-written "by arithmetic" ones drifted:
    qwen2.5-7b_l2l-bf16_1gpu said 137 GB of host RAM, leaving out 15.2 GB of pinned gradient staging)."""
    quoting = [n for n in recipe_names() if "by arithmetic" in (recipes_dir() / f"{n}.yaml").read_text()]
    assert quoting == []
    assert "by arithmetic" not in README.read_text().split("## Recipes", 1)[1].split("\n## ", 1)[0]


def _largest_first(recipes: list[str]) -> list[str]:
    """The recipes by the model size their names state (``gpt-175b_...``: 175e9; none: 0), largest first. Sorted by
    name, the two slowest (gpt-175b_full-nvme_1gpu, 27 s of CPU; llama-3.1-70b_full-nvme_1gpu, 18 s) fell to the same
    half, and the other process waited on it."""
    def size(name: str) -> float:
        found = re.search(r"-(\d+(?:\.\d+)?)b[_-]", name)
        return float(found.group(1)) if found else 0.0

    return sorted(recipes, key=lambda name: (-size(name), name))


@pytest.mark.parametrize(
    ("recipes", "beside"),
    [
        pytest.param(["llama-tiny_cpu", "gpt-tiny_l2l_cpu", "gpt-small_gpipe-1f1b_4gpu"], False, id="cheap"),
        pytest.param(recipe_names(), True, id="all", marks=pytest.mark.slow),  # every recipe: ~25 s, half of it in a second process
    ],
)
def test_quoted_figures_are_the_estimates(recipes: list[str], beside: bool, cli_env: dict[str, str]) -> None:
    """``beside``: every other recipe, dealt largest model first (:func:`_largest_first`), so that the few slow large
    ones fall to both halves, is checked by the command in a second process while this one checks the rest: each
    recipe's estimate is one core's work, and one after another the 26 took 100 s of CI's time."""
    dealt = _largest_first(recipes)
    there, here = (dealt[0::2], dealt[1::2]) if beside else ([], recipes)
    proc = subprocess.Popen([warm_python(), "-m", "lightning_accel.estimate.regenerate", "--check", "--readme", str(README), *there],
                            env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) if there else None
    try:
        stale = regenerate(here, check=True, readme=README)
    finally:
        out, err = proc.communicate(timeout=600) if proc is not None else ("", "")
    assert stale == []
    assert proc is None or (proc.returncode, out) == (0, ""), out + err[-3000:]


def test_an_unknown_recipe_is_refused_with_where_to_look(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_accel.estimate.regenerate import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--check", "no-such_recipe"])
    assert exit_info.value.code == 2
    assert "no shipped recipe no-such_recipe; see lightning-accel ls" in capsys.readouterr().err
