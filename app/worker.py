"""The engine thread: one long-lived QThread owning the Executor and draining a queue of jobs (workflow
copies). Bus events reach the GUI through EventRelay, a QObject of the GUI thread whose signal, emitted on
the worker thread, is delivered queued to @Slot methods of GUI objects."""

from __future__ import annotations

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
    """Subscribed to the bus; forwards the events of its worker's jobs as `event_received(Event)`.

    Preview images are converted to QImages on the worker thread, so the GUI only draws them.
    """

    event_received = Signal(object)

    def __init__(self, bus: telemetry.EventBus, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.current_job_id: str | None = None
        self._unsubscribe = bus.subscribe(self._on_event)

    def close(self) -> None:
        self._unsubscribe()

    def _on_event(self, event: telemetry.Event) -> None:
        job_id = event.get("job_id")
        current = self.current_job_id
        if current is None or (job_id is not None and job_id != current):
            return  # another window's job, or an event outside any job
        if event.kind == "preview" and event.get("image") is not None:
            try:
                image = to_qimage(event.get("image"))
            except (ValueError, TypeError):
                return
            event = telemetry.Event(event.kind, event.time, {**event.fields, "image": image})
        self.event_received.emit(event)


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
