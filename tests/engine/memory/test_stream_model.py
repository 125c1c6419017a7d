"""The two-stream model and the floor of any plan, against schedules worked out by hand."""

import pytest

from engine.memory.segment_plan import Segment, SegmentPlan
from engine.memory.stream_model import COPY_GAP, SEGMENT_GAP, floor_seconds, step_seconds


def three_segments(waits):
    """Streamed (100 bytes), resident, streamed (200 bytes, overwriting `waits`)."""
    segments = (
        Segment(0, 0, 1, ("a",), 100, 100, streamed=True, ring_offset=0, ring_bytes=100),
        Segment(1, 1, 2, ("b",), 50, 50),
        Segment(2, 2, 3, ("c",), 200, 200, streamed=True, ring_offset=0, ring_bytes=200, waits=waits),
    )
    return SegmentPlan(segments, 0, 1000, False, ring_bytes=200)


def test_copies_queue_back_to_back_and_compute_waits_for_its_bytes():
    # g: COPY_GAP, s: SEGMENT_GAP. copy a: 0 -> 1 + g; copy c right after: -> 3 + 2g; compute a 1+g+s ->
    # 1.5+g+s, b -> 1.75+g+s, c waits for its bytes: 3+2g+s -> 4+2g+s
    plan = three_segments(())
    expected = 4 + 2 * COPY_GAP + SEGMENT_GAP
    assert step_seconds(plan, [0.5, 0.25, 1.0], bandwidth=100.0) == pytest.approx(expected)


def test_a_copy_waits_for_the_compute_of_the_segment_it_overwrites():
    # copy c starts once segment a computed (1.5 + g + s) -> 3.5 + 2g + s; compute c -> 4.5 + 2g + 2s
    plan = three_segments((0,))
    assert step_seconds(plan, [0.5, 0.25, 1.0], bandwidth=100.0) == pytest.approx(
        4.5 + 2 * COPY_GAP + 2 * SEGMENT_GAP)
    # with a per-segment cost of 0.1 (a slow wait): copy c -> 1.6 + g + 2 + g, compute c -> 4.7 + 2g
    assert step_seconds(plan, [0.5, 0.25, 1.0], bandwidth=100.0, segment_gap=0.1) == pytest.approx(
        4.7 + 2 * COPY_GAP)


def test_a_whole_plan_takes_its_compute_time():
    whole = SegmentPlan((Segment(0, 0, 3, ("a",), 10, 10),), 0, 1000, True)
    assert step_seconds(whole, [0.5, 0.25, 1.0], bandwidth=1.0) == pytest.approx(1.75)


def test_the_floor_is_the_compute_time_when_every_weight_fits():
    assert floor_seconds([1.0, 1.0], [10, 10], [0, 0], budget=100, bandwidth=10.0) == pytest.approx(2.0)


def test_the_floor_is_the_physical_line_when_weights_follow_compute():
    # 40 bytes, none can stay: 8 s of copies; no window of 1-3 stages needs more than 1 + 30 / 5 = 7 s
    assert floor_seconds([1.0] * 4, [10] * 4, [0] * 4, budget=0, bandwidth=5.0) == pytest.approx(8.0)


def test_weights_between_long_light_stages_raise_the_floor_above_the_physical_line():
    # the physical line: max(7 s of compute, (30 - 10) / 10) = 7 s. But at most 10 bytes of the middle
    # stage's 30 can be on the device before it starts: 20 arrive while it runs, 2 s instead of 1
    assert floor_seconds([3.0, 1.0, 3.0], [0, 30, 0], [0, 0, 0], budget=10, bandwidth=10.0) == \
        pytest.approx(3.0 + 2.0 + 3.0)


def test_a_workspace_peak_just_before_the_heavy_stage_leaves_less_room_to_prefetch():
    # without workspace: 10 bytes prefetched, 20 during the middle stage: 3.1 + 2 s. With 5 bytes of
    # workspace in the 0.1 s stage before it: at most 5 bytes on the device at its peak, 1 more copied
    # in its 0.1 s, so 24 arrive during the middle stage: 3 + 0.1 + 2.4 s
    times, sizes = [0.1, 1.0, 3.0], [0, 30, 0]
    assert floor_seconds(times, sizes, [0, 0, 0], budget=10, bandwidth=10.0) == pytest.approx(5.1)
    assert floor_seconds(times, sizes, [5, 0, 0], budget=10, bandwidth=10.0) == pytest.approx(5.5)


def test_the_floor_names_mismatched_stage_lists():
    with pytest.raises(ValueError, match="2 stage times but 3 byte counts and 2 workspace peaks"):
        floor_seconds([1.0, 1.0], [1, 2, 3], [0, 0], budget=10, bandwidth=1.0)


def test_no_plan_the_planner_makes_is_modelled_below_the_floor():
    # the floor bounds every plan; the planner's plans, modelled with the same copy rate, must not beat it
    import random
    from types import SimpleNamespace

    from engine.memory.ledger import BudgetExceeded
    from engine.memory.segment_plan import plan_segments

    draw = random.Random(7)
    checked = 0
    for case in range(300):
        count = draw.randint(3, 12)
        sizes = [draw.choice([0, 256, 1024, 4096, 16384]) for _ in range(count)]
        seconds = [draw.uniform(1e-4, 1e-3) for _ in range(count)]
        workspace = draw.choice([0, 512, 2048])
        if sum(sizes) <= 2 * max(sizes):
            continue
        budget = workspace + draw.randint(max(sizes) * 2, sum(sizes))  # some weights must stream
        bandwidth = draw.choice([1e6, 1e7, 1e8])
        stages = [SimpleNamespace(name=f"s{i}") for i in range(count)]
        weights = [{f"w{i}": size} if size else {} for i, size in enumerate(sizes)]
        try:
            plan = plan_segments(stages, weights, workspace, budget, stage_seconds=seconds,
                                 bandwidth=bandwidth)
        except BudgetExceeded:
            continue
        floor = floor_seconds(seconds, sizes, [workspace] * count, budget, bandwidth)
        assert step_seconds(plan, seconds, bandwidth) >= floor * (1 - 1e-9), case
        checked += 1
    assert checked > 150
