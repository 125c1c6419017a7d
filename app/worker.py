"""The engine thread: one long-lived QThread owning the Executor and draining a queue of jobs (workflow
copies). Bus events reach the GUI through EventRelay, a QObject of the GUI thread whose signal, emitted on the
worker thread, is delivered queued to @Slot methods of GUI objects.

The GUI thread must stay cheap while a job runs: the engine releases the GIL around every torch operation and
waits for it again afterwards, so each moment the GUI thread spends in Python can stall the engine by up to
the interpreter's switch interval, once per operation (the convoy effect: 5 ms by default, against operations
of tens of microseconds). The worker therefore shortens the switch interval (ENGINE_SWITCH_INTERVAL), and the
relay hands the GUI only the events it shows, in batches: one queued signal per batch however fast events
come, with progress and previews reduced to the latest of each node.
"""

from __future__ import annotations

import sys
import threading
import traceback
import uuid
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal

from app.images import to_qimage
from engine import telemetry
from engine.graph.document import Workflow
from engine.graph.executor import Executor, JobResult, Lookup

ENGINE_SWITCH_INTERVAL = 0.0002  # seconds; Python's default 0.005 lets a busy GUI thread stall the engine
GUI_EVENTS = frozenset({  # what the window shows of a job; the memory panel reads the bus itself
    "job_started", "node_started", "node_cached", "node_finished", "progress", "preview", "image_saved",
    "image_preview", "node_failed", "job_interrupted", "job_error", "job_finished"})
LATEST_ONLY = ("progress", "preview")  # a batch keeps only the newest of these per node


@dataclass
class Job:
    job_id: str
    workflow: Workflow  # a copy taken when the job was queued
    label: str


class JobQueue:
    """A thread-safe FIFO of jobs from which pending jobs can be removed; `close` ends `take`."""

    def __init__(self) -> None:
        self._jobs: list[Job] = []
        self._closed = False
        self._condition = threading.Condition()

    def put(self, job: Job) -> None:
        with self._condition:
            self._jobs.append(job)
            self._condition.notify()

    def take(self) -> Job | None:
        """The next job, waiting for one; None once the queue is closed."""
        with self._condition:
            while not self._jobs and not self._closed:
                self._condition.wait()
            return None if self._closed else self._jobs.pop(0)

    def remove(self, job_id: str) -> bool:
        with self._condition:
            before = len(self._jobs)
            self._jobs = [job for job in self._jobs if job.job_id != job_id]
            return len(self._jobs) != before

    def pending(self) -> list[Job]:
        with self._condition:
            return list(self._jobs)

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()


class EventRelay(QObject):
    """Subscribed to the bus; collects the GUI_EVENTS of its worker's jobs and announces them with
    `events_ready()`, once until the GUI has taken them (`take_events`), so a burst of events costs the GUI
    thread one slot call. Of progress and previews only the newest per node is kept.

    Preview images are converted to QImages on the worker thread, so the GUI only draws them.
    """

    events_ready = Signal()

    def __init__(self, bus: telemetry.EventBus, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.current_job_id: str | None = None
        self._lock = threading.Lock()
        self._pending: list[telemetry.Event] = []
        self._announced = False
        self._unsubscribe = bus.subscribe(self._on_event)

    def close(self) -> None:
        self._unsubscribe()

    def take_events(self) -> list[telemetry.Event]:
        """The events collected since the last call, in order (GUI thread)."""
        with self._lock:
            events, self._pending, self._announced = self._pending, [], False
        return events

    def _on_event(self, event: telemetry.Event) -> None:
        job_id = event.get("job_id")
        current = self.current_job_id
        if current is None or (job_id is not None and job_id != current) or event.kind not in GUI_EVENTS:
            return  # another window's job, an event outside any job, or one the window does not show
        if event.kind == "preview" and event.get("image") is not None:
            try:
                image = to_qimage(event.get("image"))
            except (ValueError, TypeError):
                return
            event = telemetry.Event(event.kind, event.time, {**event.fields, "image": image})
        with self._lock:
            self._add(event)
            announce, self._announced = not self._announced, True
        if announce:
            self.events_ready.emit()

    def _add(self, event: telemetry.Event) -> None:
        if event.kind in LATEST_ONLY:
            node_id = event.get("node_id")
            for index, pending in enumerate(self._pending):
                if pending.kind == event.kind and pending.get("node_id") == node_id:
                    self._pending[index] = event
                    return
        self._pending.append(event)


class EngineWorker(QThread):
    """Runs queued jobs one at a time; `job_started` and `job_finished` are emitted on the worker thread."""

    job_started = Signal(str)
    job_finished = Signal(str, str, object)  # job id, status, JobResult

    def __init__(self, lookup: Lookup, settings: Any, bus: telemetry.EventBus | None = None,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.bus = bus if bus is not None else telemetry.bus
        self.executor = Executor(lookup, self.bus, settings)
        self.queue = JobQueue()
        self.relay = EventRelay(self.bus)
        self.running_job_id: str | None = None

    def submit(self, workflow: Workflow, label: str) -> str:
        """Queue a copy of `workflow`; returns the job id."""
        job = Job(uuid.uuid4().hex[:12], workflow.copy(), label)
        self.queue.put(job)
        return job.job_id

    def cancel(self, job_id: str) -> bool:
        """Remove a pending job, or interrupt it when it is the running one."""
        if self.queue.remove(job_id):
            return True
        if job_id == self.running_job_id:
            self.executor.interrupt()
            return True
        return False

    def interrupt(self) -> None:
        if self.running_job_id is not None:
            self.executor.interrupt()

    def stop(self) -> None:
        """Interrupt the running job, drop the pending ones and end the thread."""
        self.queue.close()
        self.interrupt()
        self.wait()
        self.relay.close()

    def run(self) -> None:
        previous = sys.getswitchinterval()
        sys.setswitchinterval(ENGINE_SWITCH_INTERVAL)  # process-wide while the thread lives (see above)
        try:
            self._drain()
        finally:
            sys.setswitchinterval(previous)

    def _drain(self) -> None:
        while (job := self.queue.take()) is not None:
            self.running_job_id = job.job_id
            self.relay.current_job_id = job.job_id
            self.job_started.emit(job.job_id)
            try:
                result = self.executor.run(job.workflow, job.job_id)
            except Exception as error:  # an engine bug must not end the thread
                result = JobResult(job.job_id, "failed")
                self.bus.publish("job_error", job_id=job.job_id, message=f"{type(error).__name__}: {error}",
                                 traceback=traceback.format_exc())
            self.relay.current_job_id = None
            self.running_job_id = None
            self.job_finished.emit(job.job_id, result.status, result)
