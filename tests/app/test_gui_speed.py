"""What keeps a GUI run as fast as a headless one (issue 20, point 3; bench/gui_overhead.py measures it): the
relay hands the GUI thread only the events it shows, in batches, and the engine thread waits for the GIL a
short switch interval at most. No test here measures time."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QObject, Qt, Slot

from app.worker import ENGINE_SWITCH_INTERVAL, EventRelay
from engine.telemetry import EventBus

TIMEOUT_MS = 15000


class Counter(QObject):
    """A GUI-thread receiver that counts the relay's announcements and takes the batches."""

    def __init__(self, relay: EventRelay) -> None:
        super().__init__()
        self.relay = relay
        self.batches: list[list] = []

    @Slot()
    def take(self) -> None:
        self.batches.append(self.relay.take_events())


def publish_from_a_worker_thread(bus: EventBus) -> None:
    def work():
        bus.publish("job_started", job_id="job", node_count=2)
        bus.publish("node_started", job_id="job", node_id="1", node_type="KSampler")
        for step in range(1, 51):
            bus.publish("ledger", job_id="job", device="cpu", used=step)  # the memory panel's, not the GUI's
            bus.publish("progress", job_id="job", node_id="1", value=step, max=50)
            bus.publish("preview", job_id="job", node_id="1", image=None)
        bus.publish("node_finished", job_id="job", node_id="1", seconds=1.0)
        bus.publish("progress", job_id="other", node_id="9", value=1, max=2)  # another window's job
        bus.publish("job_finished", job_id="job", status="finished", seconds=1.0)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def test_relay_hands_the_gui_one_batch_of_the_events_it_shows_with_the_latest_progress(qapp):
    bus = EventBus()
    relay = EventRelay(bus)
    relay.current_job_id = "job"
    counter = Counter(relay)
    relay.events_ready.connect(counter.take)
    publish_from_a_worker_thread(bus)
    QCoreApplication.processEvents()
    assert len(counter.batches) == 1  # 153 events from the engine, one slot call on the GUI thread
    kinds = [(event.kind, event.get("value")) for event in counter.batches[0]]
    assert kinds == [("job_started", None), ("node_started", None), ("progress", 50), ("preview", None),
                     ("node_finished", None), ("job_finished", None)]
    publish_from_a_worker_thread(bus)  # once taken, the next events are announced again
    QCoreApplication.processEvents()
    assert len(counter.batches) == 2 and len(counter.batches[1]) == 6
    relay.close()


def test_the_engine_thread_waits_for_the_gil_a_short_switch_interval(make_window, qtbot):
    window = make_window()
    sink = window.scene.add_node("GuiSink", (300, 0))
    number = window.scene.add_node("GuiNumber", (0, 0))
    window.scene.connect_ports(window.scene.node_items[number].outputs[0],
                               window.scene.node_items[sink].inputs["value"])
    job_id = window.queue()
    qtbot.waitUntil(lambda: window.runs.statuses.get(job_id) == "finished", timeout=TIMEOUT_MS)
    assert abs(sys.getswitchinterval() - ENGINE_SWITCH_INTERVAL) < 1e-6 and ENGINE_SWITCH_INTERVAL < 0.001


def test_fast_dock_timers_slow_down_while_a_job_runs(make_window, qtbot, release_sleeper):
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QWidget

    from app.main_window import RUN_REDRAW_MS

    window = make_window()
    panel = QWidget()
    redraw = QTimer(panel)
    redraw.setInterval(33)  # a panel that redraws at 30 Hz
    redraw.start()
    window.add_dock(panel, Qt.DockWidgetArea.BottomDockWidgetArea, "Test panel")
    sleeper = window.scene.add_node("GuiSleep", (0, 0))
    job_id = window.queue()
    qtbot.waitUntil(lambda: window.scene.node_items[sleeper].running, timeout=TIMEOUT_MS)
    assert redraw.interval() == RUN_REDRAW_MS
    release_sleeper.set()
    qtbot.waitUntil(lambda: window.runs.statuses.get(job_id) == "finished", timeout=TIMEOUT_MS)
    assert redraw.interval() == 33 and redraw.isActive()


def test_the_window_takes_the_engines_events_a_few_times_a_second_and_all_of_them_at_the_end(
        make_window, qtbot, release_sleeper):
    """GuiSleep reports progress every 5 ms; the window takes them at most every EVENTS_MS (each taking
    draws, and drawing is time the GUI thread takes from the engine), and the job's last events before its
    end."""
    from app.run_controller import EVENTS_MS

    window = make_window()
    relay = window.runs.worker.relay
    taken = []
    take_events = relay.take_events
    relay.take_events = lambda: taken.append(take_events()) or taken[-1]
    sleeper = window.scene.add_node("GuiSleep", (0, 0))
    job_id = window.queue()
    qtbot.waitUntil(lambda: window.scene.node_items[sleeper].running, timeout=TIMEOUT_MS)
    taken.clear()
    qtbot.wait(20 * EVENTS_MS)
    assert 5 <= len(taken) <= 20 + 2  # about one batch per EVENTS_MS, not one per progress report
    assert max(len(batch) for batch in taken) <= 2  # the latest progress only (and a preview, if any)
    release_sleeper.set()
    qtbot.waitUntil(lambda: window.runs.statuses.get(job_id) == "finished", timeout=TIMEOUT_MS)
    assert [event.kind for event in taken[-1]][-1] == "job_finished"  # taken before the job's end is shown
    assert not window.scene.node_items[sleeper].running


SHOWN_CHILD = """
import json, sys
from PySide6.QtCore import QEvent, QObject, QTimer
from PySide6.QtWidgets import QApplication, QWidget
application = QApplication(sys.argv)


class ShownWatch(QObject):
    def eventFilter(self, watched, event):
        if event.type() == QEvent.Type.Paint and isinstance(watched, QWidget) \\
                and type(watched.window()).__name__ == "MainWindow" and watched.window().isVisible():
            application.removeEventFilter(self)
            print(json.dumps(sorted(name for name, module in sys.modules.items() if module is not None)))
            QTimer.singleShot(0, watched.window().close)
        return False


watch = ShownWatch()
application.installEventFilter(watch)
import app.cli
raise SystemExit(app.cli.main(["--output", sys.argv[1], "--models", sys.argv[2]]))
"""


def test_the_window_shows_before_any_library_only_a_run_needs_is_imported(tmp_path):
    """A fresh `sluice` (the desktop app) paints its window without importing networkx (the executor's, on
    the first Queue), spandrel, torchvision, diffusers or transformers."""
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "SLUICE_APP_DATA": str(tmp_path / "app-data"),
           "SLUICE_SETTINGS": str(tmp_path / "no-settings.json"), "SLUICE_AUTO_RESTORE": "0"}
    command = [sys.executable, "-c", SHOWN_CHILD, str(tmp_path / "out"), str(tmp_path / "models")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert "app.main_window" in loaded
    assert loaded.isdisjoint({"networkx", "spandrel", "torchvision", "diffusers", "transformers"}), \
        sorted(loaded & {"networkx", "spandrel", "torchvision", "diffusers", "transformers"})
