"""The Chrome trace of a segmented run is valid JSON with a compute track of segments and a copy track of
transfers, in the Trace Event Format that Perfetto reads."""

import json

import pytest
import torch
from memory_toy_model import ToyStaged, reference_weights

from engine.memory.ledger import DeviceLedger
from engine.memory.runtime import MemoryRuntime
from engine.memory.trace import ChromeTrace
from engine.telemetry import EventBus

WIDTH, DEPTH = 64, 8
BLOCK_BYTES = (WIDTH * WIDTH + WIDTH) * 4



pytestmark = pytest.mark.usefixtures("one_torch_thread")

def test_trace_has_compute_and_copy_tracks_with_complete_events(tmp_path):
    bus = EventBus()
    budget = 2 * BLOCK_BYTES + 4 * 4 * WIDTH * 4 + 100  # two blocks at a time: four segments
    runtime = MemoryRuntime(bus=bus, ledgers={"cpu": DeviceLedger("cpu", budget, bus=bus)})
    _, weights = reference_weights(WIDTH, DEPTH)
    model = ToyStaged(WIDTH, DEPTH)
    with ChromeTrace(tmp_path / "trace.json", bus):
        name = runtime.register("diffusion", model, "cpu", "cpu", weights.__getitem__)
        for _ in range(2):
            runtime.run(name, model, model.stages(), {"x": torch.randn(4, WIDTH)})
    document = json.loads((tmp_path / "trace.json").read_text())
    events = document["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(tracks.values()) >= {"compute", "copy"}
    complete = [e for e in events if e["ph"] == "X"]
    by_track = {name: [e for e in complete if e["tid"] == tid] for tid, name in tracks.items()}
    segments, copies = by_track["compute"], by_track["copy"]
    plan = runtime.snapshot()["modules"]["diffusion"]["plan"]["segments"]
    assert len(plan) > 1 and len(segments) == 2 * len(plan)
    streamed = sum(s["streamed"] for s in plan)
    assert streamed and len(copies) >= 2 * streamed and all(c["args"]["direction"] == "h2d" for c in copies)
    for event in segments + copies:
        assert isinstance(event["ts"], float | int) and event["dur"] >= 0 and event["pid"] >= 1
    starts = [e["ts"] for e in segments]
    assert starts == sorted(starts)
    assert any(e["ph"] == "C" and e["name"] == "tracked bytes" for e in events)
