import pytest
import torch
from memory_toy_model import ToyStaged, reference_weights
from safetensors import safe_open
from safetensors.torch import save_file

from engine.memory.ledger import BudgetExceeded, DeviceLedger
from engine.memory.segments import SegmentRunner, plan_segments
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


def test_plan_cuts_at_stage_boundaries_and_merges_neighbours_while_they_fit():
    stages, weights = toy_stages(8)
    for budget in (BLOCK_BYTES + WORKSPACE, TIGHT, 3 * BLOCK_BYTES + WORKSPACE, 7 * BLOCK_BYTES + WORKSPACE):
        plan = plan_segments(stages, weights, WORKSPACE, budget)
        assert not plan.whole
        bounds = [(s.start, s.stop) for s in plan.segments]
        assert bounds[0][0] == 0 and bounds[-1][1] == 8
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
        blocks = [s.stop - s.start for s in plan.segments]
        assert all(n * BLOCK_BYTES + WORKSPACE <= budget for n in blocks)
        # no two neighbours could have been merged
        assert all(
            (a + b) * BLOCK_BYTES + WORKSPACE > budget for a, b in zip(blocks, blocks[1:], strict=False)
        )


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
    assert segments == (4 if budget == TIGHT else 1)
    assert ledger.peak_tracked <= budget
    assert len(events.of_kind("segment_start")) == len(events.of_kind("segment_end")) == 3 * segments
    assert all(p.is_meta for p in model.parameters()) == (home != "device")


def test_tracked_peak_never_exceeds_the_budget_at_any_event():
    resident, weights = reference_weights(WIDTH, DEPTH)
    model, _, ledger, runner, events = build("cpu", TIGHT, None, weights)
    for _ in range(2):
        runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    totals = [e["tracked"] for e in events.of_kind("ledger")]
    assert max(totals) <= TIGHT and max(totals) == ledger.peak_tracked
    assert ledger.tracked("diffusion", "workspace") == 0  # released at the end of each run


def test_plan_is_cached_per_input_shape():
    _, weights = reference_weights(WIDTH, DEPTH)
    model, _, _, runner, events = build("cpu", TIGHT, None, weights)
    for _ in range(3):
        runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    plans = events.of_kind("plan")
    assert [p["cached"] for p in plans] == [False, True, True]
    runner.run(model.stages(), {"x": torch.randn(2, WIDTH)})
    assert events.of_kind("plan")[-1]["cached"] is False


def test_second_run_evicts_from_the_last_segment_backward():
    _, weights = reference_weights(WIDTH, DEPTH)
    model, _, _, runner, events = build("cpu", TIGHT, None, weights)
    runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    first_run = len(events.of_kind("eviction"))
    runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    second_run = events.of_kind("eviction")[first_run:]
    assert second_run[0]["segment"] == 3 and second_run[0]["reason"] == "last_segment"


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
    assert [s["state"] for s in snapshot["segments"]] == ["evicted"] * 3 + ["resident"]
    assert [s["stages"] for s in snapshot["segments"]] == [(0, 2), (2, 4), (4, 6), (6, 8)]


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
