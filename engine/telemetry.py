"""One thread-safe event bus for every part of the engine.

Publishers call `bus.publish(kind, **fields)`; consumers (the GUI panel, the CLI log, a trace file)
subscribe a callback. Callbacks run on the publishing thread, so a GUI consumer must hand events over
to its own thread (a queued Qt signal to a slot). A subscriber that raises is reported once on stderr
and never breaks the publisher.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    kind: str  # e.g. "job_started", "node_finished", "transfer", "segment_start"
    time: float  # time.perf_counter() at publication
    fields: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


Subscriber = Callable[[Event], None]


class EventBus:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribers: list[Subscriber] = []
        self._failed: set[int] = set()

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Add `callback`; returns a function that removes it again."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def publish(self, kind: str, **fields: Any) -> Event:
        event = Event(kind, time.perf_counter(), fields)
        with self._lock:
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(event)
            except Exception as error:  # a broken consumer must not break the engine
                if id(callback) not in self._failed:
                    self._failed.add(id(callback))
                    print(f"sluice: telemetry subscriber {callback!r} failed: {error!r}", file=sys.stderr)
        return event


class EventRecorder:
    """A subscriber that keeps every event (tests, trace files)."""

    def __init__(self, bus: EventBus | None = None) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()
        if bus is not None:
            bus.subscribe(self)

    def __call__(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def kinds(self) -> list[str]:
        with self._lock:
            return [e.kind for e in self.events]

    def of_kind(self, kind: str) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e.kind == kind]


# The process-wide bus. Components take a bus argument defaulting to this one.
bus = EventBus()
