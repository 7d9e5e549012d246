"""The SVG of throughput against the settings tried: valid XML, one mark per trial, heights to scale."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from lightning_accel.prefetch import LoaderSettings, Trial
from lightning_accel.prefetch.plot import trials_svg

SVG = "{http://www.w3.org/2000/svg}"


def marks(svg: str) -> list[ET.Element]:
    root = ET.fromstring(svg)  # raises on anything that is not well-formed XML
    assert root.tag == f"{SVG}svg"
    return root.findall(f".//{SVG}circle")


def test_one_mark_per_trial_in_order_at_its_throughput():
    tried = [LoaderSettings(0), LoaderSettings(2, 2), LoaderSettings(4, 2), LoaderSettings(8, 2), LoaderSettings(6, 2)]
    intervals = [0.5, 0.25, 0.125, 0.0625, 0.1]
    trials = [Trial(s, i, max(0.0, i - 0.1)) for s, i in zip(tried, intervals)]
    circles = marks(trials_svg(trials, chosen=LoaderSettings(8, 2)))
    assert [c.get("data-settings") for c in circles] == [s.label() for s in tried]
    assert [float(c.get("data-batches-per-s")) for c in circles] == pytest.approx([2, 4, 8, 16, 10])
    xs = [float(c.get("cx")) for c in circles]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)  # left to right in the order tried
    # Heights to scale: distance above the x axis is proportional to batches/s.
    axis = max(float(line.get("y1")) for line in ET.fromstring(trials_svg(trials)).iter(f"{SVG}line"))
    heights = [axis - float(c.get("cy")) for c in circles]
    assert [h / heights[0] for h in heights] == pytest.approx([1, 2, 4, 8, 5], rel=0.02)
    assert [c.get("fill") != "white" for c in circles] == [False, False, False, True, False]


def test_no_trials_is_still_a_valid_empty_plot():
    assert marks(trials_svg([])) == []


def test_labels_are_escaped():
    svg = trials_svg([Trial(LoaderSettings(0), 0.1, 0.1)], title="a < b & c")
    assert len(marks(svg)) == 1 and "a &lt; b &amp; c" in svg
