"""The one engine thread of `sluice serve`: it takes prompts from the queue, runs each with the same Executor
as the CLI and the GUI (so cached nodes stay cached across prompts and loaded models stay loaded), and turns
the engine's events into ComfyUI's websocket messages.

Messages of a prompt, in ComfyUI's order: execution_start, execution_cached (the nodes whose cached result
is reused), then per node run executing, progress (and binary preview frames) and, for nodes that saved
images, executed; last execution_success, execution_error or execution_interrupted. The history entry is
recorded before the queue's `status` and the final `executing` with node null, so a client that sees the
latter finds the result in /history. A cached output node sends `executed` again with the images of its
last run, as ComfyUI does. As in ComfyUI, a prompt without a client_id sends its progress, previews and
interruption to every client and its other messages to none.
"""

from __future__ import annotations

import gc
import os
import struct
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from app.server.queue import PromptQueue, QueueItem
from engine import telemetry
from engine.graph.executor import Executor, JobResult
from engine.images import jpeg_bytes
from engine.settings import Settings
from nodes.image import preview_dir

PREVIEW_IMAGE = 1  # ComfyUI's BinaryEventTypes.PREVIEW_IMAGE
JPEG, PNG = 1, 2  # the image format word of a preview frame
SAVED_IMAGE_EVENTS = ("image_saved", "image_preview")  # SaveImage's and PreviewImage's bus events


class Engine(Protocol):
    """What the server runs its prompts with: this module's EngineThread, or the Ray workers of
    ray_backend.py (`sluice serve --ray`). It takes prompts from the server's queue and sends their
    messages."""

    def start(self) -> None: ...

    def stop(self, timeout: float = 30.0) -> None: ...

    def interrupt(self, prompt_id: str | None = None) -> bool: ...

    def executing(self) -> tuple[str | None, str | None, str | None]: ...


class MessageSink(Protocol):
    """Where the engine thread's messages go (the server; thread-safe). `sid` None means every client."""

    def send(self, event: str, data: dict[str, Any], sid: str | None) -> None: ...

    def send_bytes(self, payload: bytes, sid: str | None) -> None: ...

    def wants_bytes(self, sid: str | None) -> bool: ...


def preview_frame(image: Any) -> bytes:
    """ComfyUI's binary preview message of a frame (a PIL image or an array)."""
    return preview_message(jpeg_bytes(image))


def preview_message(jpeg: bytes) -> bytes:
    """ComfyUI's binary preview message: event 1, image format 1 (JPEG) as big-endian words, then the JPEG."""
    return struct.pack(">II", PREVIEW_IMAGE, JPEG) + jpeg


def image_ref(path: str, folders: dict[str, str]) -> dict[str, str] | None:
    """{"filename", "subfolder", "type"} of a saved file inside one of `folders` (type -> real path)."""
    real = os.path.realpath(path)
    for type_name, folder in folders.items():
        if real.startswith(folder.rstrip(os.sep) + os.sep):
            relative = Path(os.path.relpath(real, folder))
            subfolder = relative.parent.as_posix()
            return {"filename": relative.name, "subfolder": "" if subfolder == "." else subfolder,
                    "type": type_name}
    return None


def history_entry(item: QueueItem, outputs: dict, success: bool, messages: list) -> dict[str, Any]:
    """A finished prompt's /history entry, in ComfyUI's shape."""
    meta = {node_id: {"node_id": node_id, "display_node": node_id, "parent_node": None,
                      "real_node_id": node_id} for node_id in outputs}
    return {"prompt": item.as_list(), "outputs": outputs,
            "status": {"status_str": "success" if success else "error", "completed": success,
                       "messages": messages},
            "meta": meta}


@dataclass
class _Job:
    item: QueueItem
    executed: list[str] = field(default_factory=list)
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)  # node id -> ComfyUI's ui output
    messages: list[list[Any]] = field(default_factory=list)  # [event, data] for the history's status
    images: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # node id -> saved so far
    current_node: str | None = None
    interrupted_at: str | None = None


class EngineThread(threading.Thread):
    def __init__(self, queue: PromptQueue, executor: Executor, sink: MessageSink, settings: Settings,
                 bus: telemetry.EventBus | None = None) -> None:
        super().__init__(name="sluice-engine", daemon=True)
        self.queue = queue
        self.executor = executor
        self.sink = sink
        self.settings = settings
        self.bus = bus if bus is not None else telemetry.bus
        self._job: _Job | None = None
        self._lock = threading.Lock()
        self._interrupt_requested = False
        self._ui_cache: dict[str, dict[str, Any]] = {}  # node id -> ui output of its last run
        self._folders: dict[str, str] = {}

    # -- other threads --

    def interrupt(self, prompt_id: str | None = None) -> bool:
        """Stop the running prompt (only if it is `prompt_id`, when given) within a step; False if none."""
        with self._lock:
            job = self._job
            if job is None or (prompt_id is not None and job.item.prompt_id != prompt_id):
                return False
            self._interrupt_requested = True
        self.executor.interrupt()
        return True

    def executing(self) -> tuple[str | None, str | None, str | None]:
        """(client id, prompt id, node id) of the node running now, Nones when idle."""
        with self._lock:
            job = self._job
            if job is None:
                return None, None, None
            return job.item.client_id, job.item.prompt_id, job.current_node

    def stop(self, timeout: float = 30.0) -> None:
        self.queue.close()
        self.executor.interrupt()
        self.join(timeout)

    # -- the engine thread --

    def run(self) -> None:
        unsubscribe = self.bus.subscribe(self._on_event)
        try:
            while True:
                item = self.queue.take()
                if self.queue.closed:
                    break
                if item is not None:
                    self._run(item)
                self._apply_flags(self.queue.take_flags())
        finally:
            unsubscribe()

    def _run(self, item: QueueItem) -> None:
        self._folders = {"output": os.path.realpath(self.settings.output_dir),
                         "temp": os.path.realpath(preview_dir())}
        job = _Job(item)
        with self._lock:
            self._job = job
            self._interrupt_requested = False
        try:
            result = self.executor.run(item.workflow, item.prompt_id)
        except Exception as error:  # an engine bug must not end the thread
            result = JobResult(item.prompt_id, "failed")
            self._add_message(job, "execution_error", self._error_data(
                job, job.current_node, type(error).__name__, str(error), traceback.format_exc()), False)
        else:
            self._report_end(job, result)
        entry = history_entry(item, job.outputs, result.status == "finished", job.messages)
        with self._lock:
            self._job = None
        self.queue.finish(item, entry)
        if item.client_id is not None:
            self.sink.send("executing", {"node": None, "prompt_id": item.prompt_id}, item.client_id)

    def _report_end(self, job: _Job, result: JobResult) -> None:
        if result.status == "finished":
            self._add_message(job, "execution_success", {"prompt_id": job.item.prompt_id}, False)
        elif result.status == "interrupted":
            node_id = job.interrupted_at or job.current_node
            self._add_message(job, "execution_interrupted", {
                "prompt_id": job.item.prompt_id, "node_id": node_id,
                "node_type": self._node_type(job, node_id), "executed": list(job.executed)}, True)
        elif result.status == "failed" and result.failure is not None:
            failure = result.failure
            self._add_message(job, "execution_error", self._error_data(
                job, failure.node_id, failure.exception_type, failure.message, failure.traceback), False)
        else:  # invalid: a model file went away between POST /prompt and the run
            problem = result.errors[0] if result.errors else None
            message = "; ".join(str(error) for error in result.errors) or f"job {result.status}"
            self._add_message(job, "execution_error", self._error_data(
                job, problem.node_id if problem else None, "ValidationError", message, ""), False)

    def _error_data(self, job: _Job, node_id: str | None, exception_type: str, message: str,
                    trace: str) -> dict[str, Any]:
        node = job.item.workflow.nodes.get(node_id) if node_id is not None else None
        inputs = {name: [repr(value)[:200]] for name, value in node.widgets.items()} if node else {}
        return {"prompt_id": job.item.prompt_id, "node_id": node_id,
                "node_type": self._node_type(job, node_id), "executed": list(job.executed),
                "exception_message": message, "exception_type": exception_type,
                "traceback": trace.splitlines(keepends=True), "current_inputs": inputs,
                "current_outputs": sorted(self.executor.cached_node_ids())}

    @staticmethod
    def _node_type(job: _Job, node_id: str | None) -> str | None:
        node = job.item.workflow.nodes.get(node_id) if node_id is not None else None
        return node.type if node is not None else None

    def _add_message(self, job: _Job, event: str, data: dict[str, Any], broadcast: bool) -> None:
        """ComfyUI's add_message: timestamped, kept for the history, sent to the prompt's client (or to
        every client when `broadcast` and the prompt has none)."""
        data = {**data, "timestamp": int(time.time() * 1000)}
        job.messages.append([event, data])
        if job.item.client_id is not None or broadcast:
            self.sink.send(event, data, job.item.client_id)

    def _on_event(self, event: telemetry.Event) -> None:
        job = self._job
        if job is None or threading.current_thread() is not self:
            return
        kind = event.kind
        if kind in SAVED_IMAGE_EVENTS:
            ref = image_ref(str(event.get("path")), self._folders)
            if ref is not None:
                job.images.setdefault(str(event.get("node_id")), []).append(ref)
            return
        if event.get("job_id") != job.item.prompt_id:
            return
        client_id, prompt_id = job.item.client_id, job.item.prompt_id
        node_id = event.get("node_id")
        if kind == "job_started":
            if self._interrupt_requested:  # asked for between the prompt's start and the executor's
                self.executor.interrupt()
            self._add_message(job, "execution_start", {"prompt_id": prompt_id}, False)
            self._add_message(job, "execution_cached", {"nodes": list(event.get("cached", [])),
                                                        "prompt_id": prompt_id}, False)
        elif kind == "node_started":
            with self._lock:
                job.current_node = node_id
            if client_id is not None:
                self.sink.send("executing", {"node": node_id, "display_node": node_id,
                                             "prompt_id": prompt_id}, client_id)
        elif kind == "progress":
            self.sink.send("progress", {"value": event.get("value"), "max": event.get("max"),
                                        "prompt_id": prompt_id, "node": node_id}, client_id)
        elif kind == "preview" and event.get("image") is not None and self.sink.wants_bytes(client_id):
            try:
                self.sink.send_bytes(preview_frame(event.get("image")), client_id)
            except (ValueError, TypeError, OSError):
                pass  # a frame that is not an image: no preview
        elif kind == "node_finished":
            job.executed.append(node_id)
            images = job.images.pop(node_id, None)
            if images:
                self._ui_cache[node_id] = job.outputs[node_id] = {"images": images}
                self._send_executed(job, node_id)
            else:
                self._ui_cache.pop(node_id, None)
        elif kind == "node_cached" and node_id in self._ui_cache:
            job.outputs[node_id] = self._ui_cache[node_id]
            self._send_executed(job, node_id)
        elif kind == "job_interrupted":
            job.interrupted_at = node_id

    def _send_executed(self, job: _Job, node_id: str) -> None:
        if job.item.client_id is not None:
            self.sink.send("executed", {"node": node_id, "display_node": node_id,
                                        "output": job.outputs[node_id], "prompt_id": job.item.prompt_id},
                           job.item.client_id)

    def _apply_flags(self, flags: dict[str, Any]) -> None:
        """POST /free's requests, between prompts: drop the cached results (and the models they hold)."""
        free_memory = bool(flags.get("free_memory", False))
        if flags.get("unload_models", free_memory) or free_memory:
            self.executor.clear_cache()
            self._ui_cache.clear()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
