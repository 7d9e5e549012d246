"""Throughput against the loader settings a search tried, as a hand-written SVG (no plotting library).

One mark per trial, left to right in the order they were measured, at the height of
its throughput (batches per second the loader delivers); a line joins them, the
chosen one is filled, and each carries its settings as a label.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from xml.sax.saxutils import escape, quoteattr

from lightning_accel.prefetch.search import Trial
from lightning_accel.prefetch.settings import LoaderSettings

_W, _H = 640, 400
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 20, 40, 120  # margins: y labels left, settings labels below


def _nice_top(value: float) -> float:
    """The smallest of 1, 2, 5 x 10^k at or above ``value``: a round top for the y axis."""
    if value <= 0:
        return 1.0
    base = 10 ** math.floor(math.log10(value))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= value)


def trials_svg(trials: Sequence[Trial], chosen: LoaderSettings | None = None, title: str | None = None) -> str:
    """An SVG document: batches/s of each trial, in order; ``chosen`` is drawn filled."""
    rates = [1.0 / max(t.interval_s, 1e-9) for t in trials]
    top = _nice_top(1.1 * max(rates, default=1.0))
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM
    step = plot_w / max(1, len(trials))

    def x(i: int) -> float:
        return _LEFT + step * (i + 0.5)

    def y(rate: float) -> float:
        return _TOP + plot_h * (1 - min(rate, top) / top)

    title = title or "PrefetchTuner: loader throughput per setting tried"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{_W}" height="{_H}" fill="white"/>',
        f'<text x="{_W / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
        # axes
        f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_TOP + plot_h}" stroke="black"/>',
        f'<line x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{_LEFT + plot_w}" y2="{_TOP + plot_h}" stroke="black"/>',
        f'<text x="15" y="{_TOP + plot_h / 2}" text-anchor="middle" transform="rotate(-90 15 {_TOP + plot_h / 2})">'
        "batches/s</text>",
        f'<text x="{_LEFT + plot_w / 2}" y="{_H - 8}" text-anchor="middle">settings, in the order tried</text>',
    ]
    for k in range(5):  # y ticks
        value = top * k / 4
        out.append(f'<line x1="{_LEFT - 4}" y1="{y(value):.1f}" x2="{_LEFT}" y2="{y(value):.1f}" stroke="black"/>')
        out.append(f'<text x="{_LEFT - 6}" y="{y(value) + 4:.1f}" text-anchor="end">{value:g}</text>')
    if len(trials) > 1:
        points = " ".join(f"{x(i):.1f},{y(r):.1f}" for i, r in enumerate(rates))
        out.append(f'<polyline points="{points}" fill="none" stroke="#1f77b4"/>')
    for i, (trial, rate) in enumerate(zip(trials, rates)):
        fill = "#1f77b4" if trial.settings == chosen else "white"
        label = trial.settings.label()
        out.append(
            f'<circle class="trial" cx="{x(i):.1f}" cy="{y(rate):.1f}" r="5" fill="{fill}" stroke="#1f77b4" '
            f"data-batches-per-s={quoteattr(f'{rate:.4f}')} data-settings={quoteattr(label)}>"
            f"<title>{escape(label)}: {rate:.2f} batches/s</title></circle>"
        )
        out.append(f'<text x="{x(i):.1f}" y="{y(rate) - 9:.1f}" text-anchor="middle">{rate:.2f}</text>')
        ly = _TOP + plot_h + 12
        out.append(
            f'<text x="{x(i):.1f}" y="{ly}" text-anchor="end" transform="rotate(-35 {x(i):.1f} {ly})">{escape(label)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"
