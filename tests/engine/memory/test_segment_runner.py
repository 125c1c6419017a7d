from types import SimpleNamespace

import pytest
import torch
from memory_toy_model import ToyStaged, reference_weights
from safetensors import safe_open
from safetensors.torch import save_file

from engine.memory import copy_flags
from engine.memory.copy_flags import CopyFlags
from engine.memory.ledger import BudgetExceeded, DeviceLedger
from engine.memory.segment_plan import STREAMED_TIME_SHARE
from engine.memory.segments import GRAPH_KEY, POOL_GRAIN, POOL_REPLANS, SegmentRunner, plan_segments
from engine.memory.stream_ring import StreamRing
from engine.memory.weight_store import WeightStore
from engine.telemetry import EventBus, EventRecorder

WIDTH, DEPTH = 64, 8
BLOCK_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # one Linear's weight and bias, f32
STATE_BYTES = 4 * WIDTH * 4  # x: (4, 64) f32
WORKSPACE = 2 * STATE_BYTES  # the runner's CPU estimate: twice the largest state tensor
TIGHT = 2 * BLOCK_BYTES + WORKSPACE + 100  # room for two blocks at a time: four segments


def toy_stages(depth=3):
    stages = ToyStaged(WIDTH, depth).stages()
    weights = [
        {f"m/blocks.{i}.weight": WIDTH * WIDTH * 4, f"m/blocks.{i}.bias": WIDTH * 4} for i in range(depth)
    ]
    return stages, weights


def test_plan_is_one_segment_when_the_module_fits():
    stages, weights = toy_stages(8)
    plan = plan_segments(stages, weights, WORKSPACE, 8 * BLOCK_BYTES + WORKSPACE)
    assert plan.whole and [(s.start, s.stop) for s in plan.segments] == [(0, 8)]


def check_plan(plan, budget, workspace=WORKSPACE):
    bounds = [(s.start, s.stop) for s in plan.segments]
    assert bounds[0][0] == 0 and bounds[-1][1] == 8
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert plan.resident_bytes + plan.ring_bytes + workspace <= budget
    streamed = [s for s in plan.segments if s.streamed]
    for segment in streamed:  # inside the ring, and never over a segment that may still be computing
        assert 0 <= segment.ring_offset and segment.ring_offset + segment.ring_bytes <= plan.ring_bytes
        earlier = [s for s in streamed if s.index < segment.index]
        overlapping = {
            s.index for s in earlier
            if s.ring_offset < segment.ring_offset + segment.ring_bytes
            and segment.ring_offset < s.ring_offset + s.ring_bytes
        }
        assert set(segment.waits) <= {s.index for s in earlier} and overlapping <= set(segment.waits) | {
            s.index for s in earlier if any(s.index < w for w in segment.waits)
        }
    return streamed


def test_plan_streams_what_does_not_fit_and_keeps_the_rest_resident():
    stages, weights = toy_stages(8)
    total = 8 * BLOCK_BYTES
    for budget in (BLOCK_BYTES + WORKSPACE, TIGHT, 3 * BLOCK_BYTES + WORKSPACE, 7 * BLOCK_BYTES + WORKSPACE):
        plan = plan_segments(stages, weights, WORKSPACE, budget)
        assert not plan.whole
        streamed = check_plan(plan, budget)
        streamed_bytes = sum(s.weight_bytes for s in streamed)
        assert streamed_bytes == total - plan.resident_bytes
        # the least any plan can stream is what does not fit; the ring is the price of streaming
        must = total + WORKSPACE - budget
        assert must <= streamed_bytes < must + plan.ring_bytes + BLOCK_BYTES  # less than a stage unfilled


def test_with_room_for_two_stages_the_next_copy_overlaps_the_current_compute():
    stages, weights = toy_stages(8)
    plan = plan_segments(stages, weights, WORKSPACE, TIGHT)
    streamed = check_plan(plan, TIGHT)
    assert plan.ring_bytes >= 2 * BLOCK_BYTES
    for previous, segment in zip(streamed, streamed[1:], strict=False):
        assert previous.index not in segment.waits  # its copy may run while the previous one computes
    serial = plan_segments(stages, weights, WORKSPACE, TIGHT, overlap=False)
    streamed = check_plan(serial, TIGHT)
    pairs = zip(streamed, streamed[1:], strict=False)
    assert all(previous.index in segment.waits for previous, segment in pairs)


def test_streamed_stages_follow_compute_time():
    stages, weights = toy_stages(8)
    budget = 5 * BLOCK_BYTES + WORKSPACE  # three blocks resident beside a two-block ring
    early = plan_segments(stages, weights, WORKSPACE, budget, stage_seconds=[8, 8, 8, 8, 1, 1, 1, 1])
    late = plan_segments(stages, weights, WORKSPACE, budget, stage_seconds=[1, 1, 1, 1, 8, 8, 8, 8])

    def streamed_stages(plan):
        return [i for s in plan.segments if s.streamed for i in range(s.start, s.stop)]

    assert len(streamed_stages(early)) == len(streamed_stages(late)) == 5
    assert sum(streamed_stages(early)) < sum(streamed_stages(late))
    assert streamed_stages(early)[0] < streamed_stages(late)[0]


def test_streamed_segments_compute_for_at_most_their_share_of_the_call():
    depth = 400
    stages, weights = toy_stages(depth)
    weights = [{k: n // 16 for k, n in w.items()} for w in weights]  # tiny stages: byte chunks hold many
    budget = depth * BLOCK_BYTES // 32 + WORKSPACE  # about half the weights stream
    seconds = [1.0] * depth
    timed = plan_segments(stages, weights, WORKSPACE, budget, stage_seconds=seconds)
    untimed = plan_segments(stages, weights, WORKSPACE, budget)
    share = sum(seconds) / STREAMED_TIME_SHARE
    assert all(sum(seconds[s.start : s.stop]) <= share for s in timed.segments if s.streamed)
    assert max(s.stop - s.start for s in untimed.segments if s.streamed) > share  # the cut mattered
    for plan in (timed, untimed):
        assert sum(s.ring_bytes for s in plan.segments if s.streamed) >= depth * BLOCK_BYTES // 16 - budget


def test_resident_weights_cost_nothing_in_a_plan():
    stages, weights = toy_stages(4)
    resident = [k for w in weights[:3] for k in w]
    plan = plan_segments(stages, weights, WORKSPACE, BLOCK_BYTES + WORKSPACE, resident)
    assert plan.whole


def test_a_stage_that_cannot_fit_alone_names_the_stage_and_sizes():
    stages, weights = toy_stages(3)
    with pytest.raises(
        BudgetExceeded, match=rf"stage 'blocks.0' \(index 0\).*{BLOCK_BYTES} bytes of weights"
    ):
        plan_segments(stages, weights, WORKSPACE, BLOCK_BYTES)


def build(home, budget, tmp_path, weights):
    bus = EventBus()
    events = EventRecorder(bus)
    ledger = DeviceLedger("cpu", budget, bus=bus)
    store = WeightStore(ledger, bus=bus)
    model = ToyStaged(WIDTH, DEPTH)
    if home == "disk":
        path = tmp_path / "toy.safetensors"
        save_file(weights, str(path))
        source = safe_open(str(path), framework="pt").get_tensor
    else:
        source = weights.__getitem__
    store.register_model("diffusion", model, home, "cpu", source)
    return model, store, ledger, SegmentRunner(store, ledger, "cpu", bus=bus), events


# device-home weights must all fit, so that home runs with a roomy budget only
@pytest.mark.parametrize(
    ("home", "budget"), [("device", 10**6), ("cpu", 10**6), ("cpu", TIGHT), ("disk", 10**6), ("disk", TIGHT)]
)
def test_segmented_run_is_bit_identical_to_the_resident_model(home, budget, tmp_path):
    resident, weights = reference_weights(WIDTH, DEPTH)
    model, store, ledger, runner, events = build(home, budget, tmp_path, weights)
    x = torch.randn(4, WIDTH)
    expected = resident(x)
    for _ in range(3):
        got = runner.run(model.stages(), {"x": x})["x"]
        assert torch.equal(got, expected)
    segments = len(runner.plan.segments)
    assert (segments > 1) == (budget == TIGHT)
    assert ledger.peak_tracked <= budget
    assert len(events.of_kind("segment_start")) == len(events.of_kind("segment_end")) == 3 * segments
    # at rest a parameter is a meta placeholder or a resident copy of the checkpoint's tensor
    for name, parameter in model.named_parameters():
        assert parameter.is_meta or torch.equal(parameter, weights[name])
    assert any(p.is_meta for p in model.parameters()) == (budget == TIGHT)


def test_tracked_peak_never_exceeds_the_budget_at_any_event():
    resident, weights = reference_weights(WIDTH, DEPTH)
    model, _, ledger, runner, events = build("cpu", TIGHT, None, weights)
    for _ in range(2):
        runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    totals = [e["tracked"] for e in events.of_kind("ledger")]
    assert max(totals) <= TIGHT and max(totals) == ledger.peak_tracked
    # the compute workspace is released after each run; the stream ring stays, idle and reclaimable
    assert ledger.tracked("diffusion", "workspace") == runner.plan.ring_bytes
    assert ledger.idle_workspaces() == [("diffusion", "stream_ring", runner.plan.ring_bytes)]


def test_plan_is_cached_per_input_shape():
    _, weights = reference_weights(WIDTH, DEPTH)
    model, _, _, runner, events = build("cpu", TIGHT, None, weights)
    for _ in range(3):
        runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    plans = events.of_kind("plan")
    assert [p["cached"] for p in plans] == [False, False]  # the second is made with the measured stage times
    assert runner.plan is runner._plans[max(runner._plans, key=lambda k: k[-1])]  # made with the times
    runner.run(model.stages(), {"x": torch.randn(2, WIDTH)})
    assert events.of_kind("plan")[-1]["cached"] is False


def test_the_first_call_of_a_shape_leaves_a_profile_of_every_stage():
    _, weights = reference_weights(WIDTH, DEPTH)
    model, _, _, runner, _ = build("cpu", TIGHT, None, weights)
    assert runner.profile is None
    runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    profile = runner.profile
    assert len(profile.seconds) == len(profile.workspace) == DEPTH
    assert all(t > 0 for t in profile.seconds) and all(n >= STATE_BYTES for n in profile.workspace)


def test_later_runs_copy_only_the_streamed_segments():
    _, weights = reference_weights(WIDTH, DEPTH)
    model, store, _, runner, events = build("cpu", 4 * BLOCK_BYTES + WORKSPACE, None, weights)
    for _ in range(3):
        runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    first, evictions = len(events.of_kind("transfer")), len(events.of_kind("eviction"))
    runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    copies = events.of_kind("transfer")[first:]
    streamed = [s for s in runner.plan.segments if s.streamed]
    resident = [s for s in runner.plan.segments if not s.streamed]
    assert streamed and resident
    assert [c["key"] for c in copies] == [f"segment {s.index}" for s in streamed]
    assert sum(c["bytes"] for c in copies) == sum(s.weight_bytes for s in streamed)
    assert all(store.is_resident(k) for s in resident for k in s.keys)
    assert len(events.of_kind("eviction")) == evictions


def test_disk_home_rereads_streamed_weights_on_every_run(tmp_path):
    resident, weights = reference_weights(WIDTH, DEPTH)
    model, _, _, runner, events = build("disk", TIGHT, tmp_path, weights)
    x = torch.randn(4, WIDTH)
    for run in range(1, 3):
        assert torch.equal(runner.run(model.stages(), {"x": x})["x"], resident(x))
        streamed = sum(s.stop - s.start for s in runner.plan.segments if s.streamed)
        reads = [e for e in events.of_kind("transfer") if e["direction"] == "disk2h"]
        assert len(reads) >= run * 2 * streamed


def test_runs_without_prefetch_are_bit_identical_and_within_budget():
    resident, weights = reference_weights(WIDTH, DEPTH)
    model, store, ledger, _, _ = build("cpu", TIGHT, None, weights)
    runner = SegmentRunner(store, ledger, "cpu", prefetch=False, bus=EventBus())
    x = torch.randn(4, WIDTH)
    for _ in range(2):
        assert torch.equal(runner.run(model.stages(), {"x": x})["x"], resident(x))
    assert ledger.peak_tracked <= TIGHT


def test_fitting_module_keeps_its_weights_resident_across_runs():
    _, weights = reference_weights(WIDTH, DEPTH)
    model, _, ledger, runner, events = build("cpu", 10**6, None, weights)
    for _ in range(3):
        runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    assert len(events.of_kind("transfer")) == 2 * DEPTH  # copied once
    assert events.of_kind("eviction") == []
    assert ledger.tracked("diffusion", "weights") == DEPTH * BLOCK_BYTES
    assert [s["state"] for s in runner.snapshot()["segments"]] == ["resident"]


def test_snapshot_shows_evicted_and_resident_segments():
    _, weights = reference_weights(WIDTH, DEPTH)
    model, _, _, runner, _ = build("cpu", TIGHT, None, weights)
    runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    snapshot = runner.snapshot()
    assert snapshot["module"] == "diffusion" and snapshot["whole"] is False
    states = {s["state"] for s in snapshot["segments"]}
    assert states <= {"evicted", "resident"} and "evicted" in states
    for row, segment in zip(snapshot["segments"], runner.plan.segments, strict=True):
        assert row["stages"] == (segment.start, segment.stop) and row["streamed"] == segment.streamed
        assert row["state"] == ("evicted" if segment.streamed else "resident")


def test_disabled_segmentation_fails_clearly_when_the_module_does_not_fit():
    _, weights = reference_weights(WIDTH, DEPTH)
    model, store, ledger, _, _ = build("cpu", TIGHT, None, weights)
    runner = SegmentRunner(store, ledger, "cpu", segmented=False, bus=EventBus())
    with pytest.raises(BudgetExceeded):
        runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    assert ledger.tracked("diffusion", "workspace") == 0
    assert all(p.is_meta for p in model.parameters())


def test_a_failing_stage_leaves_nothing_pinned_or_bound():
    _, weights = reference_weights(WIDTH, DEPTH)
    model, store, ledger, runner, _ = build("cpu", TIGHT, None, weights)
    with pytest.raises(RuntimeError):
        runner.run(model.stages(), {"x": torch.randn(4, WIDTH + 1)})
    assert all(p.is_meta for p in model.parameters())
    assert store.evict_until_fits(TIGHT, "cpu") > 0 and ledger.tracked() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the prefetch path needs CUDA")
@pytest.mark.parametrize("home", ["cpu", "disk"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_cuda_prefetching_run_is_bit_identical_within_budget(home, prefetch, tmp_path):
    resident, weights = reference_weights(256, DEPTH)
    expected_model = resident.cuda()
    x = torch.randn(16, 256, device="cuda")
    expected = expected_model(x)
    bus = EventBus()
    budget = 4 * (256 * 256 + 256) * 4 + 4 * 16 * 256 * 4
    ledger = DeviceLedger("cuda0", budget, bus=bus)
    store = WeightStore(ledger, bus=bus)
    model = ToyStaged(256, DEPTH)
    save_file(weights, str(tmp_path / "toy.safetensors"))
    reader = safe_open(str(tmp_path / "toy.safetensors"), framework="pt")
    source = reader.get_tensor if home == "disk" else weights.__getitem__
    store.register_model("diffusion", model, home, "cuda:0", source)
    runner = SegmentRunner(store, ledger, "cuda:0", prefetch=prefetch, bus=bus)
    for _ in range(3):
        assert torch.equal(runner.run(model.stages(), {"x": x})["x"], expected)
    assert len(runner.plan.segments) > 1 and ledger.peak_tracked <= budget
    assert any(s.streamed for s in runner.plan.segments)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("budget", [None, 4 * (256 * 256 + 256) * 4 + 4 * 16 * 256 * 4])
def test_cuda_graph_replays_are_bit_identical_and_follow_changes(budget):
    polls = budget is not None and CopyFlags.available(torch.device("cuda"), wait=True)  # compiled first:
    # on a machine whose Triton cache is empty, compiling the poll kernel outlasts the calls below
    resident, weights = reference_weights(256, DEPTH)
    reference = resident.cuda()
    bus = EventBus()
    events = EventRecorder(bus)
    ledger = DeviceLedger("cuda0", budget if budget is not None else 1 << 40, bus=bus)
    store = WeightStore(ledger, bus=bus)
    model = ToyStaged(256, DEPTH)
    store.register_model("diffusion", model, "cpu", "cuda:0", weights.__getitem__)
    runner = SegmentRunner(store, ledger, "cuda:0", bus=bus, graphs=True)
    for batch in (16, 16, 16, 16, 16, 8, 8, 8, 8):
        x = torch.randn(batch, 256, device="cuda")
        assert torch.equal(runner.run(model.stages(), {"x": x})["x"], reference(x))
    assert runner._graph is not None
    assert runner._graph.key[0] == (("x", (((8, 256), "torch.float32", "cuda:0"),)),)
    assert (runner._graph.flags is not None) == polls  # compute polls flags where it can, else events
    streamed = [s for s in runner.plan.segments if s.streamed]
    replayed = [e for e in events.of_kind("transfer") if e["stream"] == "graph"]
    assert bool(streamed) == (budget is not None) and bool(replayed) == bool(streamed)
    store.release_module("diffusion")  # residency changes: the next call runs eagerly, still exact
    x = torch.randn(8, 256, device="cuda")
    assert torch.equal(runner.run(model.stages(), {"x": x})["x"], reference(x))
    assert ledger.peak_tracked <= ledger.budget_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("polling", [False, True])
def test_cuda_graph_replays_wait_for_slow_copies(polling, monkeypatch):
    if polling and not CopyFlags.available(torch.device("cuda"), wait=True):
        pytest.skip("polling needs a working Triton")
    monkeypatch.setattr(copy_flags, "ENABLED", polling)
    copy_runs = StreamRing._copy_runs

    def slow(ring, layout):  # each copy starts a few ms late on the copy stream, in replays too
        torch.cuda._sleep(5_000_000)
        copy_runs(ring, layout)

    monkeypatch.setattr(StreamRing, "_copy_runs", slow)
    resident, weights = reference_weights(256, DEPTH)
    reference = resident.cuda()
    ledger = DeviceLedger("cuda0", 4 * (256 * 256 + 256) * 4 + 4 * 16 * 256 * 4)
    store = WeightStore(ledger)
    model = ToyStaged(256, DEPTH)
    store.register_model("diffusion", model, "cpu", "cuda:0", weights.__getitem__)
    runner = SegmentRunner(store, ledger, "cuda:0", graphs=True)
    for _ in range(6):  # timing calls, the steady call, the capture, replays: a read before its copy differs
        x = torch.randn(16, 256, device="cuda")
        assert torch.equal(runner.run(model.stages(), {"x": x})["x"], reference(x))
    assert runner._graph is not None and (runner._graph.flags is not None) == polling


def test_plain_values_of_the_state_choose_their_own_plan():
    _, weights = reference_weights(WIDTH, DEPTH)
    model, _, _, runner, events = build("cpu", TIGHT, None, weights)
    x = torch.randn(4, WIDTH)
    for skip in (1, 1, 2):  # a different plain value (a clip skip, a flag) is a different call to plan for
        runner.run(model.stages(), {"x": x, "skip": skip})
    assert [p["cached"] for p in events.of_kind("plan")] == [False, False, False]


def test_an_unregistered_module_leaves_nothing_tracked_not_even_its_stream_ring():
    from engine.memory.runtime import MemoryRuntime

    bus = EventBus()
    ledger = DeviceLedger("cpu", TIGHT, bus=bus)
    runtime = MemoryRuntime(bus=bus, ledgers={"cpu": ledger})
    _, weights = reference_weights(WIDTH, DEPTH)
    model = ToyStaged(WIDTH, DEPTH)
    name = runtime.register("diffusion", model, "cpu", "cpu", weights.__getitem__)
    for _ in range(2):
        runtime.run(name, model, model.stages(), {"x": torch.randn(4, WIDTH)})
    assert ledger.tracked("diffusion", "workspace") > 0  # the idle stream ring
    runtime.unregister(name)
    assert ledger.tracked() == 0


def test_below_room_for_two_large_stages_the_small_ones_still_overlap():
    # one block four times the others: room for it plus a little, not for two of it
    stages, weights = toy_stages(8)
    weights[3] = {"m/blocks.3.weight": 4 * BLOCK_BYTES - WIDTH * 4, "m/blocks.3.bias": WIDTH * 4}
    budget = 5 * BLOCK_BYTES + WORKSPACE
    plan = plan_segments(stages, weights, WORKSPACE, budget)
    streamed = check_plan(plan, budget)
    big = next(s for s in streamed if s.start <= 3 < s.stop)
    assert big.stop - big.start == 1  # streams alone
    small_pairs = [(a, b) for a, b in zip(streamed, streamed[1:], strict=False) if big not in (a, b)]
    assert small_pairs and all(a.index not in b.waits for a, b in small_pairs)


def test_with_a_copy_rate_a_large_stage_stays_resident_so_the_ring_can_shrink():
    # one block four times the others (11 blocks in all): the default ring holds two of it, 8 blocks of the
    # 10.5 of room, so 2 whole blocks stay resident and 9 stream each call; keeping the large one resident
    # lets a ring of two small blocks do: 4 small blocks stay resident beside it and 3 stream
    stages, weights = toy_stages(8)
    weights[3] = {"m/blocks.3.weight": 4 * BLOCK_BYTES - WIDTH * 4, "m/blocks.3.bias": WIDTH * 4}
    budget = 21 * BLOCK_BYTES // 2 + WORKSPACE
    seconds = [1e-3] * 8
    bandwidth = BLOCK_BYTES / 1e-3  # a block's copy takes as long as a stage's compute: copies dominate
    default = plan_segments(stages, weights, WORKSPACE, budget, stage_seconds=seconds)
    chosen = plan_segments(stages, weights, WORKSPACE, budget, stage_seconds=seconds, bandwidth=bandwidth)
    assert default.ring_bytes == 8 * BLOCK_BYTES and chosen.ring_bytes == 2 * BLOCK_BYTES
    check_plan(chosen, budget)
    assert not next(s for s in chosen.segments if s.start <= 3 < s.stop).streamed
    streamed = [sum(s.ring_bytes for s in plan.segments if s.streamed) for plan in (default, chosen)]
    assert streamed == [9 * BLOCK_BYTES, 3 * BLOCK_BYTES]


def test_where_compute_hides_every_copy_the_plan_streaming_the_fewest_bytes_wins():
    # the toy above with copies a thousand times faster: every ring is modelled at the compute time, and the
    # default ring would stream 9 blocks where keeping the large stage resident streams 3
    stages, weights = toy_stages(8)
    weights[3] = {"m/blocks.3.weight": 4 * BLOCK_BYTES - WIDTH * 4, "m/blocks.3.bias": WIDTH * 4}
    budget = 21 * BLOCK_BYTES // 2 + WORKSPACE
    chosen = plan_segments(stages, weights, WORKSPACE, budget, stage_seconds=[1e-3] * 8,
                           bandwidth=1000 * BLOCK_BYTES / 1e-3)
    check_plan(chosen, budget)
    assert sum(s.ring_bytes for s in chosen.segments if s.streamed) == 3 * BLOCK_BYTES


def test_where_compute_hides_the_copies_streamed_runs_are_not_cut_by_compute_time():
    # a first stage of 8 blocks, then 7 of one: the room of 10 blocks is all ring, so every stage streams, the
    # small ones in chunks of up to 5 blocks. Each stage computes 1/8 of the call, more than
    # 1/STREAMED_TIME_SHARE: by default every small stage is a segment of its own. Each streamed segment costs
    # the compute stream SEGMENT_GAP, so with copies that compute hides, the chosen plan has fewer
    stages, weights = toy_stages(8)
    weights[0] = {"m/blocks.0.weight": 8 * BLOCK_BYTES - WIDTH * 4, "m/blocks.0.bias": WIDTH * 4}
    budget = 10 * BLOCK_BYTES + WORKSPACE
    seconds = [1e-3] * 8
    default = plan_segments(stages, weights, WORKSPACE, budget, stage_seconds=seconds)
    chosen = plan_segments(stages, weights, WORKSPACE, budget, stage_seconds=seconds,
                           bandwidth=1000 * BLOCK_BYTES / 1e-3)
    check_plan(chosen, budget)
    streamed = [[s for s in plan.segments if s.streamed] for plan in (default, chosen)]
    assert all(s.stop - s.start == 1 for s in streamed[0])
    assert len(streamed[1]) < len(streamed[0])
    # where the copies take longer than the compute, each segment's wait costs less than what a coarser cut
    # delays: the cut by compute time stays
    bound = plan_segments(stages, weights, WORKSPACE, budget, stage_seconds=seconds,
                          bandwidth=BLOCK_BYTES / 1e-3)
    assert [(s.start, s.stop) for s in bound.segments] == [(s.start, s.stop) for s in default.segments]


def test_every_cut_by_compute_time_is_modelled_and_the_fastest_taken(monkeypatch):
    # copies far slower than compute: all cuts are still modelled (a finer one wins where segments cost
    # little), and the plan taken is modelled within TIE of the fastest of them
    from engine.memory import segment_plan, stream_model

    caps, modelled = [], []
    segments, step = segment_plan._segments, stream_model.step_seconds

    def spy_segments(*args):
        caps.append(args[-1])
        return segments(*args)

    def spy_step(plan, *args):
        modelled.append((plan, step(plan, *args)))
        return modelled[-1][1]

    monkeypatch.setattr(segment_plan, "_segments", spy_segments)
    monkeypatch.setattr(stream_model, "step_seconds", spy_step)
    stages, weights = toy_stages(8)
    seconds = [1e-3] * 8
    chosen = plan_segments(stages, weights, WORKSPACE, 3 * BLOCK_BYTES + WORKSPACE, stage_seconds=seconds,
                           bandwidth=BLOCK_BYTES / 1e-2)
    shares = (segment_plan.STREAMED_TIME_SHARE, *segment_plan.OTHER_TIME_SHARES)
    assert sorted(set(caps)) == sorted({sum(seconds) / share if share else 0.0 for share in shares})
    fastest = min(seconds for _, seconds in modelled)
    assert dict((id(p), t) for p, t in modelled)[id(chosen)] <= fastest * segment_plan.TIE


def test_when_little_must_stream_only_small_stages_stream_through_a_small_ring():
    # three stages of 8 KiB and five of 512 bytes, and room for all but 64 bytes: the default ring holds two
    # of the large stages, whose 16 KiB then stream on every call; two of a small stage do as well, the
    # large ones kept resident, and only about a kilobyte streams
    stages, _ = toy_stages(8)
    sizes = [8192, 512, 8192, 512, 8192, 512, 512, 512]
    weights = [{f"m/blocks.{i}.weight": size} for i, size in enumerate(sizes)]
    budget = sum(sizes) - 64 + WORKSPACE
    seconds = [1e-3] * 8
    default = plan_segments(stages, weights, WORKSPACE, budget, stage_seconds=seconds)
    chosen = plan_segments(stages, weights, WORKSPACE, budget, stage_seconds=seconds,
                           bandwidth=1000 * BLOCK_BYTES / 1e-3)
    check_plan(chosen, budget)
    streamed = [sum(s.ring_bytes for s in plan.segments if s.streamed) for plan in (default, chosen)]
    assert streamed[0] >= 16384 and streamed[1] <= 1536
    assert all(sizes[s.start] == 512 for s in chosen.segments if s.streamed)


def test_without_stage_times_a_copy_rate_changes_nothing():
    stages, weights = toy_stages(8)
    weights[3] = {"m/blocks.3.weight": 4 * BLOCK_BYTES - WIDTH * 4, "m/blocks.3.bias": WIDTH * 4}
    budget = 21 * BLOCK_BYTES // 2 + WORKSPACE
    assert plan_segments(stages, weights, WORKSPACE, budget, bandwidth=1e9) == plan_segments(
        stages, weights, WORKSPACE, budget)


@pytest.mark.parametrize(("graphs", "polling", "rate", "gap"), [
    (False, True, 100.0, "SEGMENT_GAP"),  # eager calls: the probe's rate
    (True, False, 91.0, "SEGMENT_GAP"),  # replays waiting for events: slower copies
    (True, True, 100.0, "POLLED_SEGMENT_GAP"),  # replays polling flags: full rate, a shorter wait
])
def test_calls_are_modelled_with_the_rates_of_how_they_wait(graphs, polling, rate, gap, monkeypatch):
    from engine.memory import stream_model

    monkeypatch.setattr(stream_model, "copy_bandwidth", lambda device: 100.0)
    monkeypatch.setattr(stream_model, "GRAPH_COPY_SHARE", 0.91)
    monkeypatch.setattr(CopyFlags, "ready", staticmethod(lambda device: polling))
    assert stream_model.call_rates(torch.device("cuda", 0), graphs) == pytest.approx(
        (rate, getattr(stream_model, gap)))


def test_the_runner_plans_with_the_rates_of_its_calls(monkeypatch):
    from engine.memory import segments, stream_model

    seen = []

    def recording(*args, bandwidth=None, segment_gap=None, **kwargs):
        seen.append((bandwidth, segment_gap))
        return plan_segments(*args, bandwidth=bandwidth, segment_gap=segment_gap, **kwargs)

    monkeypatch.setattr(stream_model, "call_rates", lambda device, graphs: (123.0, 7e-6))
    monkeypatch.setattr(segments, "plan_segments", recording)
    _, weights = reference_weights(WIDTH, DEPTH)
    model, store, ledger, _, _ = build("cpu", TIGHT, None, weights)
    runner = SegmentRunner(store, ledger, "cpu")
    for _ in range(2):  # the first call measures the stage times, the second plans with them
        runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    assert seen[0][0] is None and seen[-1] == (123.0, 7e-6)


def test_a_graph_pool_the_budget_has_room_for_is_tracked_whole(tmp_path):
    _, weights = reference_weights(WIDTH, DEPTH)
    _, _, ledger, runner, _ = build("cpu", 10**6, tmp_path, weights)
    runner.module = "diffusion"
    plan = SimpleNamespace(workspace_bytes=1000)
    assert runner._measure_pool(("x",), plan, 500) == 1000  # less than the plan's: the plan's
    assert runner._measure_pool(("x",), plan, 3000) == 3000
    assert ledger.workspace("diffusion", GRAPH_KEY) == 3000 and not runner._pool_excess


def test_a_graph_pool_over_the_budget_makes_the_next_plans_leave_room_a_bounded_number_of_times(tmp_path):
    _, weights = reference_weights(WIDTH, DEPTH)
    _, _, ledger, runner, _ = build("cpu", 10**6, tmp_path, weights)
    runner.module = "diffusion"
    plan = SimpleNamespace(workspace_bytes=1000)
    over = ledger.available() + 3 * POOL_GRAIN + 1
    for _ in range(POOL_REPLANS + 2):  # tracks the plan's workspace, never more than the budget allows
        assert runner._measure_pool(("x",), plan, over) == 1000
    grains = -(-(over - 1000) // POOL_GRAIN)
    assert runner._pool_excess[("x",)] == POOL_REPLANS * grains * POOL_GRAIN
    assert ledger.tracked() <= ledger.budget_bytes
