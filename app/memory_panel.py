"""The live memory panel (pyqtgraph): per device, what the current run holds over time (each kind of model's
resident weights stacked, plus workspace) against the device's VRAM budget, on a scale that fits the budget
and the run (not the free RAM), with the used memory of the last few runs to compare; the plan of where the
workflow's models will compute and rest (shown before the first run); the running model's segment plan with
the copy rate; and the copy throughput.

A QTimer (~30 Hz) pulls `MemoryModel.snapshot()` on the GUI thread and redraws only when the model
changed; the model itself is filled on the worker thread by the telemetry bus, so no Qt object is touched
from a bus callback. The panel lives in a floatable dock, so it can go to a second screen.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QObject, QRectF, Qt, QTimer, Slot
from PySide6.QtGui import QColor, QFont, QFontMetricsF, QPainter, QPen
from PySide6.QtWidgets import (
    QDialog,
    QDockWidget,
    QFrame,
    QHBoxLayout,
    QLabel,
    QScrollArea,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from app.device_badges import rest_label
from app.devices_view import MODULE_COLORS, OTHER_COLOR, DevicesView, WorkflowMemoryBinder
from app.gui_words import BUDGET
from app.memory_model import MemoryModel, load_trace, module_kind
from app.trace_replay import TraceReplay
from app.workflow_placement import WorkflowPlacement, format_size, placements
from engine import telemetry
from engine.memory.runtime import get_runtime
from engine.telemetry import EventBus

BACKGROUND = "#17191c"
AXIS = "#8d94a0"
TEXT = "#dfe3ea"
OTHER_MODULE_COLOR = OTHER_COLOR
WORKSPACE_COLOR = "#e57373"
USED_COLOR = "#f0f0f0"
BUDGET_COLOR = "#ffd54f"
PLANNED_COLOR = "#b0bec5"
PREVIOUS_COLOR = "#9575cd"
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
PLAN_DELAY_MS = 250  # the plan is computed again this long after the last edit (it reads file headers)
THROUGHPUT_MIN_PANEL_HEIGHT = 300  # a shorter panel (a docked one at 1024x700) leaves the rate plot out
HEADROOM = 1.08  # the y axis reaches this far above the scale, so a line at the budget stays in sight
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
    """The samples whose value is known (a budget may be unknown), in units of `size`."""
    known = np.array([v is not None for v in values], dtype=bool)
    numbers = np.array([v if v is not None else 0 for v in values], dtype=float) / size
    return times[known], numbers[known]


def plot_scale(budget: int | None, used: list[float], previous: list[list[float]], planned: int) -> float:
    """The top of a device plot in bytes: what must be seen (the budget, the runs' peaks, the planned
    resident weights), never the free memory, which on a CPU is the whole RAM."""
    return float(max([budget or 0, planned, *used, *(v for run in previous for v in run), 1]))


def time_axis_end(seconds: float) -> float:
    """The right end of a run's time axis: `seconds` rounded up to 1, 1.5, 2, 3, 5 or 7.5 times a power of
    ten, so that a running job's growing axis is laid out again a few times per decade, not at every frame."""
    if seconds <= 0:
        return 1.0
    decade = 10.0 ** math.floor(math.log10(seconds))
    return next(m * decade for m in (1, 1.5, 2, 3, 5, 7.5, 10) if m * decade >= seconds * (1 - 1e-9))


class DevicePlot(pg.PlotWidget):
    """One device: stacked resident weights per kind of model plus workspace, the used and budget lines, the
    planned resident weights, and the used memory of earlier runs."""

    def __init__(self, device: str, parent: QWidget | None = None) -> None:
        super().__init__(parent, background=BACKGROUND)
        self.device = device
        self.setMinimumHeight(150)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.setTitle(device, color=TEXT, size="10pt")
        for side in ("left", "bottom"):
            axis = self.getAxis(side)
            axis.setTextPen(AXIS)
            axis.setPen(AXIS)
        self.setLabel("bottom", "seconds into the run", color=AXIS)
        self.showGrid(x=True, y=True, alpha=0.15)
        self.setMouseEnabled(x=False, y=False)
        for side in ("left", "bottom"):  # the labels name the units
            self.getAxis(side).enableAutoSIPrefix(False)
        self.legend_html = ""  # the title's second line: a swatch per series drawn
        self.areas: dict[str, pg.PlotDataItem] = {}
        self.previous: list[pg.PlotDataItem] = []
        dashed, dotted = Qt.PenStyle.DashLine, Qt.PenStyle.DotLine
        self.used = self.plot(pen=pg.mkPen(USED_COLOR, width=1.5), name="used")
        self.budget = self.plot(pen=pg.mkPen(BUDGET_COLOR, width=2, style=dashed), name=BUDGET)
        self.planned = self.plot(pen=pg.mkPen(PLANNED_COLOR, width=1.2, style=dotted), name="planned")
        for line in (self.used, self.budget, self.planned):
            line.setZValue(10)
        self.scale_bytes = 1.0  # the top of the y axis (before the legend's headroom)
        self._shown: dict[str, Any] = {}  # what the title, axis label and ranges show now (see _show)

    def _show(self, what: str, value: Any, apply: Any) -> None:
        """Call `apply(value)` only when `value` differs from what `what` shows: a new title, axis label or
        range lays out and redraws the plot's text and ticks (about 8 ms each on a 2-core machine, most of
        what a GUI run cost beyond a headless one)."""
        if self._shown.get(what) != value:
            self._shown[what] = value
            apply(value)

    def _area(self, name: str, color: str) -> pg.PlotDataItem:
        if name not in self.areas:
            fill = QColor(color)
            fill.setAlpha(200)
            self.areas[name] = self.plot(pen=pg.mkPen(color, width=1), brush=pg.mkBrush(fill), fillLevel=0,
                                         name=name)
        return self.areas[name]

    def _previous_lines(self, count: int) -> None:
        while len(self.previous) < count:
            pen = pg.mkPen(PREVIOUS_COLOR, width=1.2, style=Qt.PenStyle.DashDotLine)
            line = self.plot(pen=pen)
            line.setZValue(9)
            self.previous.append(line)

    @staticmethod
    def _legend(weights: Mapping[str, Any], workspace: bool, planned: int, previous: list) -> str:
        def swatch(color: str, text: str, mark: str = "■") -> str:
            return f"<span style='color:{color}'>{mark}</span>&nbsp;{text}"

        items = [swatch(MODULE_COLORS.get(m, OTHER_MODULE_COLOR), m) for m in weights]
        if workspace:
            items.append(swatch(WORKSPACE_COLOR, "workspace"))
        items += [swatch(USED_COLOR, "used", "━"), swatch(BUDGET_COLOR, "budget", "╍")]
        if planned:
            items.append(swatch(PLANNED_COLOR, "planned", "┈"))
        if previous:
            items.append(swatch(PREVIOUS_COLOR, "earlier runs", "╌"))
        return "&nbsp;&nbsp;".join(items)

    def show_device(self, device: dict[str, Any] | None, end: float, run: str = "",
                    planned: int = 0, planned_budget: int | None = None) -> None:
        """Draw `device` (a snapshot's device, None before its first event) up to `end` seconds into the run,
        with `planned` resident bytes and, before the run reports one, the planned budget."""
        series = device["series"] if device is not None else {
            "time": [], "used": [], "budget": [], "workspace": [], "weights": {}}
        previous = device.get("previous", []) if device is not None else []
        budget = device["budget"] if device is not None and device["budget"] is not None else planned_budget
        times = np.asarray(series["time"], dtype=float)
        used = np.asarray(series["used"], dtype=float)
        scale = plot_scale(budget, series["used"], [p["used"] for p in previous], planned)
        self.scale_bytes = scale
        unit, size = byte_unit(scale)
        self._show("unit", unit, lambda text: self.setLabel("left", text, color=AXIS))
        facts = [f"{BUDGET} {format_size(budget)}" if budget else "no VRAM budget"]
        if device is not None:
            facts.append(f"used {format_size(device['tracked'])}")
        head = f"<b>{self.device}</b>{' · ' + run if run else ''} · {' · '.join(facts)}"
        legend = self._legend(series["weights"], any(series["workspace"]), planned, previous)
        self._show("title", f"{head}<br>{legend}", lambda text: self.setTitle(text, color=TEXT, size="9pt"))
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
        drawn = {name for name, _, _ in tops}
        for name, area in self.areas.items():  # a model the current run has not loaded (yet)
            if name not in drawn:
                area.setData([], [])
        longest = max([end, *(p["duration"] for p in previous), 1e-3 if len(times) else 1.0])
        self.used.setData(*_step(times, used / size, end))
        if len(series["budget"]) and any(b is not None for b in series["budget"]):
            known_times, known = _known(times, series["budget"], size)
            if known_times[0] > 0:  # the budget held before the run's first report of it
                known_times, known = np.insert(known_times, 0, 0.0), np.insert(known, 0, known[0])
            self.budget.setData(*_step(known_times, known, end))
        elif budget:
            self.budget.setData([0, longest], [budget / size] * 2)
        else:
            self.budget.setData([], [])
        self.planned.setData(*(([0, longest], [planned / size] * 2) if planned else ([], [])))
        self._previous_lines(len(previous))
        for line, run_data in zip(self.previous, previous, strict=False):
            line.setData(*_step(run_data["time"], np.asarray(run_data["used"], dtype=float) / size,
                                run_data["duration"]))
        for line in self.previous[len(previous):]:
            line.setData([], [])
        self._show("y", scale / size * HEADROOM, lambda top: self.setYRange(0, top, padding=0))
        self._show("x", time_axis_end(longest), lambda right: self.setXRange(0, right, padding=0.02))


class SegmentBar(QWidget):
    """The running module's segment plan: one box per segment, coloured by its state, with labels."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.plan: dict[str, Any] | None = None
        self.rate = 0.0  # bytes per second copied over the last second
        self.setMinimumHeight(64)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def set_plan(self, plan: dict[str, Any] | None, rate: float = 0.0) -> None:
        self.plan = plan
        self.rate = rate
        self.setToolTip(self.header())  # the whole line, where the bar is too narrow for it
        self.update()

    def label_font(self) -> QFont:
        font = QFont(self.font())
        font.setPointSizeF(8.5)
        return font

    def shown_header(self) -> str:
        """The header as drawn: elided at the right where the bar is narrower than it (a docked panel at
        1024x700 cut the workspace and ring off mid-word)."""
        metrics = QFontMetricsF(self.label_font())
        return metrics.elidedText(self.header(), Qt.TextElideMode.ElideRight, self.width() - 16)

    def header(self) -> str:
        """The line above the boxes: the module, its device, the segments, the ring and the copy rate."""
        if not self.plan or not self.plan["segments"]:
            return "no segment plan yet"
        segments = self.plan["segments"]
        kind = "one segment (fits whole)" if self.plan["whole"] else f"{len(segments)} segments"
        copying = f"copying {format_rate(self.rate)}" if self.rate else "no copies now"
        header = (f"{self.plan['module']} on {self.plan['device']} · {copying} · {kind}, workspace "
                  f"{format_bytes(self.plan['workspace'])}")
        if self.plan.get("ring"):
            header += f", stream ring {format_bytes(self.plan['ring'])} (underlined segments stream)"
        return header

    def paintEvent(self, event: Any) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.fillRect(self.rect(), QColor(BACKGROUND))
        painter.setFont(self.label_font())
        painter.setPen(QColor(TEXT))
        width = self.width() - 16
        if not self.plan or not self.plan["segments"]:
            painter.setPen(QColor(AXIS))
            painter.drawText(QRectF(8, 0, width, 22), Qt.AlignmentFlag.AlignVCenter, "no segment plan yet")
            return
        segments = self.plan["segments"]
        painter.drawText(QRectF(8, 0, width, 20), Qt.AlignmentFlag.AlignVCenter, self.shown_header())
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
            if painter.fontMetrics().horizontalAdvance(label) > box.width() - 2:
                continue  # too narrow for even its number
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
        self.setMinimumHeight(80)
        for side in ("left", "bottom"):
            self.getAxis(side).setTextPen(AXIS)
            self.getAxis(side).setPen(AXIS)
        self.setLabel("left", "copies", units="B/s", color=AXIS)
        self.setLabel("bottom", "seconds into the run", color=AXIS)
        self.getAxis("bottom").enableAutoSIPrefix(False)
        self.showGrid(x=True, y=True, alpha=0.15)
        self.setMouseEnabled(x=False, y=False)
        self.curve = self.plot(pen=pg.mkPen(FREE_COLOR, width=1.5), brush=pg.mkBrush(38, 198, 218, 60),
                               fillLevel=0)
        self._right: float | None = None

    def show_series(self, series: dict[str, list[float]], end: float) -> None:
        self.curve.setData(*_step(series["time"], series["rate"], end))
        right = time_axis_end(end)
        if right != self._right:  # see DevicePlot._show
            self._right = right
            self.setXRange(0, right, padding=0.02)


def plan_html(placement: WorkflowPlacement | None) -> str:
    """The planned placement in words: per model where it computes, its size, whether its weights stay or
    are copied in (and how much each step), then the copies expected per sampling step."""
    if placement is None:
        return ""
    if placement.error:
        return f"<b>Plan</b>: {placement.error}"
    if not placement.slots:
        return "<b>Plan</b>: no models in this workflow"
    rows = []
    per_step = 0
    for slot in placement.slots:
        color = MODULE_COLORS.get(slot.module, OTHER_MODULE_COLOR)
        name = f"<span style='color:{color}'><b>{slot.module}</b></span> ({slot.node_title})"
        if slot.problem:
            rows.append(f"{name}: <span style='color:#ff4d4d'>{slot.problem}</span>")
            continue
        size = format_size(slot.weight_bytes) if slot.weight_bytes is not None else "size unknown"
        copies = placement.copy_per_call(slot)
        if slot.module == "diffusion":
            per_step += copies
        if slot.resident:
            fate = "stays resident"
        else:
            fate = f"streams from {rest_label(slot.home, slot.compute)}"
            if copies:
                per = "step" if slot.module == "diffusion" else "use"
                fate += f", ≥{format_size(copies)} copied per {per}"
        rows.append(f"{name} on {'&'.join(slot.compute)} · {size} · {fate}")
    total = f"≥{format_size(per_step)} copied per step" if per_step else "no copies expected per step"
    return "<br>".join([f"<b>Plan</b> before anything loads: <i>{total}</i>", *rows])


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
        self.planned: WorkflowPlacement | None = None
        self._polled_at = -float("inf")  # perf_counter() of the last runtime poll
        self.setAutoFillBackground(True)
        self.setStyleSheet(f"background: {BACKGROUND}; color: {TEXT};")
        self.device_plots: dict[str, DevicePlot] = {}
        self.layout_ = QVBoxLayout(self)
        self.layout_.setContentsMargins(4, 4, 4, 4)
        self.layout_.setSpacing(4)
        self.remote_label = QLabel(self)  # set_remote_queue: the jobs run on a server
        self.remote_label.setWordWrap(True)
        self.remote_label.setStyleSheet(f"color: {TEXT}; padding: 2px 6px; font-size: 9pt;")
        self.remote_label.hide()
        self.layout_.addWidget(self.remote_label)
        top = QHBoxLayout()
        self.devices_box = QVBoxLayout()
        top.addLayout(self.devices_box, 3)
        side = QVBoxLayout()
        self.plan_label = QLabel(self)
        self.plan_label.setWordWrap(True)
        self.plan_label.setTextFormat(Qt.TextFormat.RichText)
        self.plan_label.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.plan_label.setStyleSheet(f"color: {TEXT}; padding: 2px 6px; font-size: 9pt;")
        self.plan_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Maximum)
        side.addWidget(self.plan_label)
        self.segment_bar = SegmentBar(self)
        side.addWidget(self.segment_bar)
        self._copied = False  # whether the model has seen a copy (the rate plot stays hidden until then)
        self.throughput_label = QLabel("copies: idle", self)
        self.throughput_label.setStyleSheet(f"color: {TEXT}; padding-left: 6px; font-size: 9pt;")
        self.throughput_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        side.addWidget(self.throughput_label)
        self.throughput_plot = ThroughputPlot(self)
        side.addWidget(self.throughput_plot, 1)
        side.addStretch(0)
        top.addLayout(side, 2)
        self.layout_.addLayout(top, 1)
        self.drawn_version = -1
        self.drawn_rate = 0.0
        self._plan_dirty = False
        self.set_planned(None)
        self.timer = QTimer(self)
        self.timer.setInterval(int(1000 / refresh_hz))
        self.timer.timeout.connect(self.on_timer)
        self.timer.start()

    def set_remote_queue(self, server: str | None) -> None:
        """Say, above the plots, that queued jobs run on `server` (None: on this machine, no note): the plots
        show this machine's memory, which a server's jobs do not use."""
        self.remote_label.setText(f"Jobs run on the server at {server}: this panel shows this machine's "
                                  f"memory, which they do not use." if server else "")
        self.remote_label.setVisible(server is not None)

    def set_planned(self, placement: WorkflowPlacement | None) -> None:
        """Show where the workflow's models will go (before the first run, and beside every run)."""
        self.planned = placement
        self.plan_label.setText(plan_html(placement))
        self.plan_label.setVisible(placement is not None)  # a replayed trace has no workflow
        self._plan_dirty = True
        if placement is not None:
            for slot in placement.slots:
                if slot.compute:
                    self._plot(slot.compute[0])

    def _plot(self, name: str) -> DevicePlot:
        if name not in self.device_plots:
            plot = DevicePlot(name, self)
            self.device_plots[name] = plot
            self.devices_box.addWidget(plot)
            plot.show()  # a child added to a visible widget stays hidden until shown
        return self.device_plots[name]

    def resizeEvent(self, event: Any) -> None:
        super().resizeEvent(event)
        self._show_throughput_plot()

    def _show_throughput_plot(self) -> None:
        """The copy-rate plot shows once something was copied (a run that copies nothing would leave it an
        empty frame), and only where the panel is tall enough to keep the rest readable."""
        self.throughput_plot.setVisible(self._copied and self.height() >= THROUGHPUT_MIN_PANEL_HEIGHT)

    @Slot()
    def on_timer(self) -> None:
        """The timer's slot; `refresh` itself returns whether it redrew, which a slot need not."""
        self.refresh()

    def refresh(self, force: bool = False) -> bool:
        """Redraw from the model if it changed (or live copies are decaying); returns whether it redrew.
        The runtime is polled at RUNTIME_POLL_HZ by the clock, however often the timer ticks (the window
        slows it while a job runs), and on every forced refresh."""
        now = time.perf_counter()
        if self.runtime_snapshot is not None and (force or now - self._polled_at >= 1 / RUNTIME_POLL_HZ):
            self._polled_at = now
            self.model.observe_runtime(self.runtime_snapshot())
        live_decay = self.model.clock is not None and self.drawn_rate > 0
        unchanged = self.model.version == self.drawn_version and not live_decay and not self._plan_dirty
        if not force and (unchanged or not self.isVisible()):  # a hidden (tabbed-away) panel draws nothing
            return False
        snapshot = self.model.snapshot(max_points=MAX_POINTS)
        end = snapshot["elapsed"] if snapshot["devices"] else 0.0
        planned = self.planned
        for name in [*snapshot["devices"], *self.device_plots]:
            resident = planned.resident_bytes(name) if planned is not None else 0
            budget = planned.budgets.get(name) if planned is not None else None
            device = snapshot["devices"].get(name)
            self._plot(name).show_device(device, end, snapshot["run"], resident, budget)
        rate = snapshot["throughput"]
        self.segment_bar.set_plan(snapshot["plan"], rate)
        self.throughput_plot.show_series(snapshot["throughput_series"], end)
        self.throughput_label.setText(
            f"copies: {format_rate(rate)} now · {format_bytes(snapshot['copied_bytes'])} in all"
            if snapshot["copied_bytes"] else "copies: none yet")
        self._copied = bool(snapshot["copied_bytes"])
        self._show_throughput_plot()
        self.drawn_version = snapshot["version"]
        self.drawn_rate = rate
        self._plan_dirty = False
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


class PlanFollower(QObject):
    """Shows the window's workflow placement in the memory panel, again shortly after each edit."""

    def __init__(self, scene: Any, panel: MemoryPanel) -> None:
        super().__init__(panel)
        self.scene = scene
        self.panel = panel
        self.timer = QTimer(self, singleShot=True, interval=PLAN_DELAY_MS)
        self.timer.timeout.connect(self.update_plan)
        scene.document_changed.connect(self.timer.start)
        self.update_plan()

    @Slot()
    def update_plan(self) -> None:
        self.panel.set_planned(placements.get(self.scene.workflow, self.scene.lookup))


def install_memory_views(main_window: Any, bus: EventBus | None = None) -> tuple[MemoryPanel, DevicesView]:
    """Dock the live memory panel (fed by `bus`, default the engine's, and showing the plan of the window's
    workflow) and the Devices view bound to that workflow; returns both. The docks float on a double click
    of their title (to a second screen). Call once from MainWindow after its docks are built."""
    model = MemoryModel(clock=time.perf_counter)
    panel = MemoryPanel(model, runtime_snapshot=lambda: get_runtime().snapshot())
    model.subscribe(bus or telemetry.bus)  # weakly: the model leaves the bus with its panel
    panel.plan_follower = PlanFollower(main_window.scene, panel)
    devices = DevicesView()
    devices.binder = WorkflowMemoryBinder(main_window.scene, devices)
    bottom = Qt.DockWidgetArea.BottomDockWidgetArea
    memory_dock = main_window.add_dock(_scrollable(panel), bottom, "Memory")
    devices_dock = main_window.add_dock(_scrollable(devices), bottom, "Devices")
    for dock in (memory_dock, devices_dock):
        dock.setFeatures(dock.features() | QDockWidget.DockWidgetFeature.DockWidgetFloatable)
    main_window.tabifyDockWidget(memory_dock, devices_dock)
    memory_dock.raise_()
    return panel, devices
