import pytest

from lightning_accel.pipeline.schedule import bubble_fraction, gpipe_order, simulate
from lightning_accel.pipeline.timeline import Event, measured_bubble, stage_orders, to_chrome_trace, to_svg


def _unit_events(clocks):
    """Events of a simulated schedule where every action takes exactly one second."""
    return [Event(a.stage, a.kind, a.microbatch, float(k), float(k + 1)) for k, actions in enumerate(clocks) for a in actions]


@pytest.mark.parametrize(("m", "n"), [(1, 2), (4, 2), (8, 4)])
def test_measured_bubble_of_a_unit_time_fill_drain_is_the_closed_form(m, n):
    events = _unit_events(simulate(gpipe_order(m, n)))
    assert measured_bubble(events) == pytest.approx(bubble_fraction(m, n))


def test_stage_orders_sort_by_start():
    events = [Event(0, "B", 0, 2.0, 3.0), Event(0, "F", 0, 0.0, 1.0), Event(1, "F", 0, 1.0, 2.0)]
    assert stage_orders(events) == [["F0", "B0"], ["F0"]]


def test_chrome_trace_and_svg_have_one_box_per_event():
    events = _unit_events(simulate(gpipe_order(3, 2)))
    trace = to_chrome_trace(events)
    assert len(trace["traceEvents"]) == 12
    first = min(trace["traceEvents"], key=lambda e: e["ts"])
    assert first == {"name": "F0", "cat": "forward", "ph": "X", "ts": 0.0, "dur": 1e6, "pid": 0, "tid": 0}
    svg = to_svg(events, title="a <test>")
    assert svg.count("<rect") == 12 and "a &lt;test&gt;" in svg and "bubble 25.0% measured" in svg


def test_no_events_is_an_error():
    with pytest.raises(ValueError, match="no events recorded"):
        measured_bubble([])
