"""Plain-text tables: one formatter for the library's own reports and for the benchmarks.

The tuner's one-table report and every ``bench`` table print with it; it lives apart from
the bench harness so that the library reports without importing the harness.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table with right-aligned numbers."""
    cells = [[str(h) for h in header]] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
