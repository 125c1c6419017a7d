"""Running workflows from the window on the engine's worker thread; every wait is on GUI-thread state."""

import sys
import threading

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

from app.main_window import install_excepthook
from engine.telemetry import bus

TIMEOUT_MS = 15000


def connect(scene, source, target, input_name):
    assert scene.connect_ports(scene.node_items[source].outputs[0],
                               scene.node_items[target].inputs[input_name])


def test_small_graph_runs_on_the_worker_and_its_image_shows_in_the_preview_and_gallery(
        make_window, qtbot, screenshot):
    window = make_window()
    scene = window.scene
    gradient = scene.add_node("GuiGradient", (0, 0))
    preview = scene.add_node("GuiPreview", (320, 0))
    number = scene.add_node("GuiNumber", (0, 260))
    sink = scene.add_node("GuiSink", (320, 260))
    connect(scene, gradient, preview, "image")
    connect(scene, number, sink, "value")
    scene.set_seed_control(number, "seed", "increment")
    window.view.fit_to_content()
    run_threads = []
    unsubscribe = bus.subscribe(lambda event: run_threads.append(threading.current_thread())
                                if event.kind == "node_started" else None)
    job_id = window.queue()
    assert job_id is not None
    qtbot.waitUntil(lambda: window.runs.statuses.get(job_id) == "finished", timeout=TIMEOUT_MS)
    unsubscribe()
    assert len(run_threads) == 4 and all(t is not threading.main_thread() for t in run_threads)
    image = scene.node_items[preview].image
    assert image is not None and (image.width(), image.height()) == (48, 48)
    pixel = image.pixelColor(47, 0)  # the top-right of a red-tinted gradient: red ramp at its end
    assert pixel.red() == 255 and pixel.blue() == 0
    assert len(window.gallery.paths()) == 1 and window.gallery.paths()[0].endswith(".png")
    thumbnail = window.gallery.item(0)
    window.gallery.copy_image(thumbnail)
    assert QApplication.clipboard().image().size() == image.size()
    dragged = window.gallery.mimeData([thumbnail])  # what a drag out of the gallery carries
    assert [url.toLocalFile() for url in dragged.urls()] == window.gallery.paths()
    assert scene.node_items[gradient].image is not None  # the step preview
    assert window.queue_panel.state_of(job_id) == "finished"
    # Control after generate advanced the seed as one undoable step.
    assert scene.workflow.nodes[number].widgets["seed"] == 8
    scene.undo_stack.undo()
    assert scene.workflow.nodes[number].widgets["seed"] == 7
    screenshot(window, "main_window_after_run.png")


def test_interrupt_stops_a_long_running_node(make_window, qtbot):
    window = make_window()
    scene = window.scene
    sleeper = scene.add_node("GuiSleep", (0, 0))
    job_id = window.queue()
    qtbot.waitUntil(lambda: scene.node_items[sleeper].running, timeout=TIMEOUT_MS)
    window.interrupt_action.trigger()
    qtbot.waitUntil(lambda: window.runs.statuses.get(job_id) == "interrupted", timeout=TIMEOUT_MS)
    assert not scene.node_items[sleeper].running
    assert window.status_label.text() == "Interrupted"


def test_pending_job_is_removed_from_the_queue_and_running_job_cancel_interrupts(make_window, qtbot):
    window = make_window()
    scene = window.scene
    sleeper = scene.add_node("GuiSleep", (0, 0))
    first = window.queue()
    qtbot.waitUntil(lambda: scene.node_items[sleeper].running, timeout=TIMEOUT_MS)
    second = window.queue()
    assert window.queue_panel.state_of(second) == "pending"
    window.queue_panel.cancel_requested.emit(second)
    assert window.queue_panel.state_of(second) == "cancelled"
    window.queue_panel.cancel_requested.emit(first)
    qtbot.waitUntil(lambda: window.runs.statuses.get(first) == "interrupted", timeout=TIMEOUT_MS)
    qtbot.wait(50)
    assert second not in {job.job_id for job in window.runs.worker.queue.pending()}
    assert window.runs.statuses.get(second) == "cancelled"


def test_event_loop_keeps_turning_while_the_worker_runs_a_node(make_window, qtbot, release_sleeper):
    window = make_window()
    scene = window.scene
    sleeper = scene.add_node("GuiSleep", (0, 0))
    ticks_while_running = []

    class Ticker:
        def tick(self):
            if scene.node_items[sleeper].running:
                ticks_while_running.append(1)
                if len(ticks_while_running) >= 10:
                    release_sleeper.set()

    ticker = Ticker()
    timer = QTimer()
    timer.setInterval(5)
    timer.timeout.connect(ticker.tick)
    timer.start()
    job_id = window.queue()
    qtbot.waitUntil(lambda: window.runs.statuses.get(job_id) == "finished", timeout=TIMEOUT_MS)
    timer.stop()
    assert len(ticks_while_running) >= 10  # the node only returned after ten GUI timer ticks


def test_invalid_graph_is_not_queued_and_every_invalid_node_is_marked(make_window, qtbot):
    window = make_window()
    scene = window.scene
    scale = scene.add_node("GuiScale", (0, 0))
    sink = scene.add_node("GuiSink", (320, 0))
    number = scene.add_node("GuiNumber", (0, 200))
    scene.set_widget(number, "value", 500)  # above the maximum 100
    assert window.queue() is None
    assert set(window.runs.node_errors) == {scale, sink, number}
    assert scene.node_items[sink].errors and "not connected" in scene.node_items[sink].errors[0]
    assert "above the maximum" in scene.node_items[number].errors[0]
    assert "above the maximum" in scene.node_items[number].toolTip()
    assert window.status_label.text().startswith("Not queued")
    scene.node_items[number].setSelected(True)
    messages = [label.text() for label in window.inspector.widget().findChildren(type(window.status_label))
                if label.objectName() == "errors"]
    assert any("above the maximum" in m for m in messages)


def test_failing_node_is_marked_with_its_message_and_the_app_keeps_running(make_window, qtbot, screenshot):
    window = make_window()
    scene = window.scene
    number = scene.add_node("GuiNumber", (0, 0))
    fail = scene.add_node("GuiFail", (320, 0))
    connect(scene, number, fail, "value")
    window.view.fit_to_content()
    job_id = window.queue()
    qtbot.waitUntil(lambda: window.runs.statuses.get(job_id) == "failed", timeout=TIMEOUT_MS)
    assert scene.node_items[fail].errors == ["RuntimeError: the test node failed on purpose"]
    assert "failed on purpose" in window.status_label.text()
    assert window.isVisible()
    screenshot(window, "main_window_node_failed.png")
    # The next job still runs on the same worker.
    scene.disconnect_input(fail, "value")
    sink = scene.add_node("GuiSink", (320, 200))
    connect(scene, number, sink, "value")
    scene.set_mode([fail], "muted")
    second = window.queue()
    qtbot.waitUntil(lambda: window.runs.statuses.get(second) == "finished", timeout=TIMEOUT_MS)
    assert scene.node_items[fail].errors == []


def test_gui_thread_exceptions_are_shown_not_fatal(make_window, monkeypatch):
    window = make_window()
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    install_excepthook(window)
    try:
        raise ValueError("boom in a slot")
    except ValueError:
        sys.excepthook(*sys.exc_info())
    assert "ValueError: boom in a slot" in window.status_label.text()
