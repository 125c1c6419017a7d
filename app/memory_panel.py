"""The live memory panel (pyqtgraph): per device, tracked memory over time against budget and free memory,
stacked by module; the running module's segment plan; the copy throughput.

A QTimer (~30 Hz) pulls `MemoryModel.snapshot()` on the GUI thread and redraws only when the model
changed; the model itself is filled on the worker thread by the telemetry bus, so no Qt object is touched
from a bus callback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt, QTimer, Slot
from PySide6.QtGui import QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import QDialog, QFrame, QLabel, QScrollArea, QSizePolicy, QVBoxLayout, QWidget

from app.devices_view import DevicesView, WorkflowMemoryBinder
from app.memory_model import MemoryModel, load_trace, module_kind
from app.trace_replay import TraceReplay
from engine import telemetry
from engine.memory.runtime import get_runtime
from engine.telemetry import EventBus

BACKGROUND = "#17191c"
AXIS = "#8d94a0"
TEXT = "#dfe3ea"
MODULE_COLORS = {"te": "#f5a623", "diffusion": "#4c8bf5", "vae": "#43a047", "upscaler": "#ab47bc"}
OTHER_MODULE_COLOR = "#78909c"
WORKSPACE_COLOR = "#e57373"
USED_COLOR = "#f0f0f0"
BUDGET_COLOR = "#ffd54f"
FREE_COLOR = "#26c6da"
SEGMENT_COLORS = {
    "resident": "#43a047",
    "prefetching": "#29b6f6",
    "computing": "#ffb300",
    "evicted": "#3b4250",
}
UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))
REFRESH_HZ = 30
RUNTIME_POLL_HZ = 2
LEGEND_PIXELS = 30
MAX_POINTS = 1500  # samples drawn per series; more are reduced to each bin's peak


def byte_unit(nbytes: float) -> tuple[str, int]:
    """The binary unit (GiB, MiB, KiB) that shows `nbytes` with a leading digit."""
    for name, size in UNITS:
        if nbytes >= size:
            return name, size
    return UNITS[-1]


def format_bytes(nbytes: float) -> str:
    name, size = byte_unit(abs(nbytes))
    return f"{nbytes / size:.1f} {name}"


def format_rate(bytes_per_second: float) -> str:
    for name, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_second >= size:
            return f"{bytes_per_second / size:.2f} {name}"
    return f"{bytes_per_second:.0f} B/s"


def _step(times: Any, values: Any, end: float) -> tuple[np.ndarray, np.ndarray]:
    """Points of a step line that holds each value until the next sample and the last one until `end`."""
    t = np.asarray(times, dtype=float)
    if t.size == 0:
        return t, np.asarray(values, dtype=float)
    xs = np.empty(2 * t.size)  # (t0, t1, t1, t2, ..., tn, end)
    xs[0::2] = t
    xs[1::2] = np.append(t[1:], max(end, t[-1]))
    return xs, np.repeat(np.asarray(values, dtype=float), 2)


def _known(times: np.ndarray, values: list[float | None], size: int) -> tuple[np.ndarray, np.ndarray]:
    """The samples whose value is known (budget or free memory may be unknown), in units of `size`."""
    known = np.array([v is not None for v in values], dtype=bool)
    numbers = np.array([v if v is not None else 0 for v in values], dtype=float) / size
    return times[known], numbers[known]


class DevicePlot(pg.PlotWidget):
    """One device: stacked tracked weights per module plus workspace, and used / budget / free lines."""

    def __init__(self, device: str, parent: QWidget | None = None) -> None:
        super().__init__(parent, background=BACKGROUND)
        self.device = device
        self.setMinimumHeight(130)
        self.setTitle(device, color=TEXT, size="10pt")
        for side in ("left", "bottom"):
            axis = self.getAxis(side)
            axis.setTextPen(AXIS)
            axis.setPen(AXIS)
        self.setLabel("bottom", "time", units="s", color=AXIS)
        self.showGrid(x=True, y=True, alpha=0.15)
        self.setMouseEnabled(x=False, y=False)
        self.getAxis("left").enableAutoSIPrefix(False)  # the label names the binary unit
        self.legend = self.addLegend(offset=(8, 2), labelTextColor=TEXT, brush=pg.mkBrush(23, 25, 28, 220),
                                     colCount=8)  # one row along the top
        self.areas: dict[str, pg.PlotDataItem] = {}
        self.used = self.plot(pen=pg.mkPen(USED_COLOR, width=1.5), name="used")
        dashed, dotted = Qt.PenStyle.DashLine, Qt.PenStyle.DotLine
        self.budget = self.plot(pen=pg.mkPen(BUDGET_COLOR, width=1.5, style=dashed), name="budget")
        self.free = self.plot(pen=pg.mkPen(FREE_COLOR, width=1.2, style=dotted), name="free")
        for line in (self.used, self.budget, self.free):
            line.setZValue(10)

    def _area(self, name: str, color: str) -> pg.PlotDataItem:
        if name not in self.areas:
            fill = QColor(color)
            fill.setAlpha(200)
            self.areas[name] = self.plot(pen=pg.mkPen(color, width=1), brush=pg.mkBrush(fill), fillLevel=0,
                                         name=name)
        return self.areas[name]

    def show_device(self, device: dict[str, Any], end: float) -> None:
        series = device["series"]
        times = np.asarray(series["time"], dtype=float)
        used = np.asarray(series["used"], dtype=float)
        peak = max([device["budget"] or 0, *series["used"], *(f for f in series["free"] if f is not None), 1])
        unit, size = byte_unit(peak)
        self.setLabel("left", f"memory ({unit})", color=AXIS)
        layers = [(m, MODULE_COLORS.get(module_kind(m), OTHER_MODULE_COLOR), v)
                  for m, v in series["weights"].items()]
        layers.append(("workspace", WORKSPACE_COLOR, series["workspace"]))
        cumulative = np.zeros(len(times))
        tops = []
        for name, color, values in layers:
            cumulative = cumulative + np.asarray(values, dtype=float) / size
            tops.append((name, color, cumulative))
        for name, color, _ in tops:  # created in stacking order, so the legend reads bottom to top
            self._area(name, color)
        for z, (name, _, top) in enumerate(reversed(tops)):  # tallest first, each drawn over the last
            self.areas[name].setZValue(z)
            self.areas[name].setData(*_step(times, top, end))
        self.used.setData(*_step(times, used / size, end))
        self.budget.setData(*_step(*_known(times, series["budget"], size), end))
        self.free.setData(*_step(*_known(times, series["free"], size), end))
        height = max(self.getViewBox().height(), 60.0)
        headroom = max(1.15, height / (height - LEGEND_PIXELS))  # the legend row stays above the data
        self.setYRange(0, peak / size * headroom, padding=0)
        self.setXRange(0, max(end, 1e-3), padding=0.02)


class SegmentBar(QWidget):
    """The running module's segment plan: one box per segment, coloured by its state, with labels."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.plan: dict[str, Any] | None = None
        self.setMinimumHeight(64)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def set_plan(self, plan: dict[str, Any] | None) -> None:
        self.plan = plan
        self.update()

    def paintEvent(self, event: Any) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.fillRect(self.rect(), QColor(BACKGROUND))
        font = QFont(self.font())
        font.setPointSizeF(8.5)
        painter.setFont(font)
        painter.setPen(QColor(TEXT))
        width = self.width() - 16
        if not self.plan or not self.plan["segments"]:
            painter.setPen(QColor(AXIS))
            painter.drawText(QRectF(8, 0, width, 22), Qt.AlignmentFlag.AlignVCenter, "no segment plan yet")
            return
        segments = self.plan["segments"]
        kind = "one segment (fits whole)" if self.plan["whole"] else f"{len(segments)} segments"
        header = (f"{self.plan['module']} on {self.plan['device']}: {kind}, workspace "
                  f"{format_bytes(self.plan['workspace'])}")
        if self.plan.get("ring"):
            header += f", stream ring {format_bytes(self.plan['ring'])} (underlined segments stream)"
        painter.drawText(QRectF(8, 0, width, 20), Qt.AlignmentFlag.AlignVCenter, header)
        x, legend_x = 8.0, 8.0
        stages = max(1, segments[-1]["stop"] - segments[0]["start"])
        for segment in segments:
            box = QRectF(x, 22, width * (segment["stop"] - segment["start"]) / stages, 22)
            x = box.right()
            painter.setPen(QPen(QColor(BACKGROUND), 1.5))
            painter.setBrush(QColor(SEGMENT_COLORS.get(segment["state"], OTHER_MODULE_COLOR)))
            painter.drawRoundedRect(box.adjusted(1, 0, -1, 0), 3, 3)
            if segment.get("streamed"):  # copied through the ring on every call
                painter.fillRect(QRectF(box.left() + 2, box.bottom() - 3, box.width() - 4, 3),
                                 QColor(SEGMENT_COLORS["prefetching"]))
            label = f"{segment['index']}: {format_bytes(segment['weight_bytes'])}"
            if painter.fontMetrics().horizontalAdvance(label) > box.width() - 6:
                label = str(segment["index"])
            painter.setPen(QColor("#101214") if segment["state"] != "evicted" else QColor(TEXT))
            painter.drawText(box, Qt.AlignmentFlag.AlignCenter, label)
        for state, color in SEGMENT_COLORS.items():
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(QColor(color))
            painter.drawRoundedRect(QRectF(legend_x, 50, 10, 10), 2, 2)
            painter.setPen(QColor(AXIS))
            painter.drawText(QRectF(legend_x + 14, 46, 90, 18), Qt.AlignmentFlag.AlignVCenter, state)
            legend_x += 28 + painter.fontMetrics().horizontalAdvance(state)


class ThroughputPlot(pg.PlotWidget):
    """Copy throughput (bytes per second over the last second), with an SI-scaled axis."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent, background=BACKGROUND)
        self.setMinimumHeight(110)
        self.setMaximumHeight(150)
        for side in ("left", "bottom"):
            self.getAxis(side).setTextPen(AXIS)
            self.getAxis(side).setPen(AXIS)
        self.setLabel("left", "copies", units="B/s", color=AXIS)
        self.setLabel("bottom", "time", units="s", color=AXIS)
        self.showGrid(x=True, y=True, alpha=0.15)
        self.setMouseEnabled(x=False, y=False)
        self.curve = self.plot(pen=pg.mkPen(FREE_COLOR, width=1.5), brush=pg.mkBrush(38, 198, 218, 60),
                               fillLevel=0)

    def show_series(self, series: dict[str, list[float]], end: float) -> None:
        self.curve.setData(*_step(series["time"], series["rate"], end))
        self.setXRange(0, max(end, 1e-3), padding=0.02)


class MemoryPanel(QWidget):
    def __init__(
        self,
        model: MemoryModel,
        parent: QWidget | None = None,
        refresh_hz: float = REFRESH_HZ,
        runtime_snapshot: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        """`runtime_snapshot` (e.g. the memory runtime's snapshot) is polled at RUNTIME_POLL_HZ on the GUI
        thread for what events do not carry: each device's budget and live free memory."""
        super().__init__(parent)
        self.model = model
        self.runtime_snapshot = runtime_snapshot
        self._ticks = 0
        self._poll_every = max(1, round(refresh_hz / RUNTIME_POLL_HZ))
        self.setAutoFillBackground(True)
        self.setStyleSheet(f"background: {BACKGROUND}; color: {TEXT};")
        self.device_plots: dict[str, DevicePlot] = {}
        self.layout_ = QVBoxLayout(self)
        self.layout_.setContentsMargins(4, 4, 4, 4)
        self.layout_.setSpacing(4)
        self.devices_box = QVBoxLayout()
        self.layout_.addLayout(self.devices_box, 1)
        self.segment_bar = SegmentBar(self)
        self.layout_.addWidget(self.segment_bar)
        self.throughput_label = QLabel("copies: idle", self)
        self.throughput_label.setStyleSheet(f"color: {TEXT}; padding-left: 6px;")
        self.layout_.addWidget(self.throughput_label)
        self.throughput_plot = ThroughputPlot(self)
        self.layout_.addWidget(self.throughput_plot)
        self.drawn_version = -1
        self.drawn_rate = 0.0
        self.timer = QTimer(self)
        self.timer.setInterval(int(1000 / refresh_hz))
        self.timer.timeout.connect(self.on_timer)
        self.timer.start()

    @Slot()
    def on_timer(self) -> None:
        """The timer's slot; `refresh` itself returns whether it redrew, which a slot need not."""
        self.refresh()

    def refresh(self, force: bool = False) -> bool:
        """Redraw from the model if it changed (or live copies are decaying); returns whether it redrew."""
        self._ticks += 1
        if self.runtime_snapshot is not None and self._ticks % self._poll_every == 1 % self._poll_every:
            self.model.observe_runtime(self.runtime_snapshot())
        live_decay = self.model.clock is not None and self.drawn_rate > 0
        unchanged = self.model.version == self.drawn_version and not live_decay
        if not force and (unchanged or not self.isVisible()):  # a hidden (tabbed-away) panel draws nothing
            return False
        snapshot = self.model.snapshot(max_points=MAX_POINTS)
        end = snapshot["elapsed"]
        for name, device in snapshot["devices"].items():
            if name not in self.device_plots:
                plot = DevicePlot(name, self)
                self.device_plots[name] = plot
                self.devices_box.addWidget(plot)
                plot.show()  # a child added to a visible widget stays hidden until shown
            self.device_plots[name].show_device(device, end)
        self.segment_bar.set_plan(snapshot["plan"])
        self.throughput_plot.show_series(snapshot["throughput_series"], end)
        rate = snapshot["throughput"]
        self.throughput_label.setText(
            f"copies: {format_rate(rate)} over the last second · {format_bytes(snapshot['copied_bytes'])} "
            f"copied in total" if snapshot["copied_bytes"] else "copies: none yet")
        self.drawn_version = snapshot["version"]
        self.drawn_rate = rate
        return True


class TraceReplayWindow(QDialog):
    """A memory panel of its own that replays a recorded trace (the live panel keeps running)."""

    def __init__(self, path: str | Path, speed: float = 1.0, parent: QWidget | None = None) -> None:
        events = load_trace(path)  # TraceError for a bad file, before any Qt object exists
        super().__init__(parent)
        self.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)  # a closed replay frees its plots
        self.setWindowTitle(f"Memory trace: {Path(path).name}")
        self.resize(900, 600)
        self.model = MemoryModel(clock=time.perf_counter)
        self.panel = MemoryPanel(self.model, self)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.panel)
        self.replay = TraceReplay(self.model, events, speed, self)
        self.replay.start()


def _scrollable(widget: QWidget) -> QScrollArea:
    """`widget` in a scroll area, so its minimum height does not force the main window's minimum size."""
    scroll = QScrollArea()
    scroll.setWidget(widget)
    scroll.setWidgetResizable(True)
    scroll.setFrameShape(QFrame.Shape.NoFrame)
    return scroll


def install_memory_views(main_window: Any, bus: EventBus | None = None) -> tuple[MemoryPanel, DevicesView]:
    """Dock the live memory panel (fed by `bus`, default the engine's) and the Devices view bound to the
    window's workflow; returns both. Call once from MainWindow after its docks are built."""
    model = MemoryModel(clock=time.perf_counter)
    panel = MemoryPanel(model, runtime_snapshot=lambda: get_runtime().snapshot())
    model.subscribe(bus or telemetry.bus)  # weakly: the model leaves the bus with its panel
    devices = DevicesView()
    devices.binder = WorkflowMemoryBinder(main_window.scene, devices)
    bottom = Qt.DockWidgetArea.BottomDockWidgetArea
    memory_dock = main_window.add_dock(_scrollable(panel), bottom, "Memory")
    devices_dock = main_window.add_dock(_scrollable(devices), bottom, "Devices")
    main_window.tabifyDockWidget(memory_dock, devices_dock)
    memory_dock.raise_()
    return panel, devices
