"""The timeline of a pipeline step as it ran: one box per micro-batch forward/backward per stage.

Executors record :class:`Event` s (wall-clock seconds, so ranks on one machine share a
clock); these pure functions turn them into the measured bubble fraction, a Chrome
trace (``chrome://tracing``, Perfetto) and a hand-written SVG picture (no plotting
library needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple
from xml.sax.saxutils import escape

__all__ = ["Event", "measured_bubble", "stage_orders", "to_chrome_trace", "to_svg"]


class Event(NamedTuple):
    """``kind`` ("F" or "B") of ``microbatch`` on ``stage`` ran from ``start`` to ``end`` (seconds)."""

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


def stage_orders(events: Sequence[Event]) -> list[list[str]]:
    """Per stage, the actions in the order they started: ``[["F0", "F1", "B0", ...], ...]``."""
    stages = 1 + max(e.stage for e in events)
    return [[f"{e.kind}{e.microbatch}" for e in sorted(events, key=lambda e: e.start) if e.stage == s] for s in range(stages)]


def measured_bubble(events: Sequence[Event]) -> float:
    """Share of stage-time idle between the step's first start and last end: 1 - busy / (stages * span)."""
    if not events:
        raise ValueError("no events recorded; run a step with recording on first")
    stages = 1 + max(e.stage for e in events)
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return max(0.0, 1.0 - busy / (stages * span)) if span > 0 else 0.0


def to_chrome_trace(events: Sequence[Event]) -> dict[str, Any]:
    """Chrome trace JSON: one complete event per box, one thread row per stage, microseconds from the first start."""
    t0 = min(e.start for e in events)
    return {
        "traceEvents": [
            {"name": f"{e.kind}{e.microbatch}", "cat": "forward" if e.kind == "F" else "backward", "ph": "X",
             "ts": (e.start - t0) * 1e6, "dur": (e.end - e.start) * 1e6, "pid": 0, "tid": e.stage}
            for e in events
        ],
        "displayTimeUnit": "ms",
    }


def to_svg(events: Sequence[Event], title: str = "pipeline step") -> str:
    """An SVG picture: stages top to bottom, time left to right, forward boxes blue, backward orange."""
    stages = 1 + max(e.stage for e in events)
    t0, t1 = min(e.start for e in events), max(e.end for e in events)
    width, left, row, top = 900.0, 70.0, 34.0, 40.0
    scale = (width - left - 10) / max(t1 - t0, 1e-9)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{top + stages * row + 30:.0f}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{left}" y="20" font-size="13">{escape(title)}; bubble {measured_bubble(events):.1%} measured, '
        f'{(t1 - t0) * 1e3:.1f} ms</text>',
    ]
    for s in range(stages):
        y = top + s * row
        parts.append(f'<text x="8" y="{y + row / 2 + 4:.1f}">stage {s}</text>')
        parts.append(f'<line x1="{left}" y1="{y + row - 2:.1f}" x2="{width - 10}" y2="{y + row - 2:.1f}" stroke="#ddd"/>')
    for e in events:
        x, w, y = left + (e.start - t0) * scale, max((e.end - e.start) * scale, 1.0), top + e.stage * row
        color = "#4c78a8" if e.kind == "F" else "#f58518"
        parts.append(f'<rect x="{x:.1f}" y="{y + 2:.1f}" width="{w:.1f}" height="{row - 6:.1f}" fill="{color}" '
                     f'stroke="white"><title>{e.kind}{e.microbatch} stage {e.stage}: {(e.end - e.start) * 1e3:.2f} ms</title></rect>')
        if w > 18:
            parts.append(f'<text x="{x + w / 2:.1f}" y="{y + row / 2 + 3:.1f}" fill="white" text-anchor="middle">'
                         f'{e.kind}{e.microbatch}</text>')
    parts.append(f'<text x="{left}" y="{top + stages * row + 18:.0f}" fill="#555">time (wall clock) →; '
                 'blue: forward, orange: backward</text>')
    parts.append("</svg>")
    return "\n".join(parts)
