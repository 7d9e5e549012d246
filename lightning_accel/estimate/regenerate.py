"""The recipes' memory figures, written from the estimate: ``python -m lightning_accel.estimate.regenerate``.

Two places quote a recipe's memory, and both are written here, from
:func:`~lightning_accel.estimate.estimate_recipe` of the recipe as shipped:

- README.md's recipe table, its ``memory by estimate`` column: the device peak per rank and the
  host bytes of all ranks of one machine (a CPU recipe: host only, the CPU is its device);
- a recipe's header comment from the line ``# Memory by lightning-accel estimate`` to the first
  line that does not start with ``#   ``: every component of each rank kind.

``--check`` writes nothing and exits 1 naming each figure that is not the estimate's (the test
runs it); recipe names limit the work to those recipes. The README is the checkout's (``--readme``,
by default the one beside the package in a source tree, else ./README.md): an installed package
ships no README.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from lightning_accel.estimate.report import Estimate, gb

README = Path(__file__).resolve().parents[2] / "README.md"  # in a source tree (an editable install); absent when installed
COLUMN = "memory by estimate"
MARKER = "# Memory by lightning-accel estimate"
_BLOCK_LINE = "#   "
_KEEP = "\xa0"  # a space textwrap does not break at: a component stays on one line


def table_cell(estimate: Estimate) -> str:
    """``device 9.50 GB, host 152.31 GB``; ``device 6.59 GB a rank`` over several ranks; ``host 114.3 MB`` on the CPU."""
    host = f"host {gb(estimate.host_total)}"
    if estimate.on_cpu:
        return host
    several = sum(r.count for r in estimate.ranks) > 1
    return f"device {gb(estimate.device_peak)}{' a rank' if several else ''}, {host}"


def comment_block(estimate: Estimate) -> list[str]:
    """The recipe's comment lines: the marker, then per rank kind its device peak and host bytes by component."""
    lines = [f"{MARKER} (python -m lightning_accel.estimate.regenerate writes it):"]
    single = len(estimate.ranks) == 1 and estimate.ranks[0].count == 1
    for rank in estimate.ranks:
        who = "" if single else f"{rank.kind} (x{rank.count}), "
        parts = []
        if not estimate.on_cpu:
            parts.append((f"{who}device peak {gb(rank.device_peak_bytes)}", rank.device))
        parts.append((f"{who}host {gb(rank.host_bytes)}", rank.host))
        for head, components in parts:
            text = f"{head}: " + ", ".join(f"{name} {gb(value)}".replace(" ", _KEEP) for name, value in components.items()) + ";"
            wrapped = textwrap.wrap(text, 100, initial_indent=_BLOCK_LINE, subsequent_indent=_BLOCK_LINE + "  ", break_on_hyphens=False)
            lines += [line.replace(_KEEP, " ") for line in wrapped]
    lines[-1] = lines[-1][:-1] + "."
    return lines


def rewrite_table(readme: str, cells: dict[str, str]) -> str:
    """``readme`` with the ``memory by estimate`` cell of each recipe in ``cells`` replaced."""
    lines = readme.split("\n")
    header = next((i for i, line in enumerate(lines) if line.startswith("| recipe |") and COLUMN in line), None)
    if header is None:
        raise ValueError(f"README.md has no recipe table with a '{COLUMN}' column")
    column = [c.strip() for c in lines[header].strip().strip("|").split("|")].index(COLUMN)
    i = header + 2  # past the |---| row
    while i < len(lines) and lines[i].startswith("|"):
        row = [c.strip() for c in lines[i].strip().strip("|").split("|")]
        name = row[0].strip("`")
        if name in cells:
            row[column] = cells[name]
            lines[i] = "| " + " | ".join(row) + " |"
        i += 1
    return "\n".join(lines)


def rewrite_recipe(text: str, block: list[str]) -> str:
    """A recipe's text with its estimate comment block replaced by ``block`` (unchanged without the marker)."""
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith(MARKER)), None)
    if start is None:
        return text
    end = start + 1
    while end < len(lines) and lines[end].startswith(_BLOCK_LINE):
        end += 1
    return "\n".join([*lines[:start], *block, *lines[end:]])


def regenerate(recipes: Sequence[str], check: bool, readme: Path = README) -> list[str]:
    """Estimate ``recipes`` and write their figures into ``readme`` and the recipes (``check``: compare only);
    the files whose figures differed."""
    from lightning_accel.config.compose import recipes_dir
    from lightning_accel.estimate import estimate_recipe

    estimates = {name: estimate_recipe(name, []) for name in recipes}
    targets = {readme: rewrite_table(readme.read_text(), {n: table_cell(e) for n, e in estimates.items()})}
    for name, estimate in estimates.items():
        path = recipes_dir() / f"{name}.yaml"
        targets[path] = rewrite_recipe(path.read_text(), comment_block(estimate))
    stale = [path for path, text in targets.items() if path.read_text() != text]
    if not check:
        for path in stale:
            path.write_text(targets[path])
    return [str(path) for path in stale]


def main(argv: Sequence[str] | None = None) -> int:
    from lightning_accel.config.compose import recipe_names

    parser = argparse.ArgumentParser(prog="python -m lightning_accel.estimate.regenerate", description=__doc__.split("\n")[0])
    parser.add_argument("recipes", nargs="*", help="recipes to regenerate (default: every shipped recipe)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a quoted figure is not the estimate's")
    parser.add_argument("--readme", type=Path, default=README if README.exists() else Path("README.md"),
                        help="the checkout's README.md (default: the one beside the package, else ./README.md)")
    args = parser.parse_args(argv)
    if not args.readme.is_file():
        parser.error(f"no README at {args.readme}; run from the checkout or pass --readme PATH")
    unknown = sorted(set(args.recipes) - set(recipe_names()))
    if unknown:
        parser.error(f"no shipped recipe {', '.join(unknown)}; see lightning-accel ls")
    stale = regenerate(args.recipes or recipe_names(), args.check, args.readme)
    for path in stale:
        print(f"{'stale' if args.check else 'rewrote'}: {path}")
    if args.check and stale:
        print("the quoted memory figures are not the estimate's; run: python -m lightning_accel.estimate.regenerate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
