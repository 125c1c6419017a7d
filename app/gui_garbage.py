"""Python's cyclic garbage collected on the GUI thread only.

An automatic collection runs on whichever thread happens to allocate past the threshold, and while a job runs
that is mostly the engine thread. Qt objects in a reference cycle (a closed dialog, an item with a lambda
connection) are then destroyed on the engine thread: Qt prints "QBasicTimer::start: Timers cannot be started
from another thread" and may crash (the SIGSEGV noted in tests/app/conftest.py). So while the app runs,
automatic collection is off and this timer on the GUI thread collects each generation once its count is past
Python's own threshold, as often as the interpreter would have (pyqtgraph's GarbageCollector does the same).
"""

from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer

CHECK_INTERVAL_MS = 250


class GuiThreadGarbageCollector(QObject):
    """`start()` turns automatic collection off and collects on this object's (the GUI) thread; `stop()`
    turns it back on."""

    def __init__(self, parent: QObject | None = None, interval_ms: int = CHECK_INTERVAL_MS) -> None:
        super().__init__(parent)
        self._thresholds = gc.get_threshold()
        self._timer = QTimer(self)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self.collect_due)
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()
        if self._was_enabled:
            gc.enable()

    def collect_due(self) -> None:
        """Collect the oldest generation whose count passed its threshold (with the younger ones)."""
        counts = gc.get_count()
        generation = -1
        for index, (count, threshold) in enumerate(zip(counts, self._thresholds, strict=True)):
            if threshold <= 0 or count <= threshold:
                break
            generation = index
        if generation >= 0:
            gc.collect(generation)
