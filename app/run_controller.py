"""Queueing and watching runs: validate and mark invalid nodes, hand workflow copies to the engine worker,
and show what its events say (node progress and previews, overall progress, errors, output images).

Seeds: as in ComfyUI, control-after-generate is applied to the document right after a job is queued (the job
keeps the seeds it was queued with), through the undo stack (one "Advance seeds" step), so the next Queue runs
new seeds, undo brings back the seed of a run one liked, and the title shows '*'.

A job runs the document with the settings file's default memory settings under its own (engine/settings.py).
A failed node is reported by `node_failed(title, message, traceback)` for the window's dialog.

Where jobs run is the settings file's queue target (app/queue_target.py): this machine's EngineWorker, or a
ServerWorker that sends them to a running `sluice serve` (where the server's memory settings apply). A new
target applies to the jobs queued once no job runs or waits: the jobs already queued finish where they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QObject, QTimer, Signal, Slot
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QMessageBox, QProgressBar, QWidget

from app.canvas.commands import SetEntryCommand
from app.canvas.scene import WorkflowScene
from app.gui_words import gui_message
from app.inspector import Inspector
from app.panels import GalleryList, QueuePanel
from app.queue_target import QueueTarget, queue_target
from app.worker import EngineWorker
from engine.graph.executor import JobResult, advance_seeds
from engine.graph.job_guard import slow_job_warnings
from engine.graph.validate import validate
from engine.settings import with_memory_defaults
from engine.telemetry import Event
from nodes.registry import NodeRegistry

if TYPE_CHECKING:
    from app.server_worker import ServerWorker

IMAGE_EVENTS = ("image_saved", "image_preview")
PROGRESS_BAR_MS = 100  # the overall progress bar moves at most this often (see _set_progress)
EVENTS_MS = 60  # the window takes the engine's events at most this often while a job runs (app/worker.py)


class RunController(QObject):
    """Lives in the GUI thread; every worker signal arrives at one of its @Slot methods."""

    job_done = Signal(str, str)  # job id, status: a GUI-thread relay of the worker's job_finished
    node_failed = Signal(str, str, str)  # node title, "ExceptionType: message", traceback
    busy_changed = Signal(bool)  # a job started while none ran (True); the last job ended (False)
    target_changed = Signal()  # the jobs queued from now run on `target`, a new one

    def __init__(self, scene: WorkflowScene, registry: NodeRegistry, settings: Any, queue_panel: QueuePanel,
                 gallery: GalleryList, inspector: Inspector, progress_bar: QProgressBar,
                 show_message: Callable[[str], None], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.scene = scene
        self.registry = registry
        self.settings = settings
        self.queue_panel = queue_panel
        self.gallery = gallery
        self.inspector = inspector
        self.progress_bar = progress_bar
        self.show_message = show_message
        self.labels: dict[str, str] = {}
        self.statuses: dict[str, str] = {}  # job id -> final status
        self.node_errors: dict[str, list[str]] = {}
        self._node_count = 0
        self._done = 0
        self._job_number = 0
        self._busy = False  # what busy_changed last said
        self._progress_value = 0
        self._progress_timer = QTimer(self, singleShot=True, interval=PROGRESS_BAR_MS)
        self._progress_timer.timeout.connect(self._show_progress)
        self._events_timer = QTimer(self, singleShot=True, interval=EVENTS_MS)
        self._events_timer.timeout.connect(self.take_events)
        self.target = queue_target(settings)
        self.worker = self._start_worker(self.target)
        queue_panel.cancel_requested.connect(self.cancel)

    def _start_worker(self, target: QueueTarget) -> EngineWorker | ServerWorker:
        if target.server is None:
            worker = EngineWorker(self.registry.get, self.settings)
        else:
            from app.server_worker import ServerWorker  # aiohttp: only for a queue on a server

            worker = ServerWorker(target.server, target.sent_token(), self.registry.get, self.settings)
        worker.relay.events_ready.connect(self.on_events_ready)
        worker.job_started.connect(self.on_job_started)
        worker.job_finished.connect(self.on_job_finished)
        worker.start()
        return worker

    def apply_queue_target(self) -> None:
        """Take the settings' queue target: now when no job runs or waits, else once the queue empties."""
        if queue_target(self.settings) != self.target and not self.busy():
            self._switch_worker()

    def _switch_worker(self) -> None:
        old = self.worker
        old.relay.events_ready.disconnect(self.on_events_ready)
        old.job_started.disconnect(self.on_job_started)
        old.job_finished.disconnect(self.on_job_finished)
        old.stop()
        self.target = queue_target(self.settings)
        self.worker = self._start_worker(self.target)
        self.target_changed.emit()

    # -- commands from the window --

    def queue_workflow(self) -> str | None:
        """Validate the document; mark every invalid node, or queue a copy and return its job id."""
        errors = validate(self.scene.workflow, self.registry.get)
        self.node_errors = {}
        for error in errors:
            if error.node_id is not None and error.node_id in self.scene.workflow.nodes:
                where = f"{error.input_name}: " if error.input_name else ""
                self.node_errors.setdefault(error.node_id, []).append(gui_message(where + error.message))
        self._show_errors()
        if errors:
            self.show_message(gui_message(f"Not queued: {len(errors)} problem(s); first: {errors[0]}"))
            return None
        slow = slow_job_warnings(self.scene.workflow)
        if slow and not self.confirm_slow_job(slow):
            self.show_message("Not queued: the job would take long (" + "; ".join(slow) + ")")
            return None
        self._job_number += 1
        label = f"Job {self._job_number}"
        job = self.scene.workflow.copy()
        memory = with_memory_defaults(job.settings.get("memory"), self.settings)
        if memory:
            job.settings["memory"] = memory
        job_id = self.worker.submit(job, label)
        self.labels[job_id] = label
        self.queue_panel.set_job(job_id, label, "pending")
        self.show_message(f"{label} queued" + (f" on {self.target.describe()}" if self.target.server else ""))
        self._advance_seeds()
        return job_id

    def confirm_slow_job(self, warnings: list[str]) -> bool:
        """Ask before queueing a job with steps, sizes or a batch beyond what finishes in reasonable time
        (engine/graph/job_guard.py's slow_job_warnings); No is the default button."""
        parent = self.parent() if isinstance(self.parent(), QWidget) else None
        text = "This job may take a very long time:\n\n" + "\n".join(f"- {w}" for w in warnings) + \
            "\n\nRun it anyway?"
        buttons = QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No
        return QMessageBox.question(parent, "Run a long job?", text, buttons,
                                    QMessageBox.StandardButton.No) == QMessageBox.StandardButton.Yes

    def busy(self) -> bool:
        """Whether a job runs or waits in the queue."""
        return self.worker.running_job_id is not None or bool(self.worker.queue.pending())

    @Slot(str)
    def cancel(self, job_id: str) -> None:
        if self.worker.queue.remove(job_id):
            self.queue_panel.set_job(job_id, self.labels.get(job_id, job_id), "cancelled")
            self.statuses[job_id] = "cancelled"
        else:
            self.worker.cancel(job_id)

    def interrupt(self) -> None:
        if self.worker.running_job_id is not None:
            self.worker.interrupt()
            self.show_message("Interrupting...")

    def shutdown(self) -> None:
        if self.worker.isRunning():
            self.worker.stop()

    # -- worker signals (queued into the GUI thread) --

    @Slot(str)
    def on_job_started(self, job_id: str) -> None:
        self.queue_panel.set_job(job_id, self.labels.get(job_id, job_id), "running")
        if not self._busy:
            self._busy = True
            self.busy_changed.emit(True)

    @Slot(str, str, object)
    def on_job_finished(self, job_id: str, status: str, result: JobResult) -> None:
        self.take_events()  # the job's last events first
        self.statuses[job_id] = status
        self.queue_panel.set_job(job_id, self.labels.get(job_id, job_id), status)
        self.scene.clear_run_state()
        if status == "invalid":
            self.node_errors = {}
            for error in result.errors:
                if error.node_id in self.scene.workflow.nodes:
                    self.node_errors.setdefault(error.node_id, []).append(gui_message(error.message))
            self._show_errors()
        self.job_done.emit(job_id, status)
        if self._busy and not self.worker.queue.pending():
            self._busy = False
            self.busy_changed.emit(False)
        if not self.worker.queue.pending():
            self.apply_queue_target()  # a target chosen while jobs ran

    @Slot()
    def on_events_ready(self) -> None:
        """The relay has events: take them a moment later, so that a fast job's progress and previews are
        drawn a few times a second, not once per step (each drawing is time the GUI thread takes from the
        engine)."""
        if not self._events_timer.isActive():
            self._events_timer.start()

    @Slot()
    def take_events(self) -> None:
        self._events_timer.stop()
        for event in self.worker.relay.take_events():
            self.on_event(event)

    def on_event(self, event: Event) -> None:
        handler = getattr(self, f"_on_{event.kind}", None)
        if handler is not None:
            handler(event)
        elif event.kind in IMAGE_EVENTS:
            self._on_image(event)

    # -- event handlers --

    def _on_job_started(self, event: Event) -> None:
        self._node_count = max(1, int(event.get("node_count", 0) or 0))
        self._done = 0
        self.node_errors = {}
        self._show_errors()
        self.progress_bar.setRange(0, 100 * self._node_count)
        self._progress_timer.stop()
        self.progress_bar.setValue(0)
        self.progress_bar.setVisible(True)

    def _title(self, node_id: str) -> str:
        item = self.scene.node_items.get(node_id)
        return item.title_text() if item is not None else f"node {node_id}"

    def _on_node_started(self, event: Event) -> None:
        self.scene.set_node_running(event["node_id"], True)
        self.show_message(f"Running {self._title(event['node_id'])}")

    def _on_node_cached(self, event: Event) -> None:
        self._advance_overall(1.0)

    def _on_node_finished(self, event: Event) -> None:
        self.scene.set_node_running(event["node_id"], False)
        self._advance_overall(1.0)

    def _advance_overall(self, amount: float) -> None:
        self._done += amount
        self._set_progress(int(100 * self._done))

    def _set_progress(self, value: int) -> None:
        """QProgressBar.setValue repaints the whole window synchronously when the bar visibly moves, so the
        bar follows the job through a timer instead of once per event."""
        self._progress_value = value
        if not self._progress_timer.isActive():
            self._progress_timer.start()

    @Slot()
    def _show_progress(self) -> None:
        self.progress_bar.setValue(self._progress_value)

    def _on_progress(self, event: Event) -> None:
        value, maximum = int(event.get("value", 0)), int(event.get("max", 0) or 0)
        self.scene.set_node_running(event["node_id"], True, (value, maximum))
        if maximum > 0:
            self._set_progress(int(100 * (self._done + min(1.0, value / maximum))))

    def _on_preview(self, event: Event) -> None:
        image = event.get("image")
        if isinstance(image, QImage):
            self.scene.set_node_image(event["node_id"], image)

    def _on_image(self, event: Event) -> None:
        path = event.get("path")
        if path is None:
            return
        image = QImage(str(path))
        node_id = event.get("node_id")
        if not image.isNull() and node_id is not None:
            self.scene.set_node_image(str(node_id), image)
        self.gallery.add_image(str(path))

    def _on_node_failed(self, event: Event) -> None:
        node_id = event["node_id"]
        message = gui_message(f"{event.get('exception_type')}: {event.get('message')}")
        self.node_errors = {node_id: [message]}
        self._show_errors()
        self.show_message(f"{self._title(node_id)} failed: {message}")
        self.node_failed.emit(self._title(node_id), message, str(event.get("traceback") or ""))

    def _on_job_interrupted(self, event: Event) -> None:
        self.show_message("Interrupted")

    def _on_job_error(self, event: Event) -> None:
        where = "Engine error" if self.target.server is None else "Queue error"
        self.show_message(f"{where}: {event.get('message')}")
        self.queue_panel.set_job_note(str(event.get("job_id")), str(event.get("message")))

    def _on_job_finished(self, event: Event) -> None:
        status = event.get("status")
        seconds = event.get("seconds") or 0.0
        self.progress_bar.setVisible(False)
        if status == "finished":
            self.show_message(f"Finished in {seconds:.1f} s")
        elif status == "invalid":
            self.show_message("Not run: the workflow is invalid")

    def _show_errors(self) -> None:
        self.scene.set_node_errors(self.node_errors)
        self.inspector.set_messages(self.node_errors)

    def _advance_seeds(self) -> None:
        """Control after generate (right after queueing, as ComfyUI), applied to the document as one step."""
        changes = advance_seeds(self.scene.workflow.copy(), self.registry.get)
        if not changes:
            return
        stack = self.scene.undo_stack
        stack.beginMacro("Advance seeds")
        for node_id, seeds in changes.items():
            for name, seed in seeds.items():
                stack.push(SetEntryCommand(self.scene, node_id, "widgets", name, seed))
        stack.endMacro()
