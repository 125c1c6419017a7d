import threading
import time
from collections import defaultdict

import pytest
import torch
from memory_trace_source import DEPTHS, ToyBlocks, record_runtime_trace
from PySide6.QtGui import QFontMetricsF

from app import memory_panel
from app.memory_model import RUNS_KEPT, MemoryModel, TraceError, load_trace
from app.memory_panel import DevicePlot, MemoryPanel, SegmentBar, install_memory_views
from app.trace_replay import TraceReplay
from app.workflow_placement import ModuleSlot, WorkflowPlacement
from engine.memory.ledger import DeviceLedger
from engine.memory.segments import SegmentRunner
from engine.memory.weight_store import WeightStore
from engine.telemetry import Event, EventBus


@pytest.fixture(scope="module")
def runtime_trace(tmp_path_factory):
    """A trace recorded from the real weight store and segment runner, saved as JSON lines."""
    model = MemoryModel()
    record_runtime_trace(model)
    path = model.save_trace(tmp_path_factory.mktemp("trace") / "memory_trace.jsonl")
    return model, path


def until_last_diffusion_segment(events):
    last = max(i for i, e in enumerate(events) if e.kind == "segment_start" and e["module"] == "diffusion")
    return events[: last + 1]


def test_tracked_bytes_per_module_equal_the_sum_of_ledger_deltas(runtime_trace):
    _, path = runtime_trace
    events = [e for e in until_last_diffusion_segment(load_trace(path)) if e.kind != "ledger_snapshot"]
    model = MemoryModel()
    model.feed(events)
    expected = defaultdict(int)
    for event in events:
        if event.kind == "ledger":
            expected[(event["module"], event["allocation"])] += event["delta"]
    device = model.snapshot()["devices"]["cpu"]
    for (module, allocation), nbytes in expected.items():
        assert device["weights" if allocation == "weights" else "workspace"][module] == nbytes
    last_ledger = [e for e in events if e.kind == "ledger"][-1]
    assert device["tracked"] == last_ledger["tracked"]  # the ledger's own count
    assert device["series"]["used"][-1] == last_ledger["tracked"]


def test_final_state_matches_the_ledger_snapshot_and_the_runner_plan(runtime_trace):
    model, _ = runtime_trace
    snapshot = model.snapshot()
    device = snapshot["devices"]["cpu"]
    assert device["budget"] > 0 and device["tracked"] == 0  # every module released at the end
    assert device["free"] == device["budget"]
    assert set(device["series"]["weights"]) == set(DEPTHS)
    assert snapshot["plan"]["module"] == "vae" and snapshot["plan"]["whole"]
    assert snapshot["plan"]["segments"][0]["state"] == "evicted"  # release_module evicted its replicas


def test_segment_states_follow_the_runner_snapshot_at_every_segment_start(runtime_trace):
    model = MemoryModel()
    bus = EventBus()
    model.subscribe(bus)
    ledger = DeviceLedger("cpu", 4 * (256 * 256 + 256) * 4, bus=bus)
    store = WeightStore(ledger, bus=bus)
    runner = SegmentRunner(store, ledger, "cpu", bus=bus)
    toy = ToyBlocks(9)
    weights = {k: torch.randn(v.shape) * 0.05 for k, v in ToyBlocks(9).state_dict().items()}
    store.register_model("diffusion", toy, "cpu", "cpu", weights.__getitem__)
    compared = []

    def compare(event):
        if event.kind == "segment_start":
            expected = [s["state"] for s in runner.snapshot()["segments"]]
            got = [s["state"] for s in model.snapshot()["plan"]["segments"]]
            compared.append((expected, got))

    bus.subscribe(compare)
    x = torch.randn(2, 256)
    for _ in range(3):
        x = runner.run(toy.stages(), {"x": x}, "diffusion")["x"]
    assert len(compared) >= 6 and len(compared[0][0]) > 1
    for expected, got in compared:
        assert got == expected


def test_a_runtime_snapshot_sets_each_device_budget():
    model = MemoryModel()
    ledger = DeviceLedger("cuda0", 6 * 1024**3, bus=EventBus())
    ledger.allocate("diffusion", "weights", "diffusion/w", 1024**3)
    model.observe_runtime({"devices": {"cuda0": ledger.snapshot()}})
    device = model.snapshot()["devices"]["cuda0"]
    assert device["budget"] == 6 * 1024**3 and device["free"] == 5 * 1024**3
    assert device["weights"] == {"diffusion": 1024**3}


def test_polling_an_idle_runtime_redraws_nothing(qtbot, monkeypatch):
    monkeypatch.setattr(memory_panel, "RUNTIME_POLL_HZ", 1e9)  # every refresh below polls the runtime
    ledger = DeviceLedger("cuda0", 6 * 1024**3, bus=EventBus())
    ledger.allocate("te#2", "weights", "te#2/w", 1024**3)
    model = MemoryModel(clock=time.perf_counter)
    panel = MemoryPanel(model, runtime_snapshot=lambda: {"devices": {"cuda0": ledger.snapshot()}})
    qtbot.addWidget(panel)
    panel.show()
    assert panel.refresh()  # the first poll brings the budget
    assert model.snapshot()["devices"]["cuda0"]["budget"] == 6 * 1024**3
    versions = {model.version}
    for _ in range(30):
        assert not panel.refresh()
        versions.add(model.version)
    assert len(versions) == 1
    assert set(panel.device_plots["cuda0"].areas) == {"te", "workspace"}  # a reload is still te


def test_the_runtime_is_polled_by_the_clock_when_the_window_slows_the_panel_timer(qtbot):
    """The window slows dock timers to 4 Hz while a job runs: a budget set by the job must still arrive
    within a poll period (it once waited 15 ticks, 3.75 s, and a short run never showed its budget)."""
    devices = {}
    panel = MemoryPanel(MemoryModel(), runtime_snapshot=lambda: {"devices": dict(devices)})
    qtbot.addWidget(panel)
    panel.show()
    panel.timer.setInterval(250)
    qtbot.wait(300)  # the first poll found no device
    devices["cpu"] = DeviceLedger("cpu", 20 * 1024**2, bus=EventBus()).snapshot()  # a job configured it
    qtbot.waitUntil(lambda: "cpu" in panel.model.snapshot()["devices"],
                    timeout=int(1000 / memory_panel.RUNTIME_POLL_HZ) + 600)
    assert panel.model.snapshot()["devices"]["cpu"]["budget"] == 20 * 1024**2
    devices["cpu"] = DeviceLedger("cpu", 30 * 1024**2, bus=EventBus()).snapshot()
    panel.refresh(force=True)  # a forced refresh polls at once
    assert panel.model.snapshot()["devices"]["cpu"]["budget"] == 30 * 1024**2


def test_a_queued_segment_copy_marks_that_segment_prefetching_until_it_computes():
    model = MemoryModel()
    publish = [
        ("plan", {"device": "cuda0", "module": "diffusion", "whole": False, "workspace": 10, "capacity": 100,
                  "segments": [(0, 2, 40), (2, 4, 40), (4, 5, 20)], "streamed": [False, True, True],
                  "ring": 40}),
        ("segment_start", {"device": "cuda0", "module": "diffusion", "index": 0}),
        ("transfer", {"device": "cuda0", "module": "diffusion", "key": "segment 2", "bytes": 5 * 10**8,
                      "direction": "h2d", "seconds": 0.01, "stream": "<side stream>"}),
    ]
    for t, (kind, fields) in enumerate(publish):
        model.handle(Event(kind, 10.0 + t * 0.1, fields))
    snapshot = model.snapshot()
    assert [s["state"] for s in snapshot["plan"]["segments"]] == ["computing", "evicted", "prefetching"]
    assert [s["streamed"] for s in snapshot["plan"]["segments"]] == [False, True, True]
    assert snapshot["plan"]["ring"] == 40
    for t, (kind, index) in enumerate((("segment_end", 0), ("segment_start", 2), ("segment_end", 2))):
        model.handle(Event(kind, 11.0 + t * 0.1, {"module": "diffusion", "index": index}))
    # a resident segment stays resident after computing; a streamed one gives its ring bytes back
    assert [s["state"] for s in model.snapshot()["plan"]["segments"]] == ["resident", "evicted", "evicted"]
    assert snapshot["throughput"] == pytest.approx(5 * 10**8)  # bytes in the last second


def test_events_published_from_a_worker_thread_while_the_gui_snapshots(qtbot):
    bus = EventBus()
    model = MemoryModel()
    model.subscribe(bus)
    panel = MemoryPanel(model)
    qtbot.addWidget(panel)
    panel.show()  # so refresh() really draws while the worker publishes
    count, delta = 3000, 1024

    def worker():
        tracked = 0
        for i in range(count):
            tracked += delta
            module = ("te", "diffusion", "vae")[i % 3]
            bus.publish("ledger", device="cpu", module=module, allocation="weights", key=f"{module}/{i}",
                        delta=delta, tracked=tracked)

    thread = threading.Thread(target=worker)
    thread.start()
    while thread.is_alive():
        snapshot = model.snapshot()
        assert len(snapshot["devices"].get("cpu", {"series": {"time": []}})["series"]["time"]) >= 0
        panel.refresh()
    thread.join()
    device = model.snapshot()["devices"]["cpu"]
    assert device["weights"] == {"te": count // 3 * delta, "diffusion": count // 3 * delta,
                                 "vae": count // 3 * delta}
    assert device["tracked"] == count * delta
    assert len(model.events()) == count


def test_panel_renders_a_recorded_trace(qtbot, runtime_trace, screenshot):
    _, path = runtime_trace
    model = MemoryModel()
    model.feed(until_last_diffusion_segment(load_trace(path)))
    panel = MemoryPanel(model)
    qtbot.addWidget(panel)
    panel.resize(760, 600)
    panel.show()
    qtbot.waitExposed(panel)
    assert panel.refresh(force=True)
    assert not panel.refresh()  # nothing changed since: no redraw
    plot = panel.device_plots["cpu"]
    assert {"te", "diffusion", "workspace"} <= set(plot.areas)
    assert plot.getAxis("left").labelText == "MiB"
    states = [s["state"] for s in panel.segment_bar.plan["segments"]]
    assert "computing" in states and len(states) > 1
    assert "in all" in panel.throughput_label.text() and "copying" in panel.segment_bar.header()
    qtbot.wait(50)  # let the new device plot be laid out
    image = screenshot(panel, "memory_panel.png")
    assert image.stat().st_size > 10_000


def test_saved_trace_rebuilds_the_same_snapshot(runtime_trace):
    model, path = runtime_trace
    assert MemoryModel.from_trace(path).snapshot() == model.snapshot()


def test_a_bad_trace_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"kind": "ledger", "time": 1.0, "fields": {}}\nnot json\n')
    with pytest.raises(TraceError, match=r"broken.jsonl' line 2: expected a JSON object"):
        load_trace(path)
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")


def test_replay_hands_every_event_to_a_live_panel(qtbot, runtime_trace):
    _, path = runtime_trace
    events = load_trace(path)
    model = MemoryModel(clock=time.perf_counter)
    panel = MemoryPanel(model)
    qtbot.addWidget(panel)
    replay = TraceReplay.from_file(model, path, speed=20.0)
    with qtbot.waitSignal(replay.finished, timeout=5000):
        replay.start()
    assert len(model.events()) == len(events)
    assert [e.kind for e in model.events()] == [e.kind for e in sorted(events, key=lambda e: e.time)]
    assert not panel.refresh()  # hidden: nothing drawn
    panel.show()
    assert panel.refresh()
    with pytest.raises(ValueError, match="replay speed must be positive"):
        TraceReplay(model, events, speed=0)


def test_install_memory_views_docks_both_views_on_the_main_window(qtbot, make_window, runtime_trace,
                                                                  screenshot):
    window = make_window()
    bus = EventBus()
    panel, devices = install_memory_views(window, bus)
    titles = {dock.windowTitle() for dock in window._docks}
    assert {"Memory", "Devices"} <= titles
    bus.publish("ledger", device="cuda0", module="vae", allocation="weights", key="vae/w", delta=7, tracked=7)
    assert panel.model.snapshot()["devices"]["cuda0"]["weights"] == {"vae": 7}
    panel.model.feed(load_trace(runtime_trace[1]))
    panel.refresh()
    qtbot.wait(100)  # docks added to a shown window are laid out on the next event loop pass
    assert panel.isVisible()
    screenshot(window, "main_window_memory_docks.png")


def test_a_bounded_snapshot_keeps_every_bins_peak():
    model = MemoryModel()
    sizes = [(i * 7919) % 1000 for i in range(5000)]  # a scrambled sawtooth of tracked bytes
    for i, tracked in enumerate(sizes):
        model.handle(Event("ledger", i * 0.01, {"device": "cpu", "module": "vae", "allocation": "weights",
                                               "key": str(i), "delta": 0, "tracked": tracked}))
    series = model.snapshot(max_points=100)["devices"]["cpu"]["series"]
    assert len(series["used"]) == 100
    assert series["used"] == [max(sizes[i : i + 50]) for i in range(0, 5000, 50)]
    assert series["time"] == sorted(series["time"])


def test_memory_trace_saved_from_the_window_replays_in_a_panel_of_its_own(qtbot, make_window, runtime_trace,
                                                                            tmp_path):
    window = make_window()
    window.memory_panel.model.feed(load_trace(runtime_trace[1]))
    path = tmp_path / "run.jsonl"
    window.save_memory_trace(str(path))
    replay = window.replay_memory_trace(str(path), speed=1000.0)
    assert replay is not None
    qtbot.waitUntil(lambda: replay.replay.position == len(replay.replay.events), timeout=10_000)
    saved, replayed = MemoryModel.from_trace(path).snapshot(), replay.model.snapshot()
    assert replayed["devices"].keys() == saved["devices"].keys() and saved["devices"]
    for name, device in saved["devices"].items():
        assert replayed["devices"][name]["weights"] == device["weights"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not a trace\n")
    assert window.replay_memory_trace(str(bad)) is None
    with qtbot.waitSignal(replay.destroyed):  # closing deletes the replay window and its plots
        replay.close()


def ledger_event(model, when, module, delta, tracked, device="cpu"):
    model.handle(Event("ledger", when, {"device": device, "module": module, "allocation": "weights",
                                        "key": f"{module}/w", "delta": delta, "tracked": tracked}))


def test_each_job_starts_a_run_on_its_own_time_axis_and_the_runs_before_stay_to_compare():
    model = MemoryModel()
    runs = RUNS_KEPT + 2
    for run in range(runs):
        start = 10.0 * run
        model.handle(Event("job_started", start, {"job_id": str(run), "node_count": 3}))
        ledger_event(model, start + 1, "diffusion", 100 * (run + 1), 100 * (run + 1))
        ledger_event(model, start + 4, "diffusion", -100 * (run + 1), 0)
    snapshot = model.snapshot()
    assert snapshot["run"] == f"run {runs}" and snapshot["elapsed"] == pytest.approx(4.0)
    series = snapshot["devices"]["cpu"]["series"]
    assert series["time"] == [0.0, 1.0, 4.0]  # starts with the state the run found
    assert series["used"] == [0, 100 * runs, 0]
    previous = snapshot["devices"]["cpu"]["previous"]
    assert [p["run"] for p in previous] == [f"run {r}" for r in range(runs - RUNS_KEPT + 1, runs)]
    assert all(p["duration"] == pytest.approx(10.0) and p["time"][0] == 0.0 for p in previous)
    assert [max(p["used"]) for p in previous] == [100 * r for r in range(runs - RUNS_KEPT + 1, runs)]


def test_a_reloaded_model_counts_as_its_kind_not_as_a_numbered_module():
    model = MemoryModel()
    ledger_event(model, 1.0, "te", 100, 100)
    ledger_event(model, 2.0, "te#2", 50, 150)  # the same text encoder loaded again before the first went
    device = model.snapshot()["devices"]["cpu"]
    assert device["weights"] == {"te": 150}
    assert set(device["series"]["weights"]) == {"te"} and device["series"]["weights"]["te"][-1] == 150


def test_the_device_plot_scale_fits_the_budget_not_the_free_ram(qtbot):
    mib = 1024**2
    model = MemoryModel()
    ledger = DeviceLedger("cpu", 20 * mib, bus=EventBus())
    ledger.allocate("diffusion", "weights", "diffusion/w", 12 * mib)
    snapshot = ledger.snapshot()
    snapshot["free"] = 20 * 1024**3  # what a CPU reports: the whole free RAM
    model.observe_ledger(snapshot)
    plot = DevicePlot("cpu")
    qtbot.addWidget(plot)
    plot.show_device(model.snapshot()["devices"]["cpu"], 1.0)
    assert plot.scale_bytes == 20 * mib
    top = plot.getViewBox().viewRange()[1][1]  # in MiB, the axis's unit
    assert plot.getAxis("left").labelText == "MiB" and 20 < top < 25
    title = plot.getPlotItem().titleLabel.text
    assert "VRAM budget 20 MiB" in title and "used 12 MiB" in title


def test_the_planned_placement_shows_before_any_event(qtbot):
    slots = (ModuleSlot("1", "Load Checkpoint", "diffusion", ("cpu",), None, "cpu", "does not fit",
                        26 * 1024**2, 1024**2),
             ModuleSlot("2", "Load CLIP", "te", ("cpu",), "device", weight_bytes=12 * 1024**2))
    placement = WorkflowPlacement(slots, (), {"cpu": 20 * 1024**2}, None, None, None,
                                  {("1", "diffusion"): 6 * 1024**2})
    panel = MemoryPanel(MemoryModel())
    qtbot.addWidget(panel)
    panel.set_planned(placement)
    panel.show()
    assert panel.refresh()
    text = panel.plan_label.text()
    assert "≥6 MiB copied per step" in text and "streams from RAM" in text and "stays resident" in text
    plot = panel.device_plots["cpu"]
    assert list(plot.planned.getData()[1]) == [12.0, 12.0]  # the te's resident MiB, as planned
    assert list(plot.budget.getData()[1]) == [20.0, 20.0]


def test_the_segment_header_is_elided_to_the_bar_and_whole_in_the_tooltip(qtbot):
    bar = SegmentBar()
    qtbot.addWidget(bar)
    bar.resize(300, 64)
    mib = 1024**2
    plan = {"module": "diffusion", "device": "cuda0", "whole": False, "workspace": mib, "ring": 8 * mib,
            "segments": [{"index": i, "start": i, "stop": i + 1, "weight_bytes": 1024**2, "state": "resident",
                          "streamed": i > 2} for i in range(12)]}
    bar.set_plan(plan, 61.45e6)
    shown = bar.shown_header()
    assert shown.endswith("…") and shown.startswith("diffusion on cuda0 · copying 61.45 MB/s")
    assert QFontMetricsF(bar.label_font()).horizontalAdvance(shown) <= bar.width() - 16
    assert bar.toolTip() == bar.header() and "stream ring 8.0 MiB" in bar.toolTip()
    bar.resize(1400, 64)
    assert bar.shown_header() == bar.header()
