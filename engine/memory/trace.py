"""A Chrome trace (the JSON Perfetto and chrome://tracing open) of the memory runtime's telemetry.

One process per device; on each, a "compute" track with one complete event per segment (segment_start to
segment_end), a "copy" track with one complete event per weight transfer (its host time, which for an
asynchronous CUDA copy is the time to enqueue it) and an instant per eviction, and a "runtime" track with
plans and placements. Ledger events become a "tracked bytes" counter. Workflow nodes (node_started to
node_finished) appear on a "nodes" track of a "workflow" process.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from engine import telemetry

TRACKS = {"compute": 1, "copy": 2, "runtime": 3}
WORKFLOW_PID = 0


class ChromeTrace:
    """Subscribes to a bus; `close()` writes the trace file (also usable as a context manager)."""

    def __init__(self, path: str | os.PathLike[str], bus: telemetry.EventBus | None = None) -> None:
        self.path = Path(path)
        self._events: list[dict[str, Any]] = []
        self._open: dict[tuple, float] = {}  # (kind, keys...) -> start time in seconds
        self._pids: dict[str, int] = {}
        self._origin: float | None = None
        self._node_types: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self._unsubscribe = (bus or telemetry.bus).subscribe(self)

    def __enter__(self) -> ChromeTrace:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _us(self, seconds: float) -> float:
        if self._origin is None:
            self._origin = seconds
        return round((seconds - self._origin) * 1e6, 3)

    def _pid(self, device: str) -> int:
        if device not in self._pids:
            pid = len(self._pids) + 1
            self._pids[device] = pid
            self._events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": device}})
            for track, tid in TRACKS.items():
                self._events.append(
                    {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}}
                )
        return self._pids[device]

    def _complete(self, name: str, pid: int, tid: int, start: float, end: float, args: dict) -> None:
        begin = self._us(start)
        self._events.append({"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": begin,
                             "dur": max(0.0, self._us(end) - begin), "args": args})

    def __call__(self, event: telemetry.Event) -> None:
        with self._lock:
            handler = getattr(self, f"_on_{event.kind}", None)
            if handler is not None:
                handler(event)

    def _on_segment_start(self, event: telemetry.Event) -> None:
        self._open[("segment", event.get("device"), event.get("module"), event.get("index"))] = event.time

    def _on_segment_end(self, event: telemetry.Event) -> None:
        device, module, index = event.get("device"), event.get("module"), event.get("index")
        start = self._open.pop(("segment", device, module, index), event.time)
        self._complete(f"{module} segment {index}", self._pid(device), TRACKS["compute"], start, event.time,
                       {"module": module, "index": index})

    def _on_transfer(self, event: telemetry.Event) -> None:
        seconds = float(event.get("seconds") or 0.0)
        args = {k: event.get(k) for k in ("module", "key", "bytes", "direction", "stream")}
        self._complete(f"{event.get('direction')} {event.get('key')}", self._pid(event.get("device")),
                       TRACKS["copy"], event.time - seconds, event.time, args)

    def _instant(self, event: telemetry.Event, name: str, track: str) -> None:
        args = {k: v for k, v in event.fields.items() if isinstance(v, str | int | float | bool | type(None))}
        self._events.append({"ph": "i", "s": "t", "name": name, "pid": self._pid(event.get("device", "?")),
                             "tid": TRACKS[track], "ts": self._us(event.time), "args": args})

    def _on_eviction(self, event: telemetry.Event) -> None:
        self._instant(event, f"evict {event.get('key')}", "copy")

    def _on_plan(self, event: telemetry.Event) -> None:
        self._instant(event, f"plan {event.get('module')}: {len(event.get('segments') or [])} segment(s)",
                      "runtime")

    def _on_placement(self, event: telemetry.Event) -> None:
        self._instant(event, f"placement {event.get('module')}: {event.get('params')}", "runtime")

    def _on_ledger(self, event: telemetry.Event) -> None:
        self._events.append({"ph": "C", "name": "tracked bytes", "pid": self._pid(event.get("device")),
                             "ts": self._us(event.time), "args": {"tracked": event.get("tracked")}})

    def _on_node_started(self, event: telemetry.Event) -> None:
        self._open[("node", event.get("node_id"))] = event.time
        self._node_types[event.get("node_id")] = event.get("node_type")

    def _on_node_finished(self, event: telemetry.Event) -> None:
        node_id = event.get("node_id")
        start = self._open.pop(("node", node_id), event.time)
        if not any(e.get("pid") == WORKFLOW_PID and e["ph"] == "M" for e in self._events):
            self._events.append({"ph": "M", "name": "process_name", "pid": WORKFLOW_PID,
                                 "args": {"name": "workflow"}})
            self._events.append({"ph": "M", "name": "thread_name", "pid": WORKFLOW_PID, "tid": 1,
                                 "args": {"name": "nodes"}})
        node_type = self._node_types.get(node_id, "?")
        self._complete(f"[{node_id}] {node_type}", WORKFLOW_PID, 1, start, event.time, {"node_id": node_id})

    def close(self) -> Path:
        """Stop listening and write the file; returns its path."""
        self._unsubscribe()
        with self._lock:
            document = {"traceEvents": list(self._events), "displayTimeUnit": "ms"}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(document))
        return self.path
