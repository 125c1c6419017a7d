"""The two-stream model against schedules worked out by hand."""

import pytest

from engine.memory.segment_plan import Segment, SegmentPlan
from engine.memory.stream_model import COPY_GAP, step_seconds


def three_segments(waits):
    """Streamed (100 bytes), resident, streamed (200 bytes, overwriting `waits`)."""
    segments = (
        Segment(0, 0, 1, ("a",), 100, 100, streamed=True, ring_offset=0, ring_bytes=100),
        Segment(1, 1, 2, ("b",), 50, 50),
        Segment(2, 2, 3, ("c",), 200, 200, streamed=True, ring_offset=0, ring_bytes=200, waits=waits),
    )
    return SegmentPlan(segments, 0, 1000, False, ring_bytes=200)


def test_copies_queue_back_to_back_and_compute_waits_for_its_bytes():
    # copy a: 0 -> 1 + g; copy c right after: -> 3 + 2g; compute a 1+g -> 1.5+g, b -> 1.75+g,
    # c waits for its bytes: 3+2g -> 4+2g
    plan = three_segments(())
    assert step_seconds(plan, [0.5, 0.25, 1.0], bandwidth=100.0) == pytest.approx(4 + 2 * COPY_GAP)


def test_a_copy_waits_for_the_compute_of_the_segment_it_overwrites():
    # copy c starts once segment a computed (1.5 + g) -> 3.5 + 2g; compute c -> 4.5 + 2g
    plan = three_segments((0,))
    assert step_seconds(plan, [0.5, 0.25, 1.0], bandwidth=100.0) == pytest.approx(4.5 + 2 * COPY_GAP)


def test_a_whole_plan_takes_its_compute_time():
    whole = SegmentPlan((Segment(0, 0, 3, ("a",), 10, 10),), 0, 1000, True)
    assert step_seconds(whole, [0.5, 0.25, 1.0], bandwidth=1.0) == pytest.approx(1.75)
