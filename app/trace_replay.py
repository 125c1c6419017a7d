"""Replay a recorded memory trace (JSON lines from `MemoryModel.save_trace`) into a MemoryModel, in real
time or faster, on the GUI thread's event loop: a QTimer hands over every event whose (scaled) time has
come, with its time shifted to now, so a live-mode panel draws it as if the run were happening."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Signal, Slot

from app.memory_model import MemoryModel, load_trace
from engine.telemetry import Event

TICK_MS = 15


class TraceReplay(QObject):
    finished = Signal()

    def __init__(self, model: MemoryModel, events: Sequence[Event], speed: float = 1.0,
                 parent: QObject | None = None) -> None:
        """`speed` 1 = real time, 10 = ten times faster; must be positive."""
        super().__init__(parent)
        if not speed > 0:
            raise ValueError(f"replay speed must be positive (1 = real time), got {speed!r}")
        self.model = model
        self.events = sorted(events, key=lambda e: e.time)
        self.speed = speed
        self.position = 0  # index of the next event to hand over
        self._started_at = 0.0
        self._timer = QTimer(self)
        self._timer.setInterval(TICK_MS)
        self._timer.timeout.connect(self.tick)

    @classmethod
    def from_file(cls, model: MemoryModel, path: str | Path, speed: float = 1.0,
                  parent: QObject | None = None) -> TraceReplay:
        return cls(model, load_trace(path), speed, parent)

    def start(self) -> None:
        self.position = 0
        self._started_at = time.perf_counter()
        self._timer.start()
        self.tick()

    def stop(self) -> None:
        self._timer.stop()

    def is_running(self) -> bool:
        return self._timer.isActive()

    @Slot()
    def tick(self) -> None:
        """Hand over the events due by now (trace time scaled by speed), each stamped with its due time."""
        if not self.events:
            self._finish()
            return
        first = self.events[0].time
        elapsed = (time.perf_counter() - self._started_at) * self.speed
        while self.position < len(self.events) and self.events[self.position].time - first <= elapsed:
            event = self.events[self.position]
            due = self._started_at + (event.time - first) / self.speed
            self.model.handle(Event(event.kind, due, event.fields))
            self.position += 1
        if self.position >= len(self.events):
            self._finish()

    def _finish(self) -> None:
        self._timer.stop()
        self.finished.emit()
