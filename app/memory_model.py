"""Qt-free aggregation of memory-runtime telemetry for the live memory panel.

`MemoryModel` is a bus subscriber: it runs on whatever thread publishes (the worker), so it only takes a
lock and updates plain data; the GUI pulls `snapshot()` on a timer. It keeps, per device, a time series of
used / budget / free bytes and of the tracked weights per module plus workspace; the current segment plan
of the module that runs last, with each segment's state; and the copy throughput over the last second.
Every event it receives is kept, so the same model can write a trace (JSON lines) and be rebuilt from one.

Events read (engine/memory): "ledger" (device, module, allocation, key, delta, tracked), "transfer"
(bytes, seconds, direction, stream), "eviction" (allocation, segment), "plan" (module, device, whole,
segments as (start, stop, weight_bytes)), "segment_start" / "segment_end" (module, index); any event with
`device` and `budget` fields sets that device's budget, and "ledger_snapshot" carries a
`DeviceLedger.snapshot()` (budget, free, tracked, modules) recorded by `observe_ledger`.

Runs: each "job_started" event begins a new run. The snapshot's times count from the current run's start
(its series begin with the state the run found), and the used memory of the RUNS_KEPT - 1 runs before it
comes along to compare. Weights are reported per kind of module (`te#2`, a text encoder loaded again while
the first was still alive, counts as te), so a reload does not add a layer of its own.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.jsonfile import load_json
from engine.telemetry import Event, EventBus

SEGMENT_STATES = ("resident", "prefetching", "computing", "evicted")
PANEL_MODULES = ("te", "clip_vision", "diffusion", "controlnet", "vae", "upscaler")  # in stacking order
KIND_LEDGER_SNAPSHOT = "ledger_snapshot"
THROUGHPUT_WINDOW = 1.0  # seconds of transfers the copy throughput averages over
COALESCE_SECONDS = 0.002  # samples closer than this replace the previous one (bounds the series)
MAX_SAMPLES = 20_000  # per device
MAX_EVENTS = 100_000  # events kept for save_trace; older ones are dropped
RUNS_KEPT = 4  # the current run and the ones before it whose used memory is drawn to compare
KIND_JOB_STARTED = "job_started"


class TraceError(ValueError):
    """A trace file that cannot be read: the message names the file, the line and what was expected."""


@dataclass
class _Device:
    budget: int | None = None
    free_reported: int | None = None  # last live free bytes from a ledger snapshot (None: budget only)
    tracked_at_report: int = 0  # tracked bytes when free_reported was read
    tracked: int = 0
    weights: dict[str, int] = field(default_factory=dict)  # module -> tracked weight bytes
    workspace: dict[str, int] = field(default_factory=dict)  # module -> tracked workspace bytes
    samples: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))

    def free(self) -> int | None:
        """Free bytes: live free memory corrected by tracked changes, else budget minus tracked."""
        if self.free_reported is not None:
            live = self.free_reported - (self.tracked - self.tracked_at_report)
            return live if self.budget is None else min(live, self.budget - self.tracked)
        return None if self.budget is None else self.budget - self.tracked


def _plain(value: Any) -> Any:
    """JSON-friendly copy: tuples to lists, unknown objects to their str()."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


class MemoryModel:
    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        """`clock` None = trace mode (now is the latest event's time); live: `time.perf_counter`."""
        self.clock = clock
        self._lock = threading.Lock()
        self._events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self._devices: dict[str, _Device] = {}
        self._transfers: deque[tuple[float, int]] = deque()  # (time, bytes) within the window
        self._throughput: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)  # (time, bytes/s)
        self._copied_bytes = 0
        self._plan: dict[str, Any] | None = None
        self._observed: dict[Any, dict] = {}  # device -> last ledger snapshot taken
        self._t0: float | None = None
        self._latest = 0.0
        self._runs: deque[tuple[float, str]] = deque(maxlen=RUNS_KEPT)  # (start time, label) of each run
        self._run_count = 0
        self.version = 0  # bumps on every change; a panel redraws only when it moved

    # -- input --

    def __call__(self, event: Event) -> None:
        """Bus subscriber entry point (runs on the publishing thread)."""
        self.handle(event)

    def subscribe(self, bus: EventBus) -> Callable[[], None]:
        """Receive `bus`'s events while this model lives (the bus holds it weakly, so a panel that goes
        away takes its model off the bus without any Qt signal); returns the unsubscribe function."""
        handle_ref = weakref.WeakMethod(self.handle)

        def forward(event: Event) -> None:
            handle = handle_ref()
            if handle is None:
                unsubscribe()
            else:
                handle(event)

        unsubscribe = bus.subscribe(forward)
        return unsubscribe

    def handle(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)
            self._t0 = event.time if self._t0 is None else min(self._t0, event.time)
            self._latest = max(self._latest, event.time)
            handler = self._HANDLERS.get(event.kind)
            if handler is not None:
                handler(self, event)
            if "device" in event.fields and "budget" in event.fields and event.kind != KIND_LEDGER_SNAPSHOT:
                self._device(event["device"]).budget = event["budget"]
                self._sample(event["device"], event.time)
            self.version += 1

    def observe_ledger(self, ledger_snapshot: Mapping[str, Any], when: float | None = None) -> None:
        """Take a `DeviceLedger.snapshot()` (budget, live free, tracked per module) as a recorded event;
        a snapshot equal to the device's previous one is skipped (polling an idle runtime costs nothing)."""
        fields = _plain(dict(ledger_snapshot))
        with self._lock:
            if self._observed.get(fields.get("device")) == fields:
                return
            self._observed[fields.get("device")] = fields
        self.handle(Event(KIND_LEDGER_SNAPSHOT, time.perf_counter() if when is None else when, fields))

    def observe_runtime(self, runtime_snapshot: Mapping[str, Any]) -> None:
        """Take every device ledger of `engine.memory.runtime`'s snapshot() (its "devices" mapping)."""
        for ledger_snapshot in runtime_snapshot.get("devices", {}).values():
            self.observe_ledger(ledger_snapshot)

    def _on_job_started(self, event: Event) -> None:
        self._run_count += 1
        self._runs.append((event.time, f"run {self._run_count}"))
        self._transfers.clear()  # the copy rate starts again with the run

    def _device(self, name: str) -> _Device:
        return self._devices.setdefault(name, _Device())

    def _sample(self, name: str, when: float) -> None:
        device = self._device(name)
        workspace = sum(device.workspace.values())
        sample = (when, device.tracked, device.budget, device.free(), dict(device.weights), workspace)
        if device.samples and when - device.samples[-1][0] < COALESCE_SECONDS:
            device.samples[-1] = sample
        else:
            device.samples.append(sample)

    def _on_ledger(self, event: Event) -> None:
        device = self._device(event["device"])
        table = device.weights if event["allocation"] == "weights" else device.workspace
        table[event["module"]] = table.get(event["module"], 0) + int(event["delta"])
        everything = sum(device.weights.values()) + sum(device.workspace.values())
        device.tracked = int(event.get("tracked", everything))
        self._sample(event["device"], event.time)

    def _on_ledger_snapshot(self, event: Event) -> None:
        device = self._device(event["device"])
        device.budget = event.get("budget")
        device.tracked = int(event.get("tracked", 0))
        modules = event.get("modules", {})
        device.weights = {m: int(v.get("weights", 0)) for m, v in modules.items()}
        device.workspace = {m: int(v.get("workspace", 0)) for m, v in modules.items()}
        device.free_reported = event.get("free")
        device.tracked_at_report = device.tracked
        self._sample(event["device"], event.time)

    def _on_transfer(self, event: Event) -> None:
        nbytes = int(event.get("bytes", 0))
        self._copied_bytes += nbytes
        self._transfers.append((event.time, nbytes))
        self._throughput.append((event.time, self._rate(event.time)))
        key = str(event.get("key", ""))
        if key.startswith("segment "):  # a streamed segment's copy is queued: it prefetches until it computes
            segment = self._segment(event.get("module"), int(key.removeprefix("segment ")))
            if segment is not None and segment["state"] != "computing":
                segment["state"] = "prefetching"

    def _on_plan(self, event: Event) -> None:
        previous = self._plan
        streamed = list(event.get("streamed") or [])
        same = (previous is not None and previous["module"] == event.get("module")
                and [(s["start"], s["stop"]) for s in previous["segments"]]
                == [(start, stop) for start, stop, _ in event.get("segments", [])])
        self._plan = {
            "module": event.get("module"),
            "device": event.get("device"),
            "whole": bool(event.get("whole", False)),
            "workspace": int(event.get("workspace", 0)),
            "capacity": int(event.get("capacity", 0)),
            "ring": int(event.get("ring", 0) or 0),  # stream ring bytes (0: nothing streams)
            "segments": [
                {"index": index, "start": start, "stop": stop, "weight_bytes": int(nbytes),
                 "streamed": bool(streamed[index]) if index < len(streamed) else False,
                 "state": previous["segments"][index]["state"] if same else "evicted"}
                for index, (start, stop, nbytes) in enumerate(event.get("segments", []))
            ],
        }

    def _segment(self, module: Any, index: Any) -> dict[str, Any] | None:
        """The current plan's segment `index` if the plan is `module`'s."""
        if self._plan is None or self._plan["module"] != module:
            return None
        segments = self._plan["segments"]
        return segments[index] if isinstance(index, int) and 0 <= index < len(segments) else None

    def _on_segment_start(self, event: Event) -> None:
        segment = self._segment(event.get("module"), event.get("index"))
        if segment is not None:
            segment["state"] = "computing"

    def _on_segment_end(self, event: Event) -> None:
        segment = self._segment(event.get("module"), event.get("index"))
        if segment is not None:  # a streamed segment's ring bytes go to the next ones
            segment["state"] = "evicted" if segment.get("streamed") else "resident"

    def _on_eviction(self, event: Event) -> None:
        if event.get("allocation") != "weights":
            return
        segment = self._segment(event.get("module"), event.get("segment"))
        if segment is not None and segment["state"] != "computing":
            segment["state"] = "evicted"

    _HANDLERS: dict[str, Callable[[MemoryModel, Event], None]] = {
        KIND_JOB_STARTED: _on_job_started,
        "ledger": _on_ledger,
        KIND_LEDGER_SNAPSHOT: _on_ledger_snapshot,
        "transfer": _on_transfer,
        "plan": _on_plan,
        "segment_start": _on_segment_start,
        "segment_end": _on_segment_end,
        "eviction": _on_eviction,
    }

    def _rate(self, now: float) -> float:
        """Bytes per second copied in the window ending at `now`."""
        while self._transfers and self._transfers[0][0] < now - THROUGHPUT_WINDOW:
            self._transfers.popleft()
        return sum(n for t, n in self._transfers if t <= now) / THROUGHPUT_WINDOW

    # -- output --

    def now(self) -> float:
        return self.clock() if self.clock is not None else self._latest

    def snapshot(self, max_points: int | None = None) -> dict[str, Any]:
        """Plain data for the panel: times are seconds since the current run began (the first event when no
        job has started), sizes are bytes, weights are per kind of module.

        `max_points` bounds each series: longer ones keep the peak sample of each bin (by used bytes, by
        rate for the throughput), so a plot drawn from them loses no peak. "previous" holds, per device, the
        used memory of the runs before the current one, each over its own time from its start.
        """
        with self._lock:
            now = self.now()
            first = self._t0 if self._t0 is not None else now
            start, run = self._runs[-1] if self._runs else (first, "")
            earlier = list(self._runs)[:-1]
            devices = {}
            for name, device in self._devices.items():
                samples = list(device.samples)
                current = _peaks(_run_samples(samples, start, None), 1, max_points)
                modules = _ordered_modules({module_kind(m) for s in current for m, n in s[4].items() if n})
                previous = []
                for index, (begin, label) in enumerate(earlier):
                    end = self._runs[index + 1][0]
                    kept = _peaks(_run_samples(samples, begin, end), 1, max_points)
                    if kept:
                        previous.append({"run": label, "time": [s[0] - begin for s in kept],
                                         "used": [s[1] for s in kept], "duration": end - begin})
                devices[name] = {
                    "budget": device.budget,
                    "free": device.free(),
                    "tracked": device.tracked,
                    "weights": _by_kind(device.weights),
                    "workspace": dict(device.workspace),
                    "series": {
                        "time": [s[0] - start for s in current],
                        "used": [s[1] for s in current],
                        "budget": [s[2] for s in current],
                        "free": [s[3] for s in current],
                        "workspace": [s[5] for s in current],
                        "weights": {m: [_by_kind(s[4]).get(m, 0) for s in current] for m in modules},
                    },
                    "previous": previous,
                }
            throughput = _peaks([t for t in self._throughput if t[0] >= start], 1, max_points)
            plan = None if self._plan is None else {
                **self._plan, "segments": [dict(s) for s in self._plan["segments"]]}
            return {
                "version": self.version,
                "run": run,
                "elapsed": now - start,
                "devices": devices,
                "plan": plan,
                "throughput": self._rate(now),
                "throughput_series": {"time": [t - start for t, _ in throughput],
                                      "rate": [r for _, r in throughput]},
                "copied_bytes": self._copied_bytes,
            }

    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    # -- traces --

    def save_trace(self, path: str | Path) -> Path:
        """Write every kept event as JSON lines: {"kind", "time", "fields"}."""
        path = Path(path)
        with path.open("w", encoding="utf-8") as file:
            for event in self.events():
                file.write(json.dumps({"kind": event.kind, "time": event.time,
                                       "fields": _plain(event.fields)}) + "\n")
        return path

    @classmethod
    def from_trace(cls, path: str | Path) -> MemoryModel:
        """A trace-mode model holding every event of the trace file."""
        model = cls()
        model.feed(load_trace(path))
        return model

    def feed(self, events: Iterable[Event]) -> None:
        for event in events:
            self.handle(event)


def _peaks(samples: list[tuple], column: int, max_points: int | None) -> list[tuple]:
    """At most about `max_points` samples: the one with the largest `column` value of each bin."""
    if max_points is None or len(samples) <= max_points:
        return samples
    width = -(-len(samples) // max_points)  # ceil
    return [max(samples[i : i + width], key=lambda s: s[column]) for i in range(0, len(samples), width)]


def _run_samples(samples: list[tuple], start: float, end: float | None) -> list[tuple]:
    """The samples from `start` to `end` (None: on), led by the state at `start` (the last sample before it,
    moved to `start`) so that a run's series begin with what the run found."""
    inside = [s for s in samples if s[0] >= start and (end is None or s[0] < end)]
    before = [s for s in samples if s[0] < start]
    if before and (not inside or inside[0][0] > start):
        inside.insert(0, (start, *before[-1][1:]))
    return inside


def _by_kind(weights: Mapping[str, int]) -> dict[str, int]:
    """Bytes per kind of module: `te#2` counts as te."""
    totals: dict[str, int] = {}
    for module, nbytes in weights.items():
        totals[module_kind(module)] = totals.get(module_kind(module), 0) + nbytes
    return totals


def module_kind(module: str) -> str:
    """The kind of a runtime module name: `te#2` (a second text encoder) -> te."""
    return module.split("#")[0]


def _ordered_modules(modules: set[str]) -> list[str]:
    """Stacking order: PANEL_MODULES (each with its numbered siblings), then the rest."""
    def rank(module: str) -> tuple:
        kind = module_kind(module)
        return (PANEL_MODULES.index(kind) if kind in PANEL_MODULES else len(PANEL_MODULES), module)

    return sorted(modules, key=rank)


def load_trace(path: str | Path) -> list[Event]:
    """The events of a JSON-lines trace written by `MemoryModel.save_trace`, in file order."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise TraceError(f"cannot read trace {str(path)!r}: {error.strerror or error}") from None
    events = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:  # engine.jsonfile's limits: deep nesting or a 5,000-digit number is an error, not a crash
            data = load_json(line, f"trace {path} line {number}")
            event = Event(str(data["kind"]), float(data["time"]), dict(data["fields"]))
        except (KeyError, TypeError, ValueError):  # JsonInputError is a ValueError
            raise TraceError(
                f"{str(path)!r} line {number}: expected a JSON object with kind, time and fields "
                f"(a trace written by MemoryModel.save_trace), got {line[:80]!r}"
            ) from None
        events.append(event)
    return events
