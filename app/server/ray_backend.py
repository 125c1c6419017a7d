"""`sluice serve --ray ADDRESS`: the server's prompts run on Ray workers (engine/cluster) instead of its one
engine thread; the routes, the queue and the history are the same.

RayEngine, one thread, takes a prompt from the queue whenever a worker is free (each worker runs one prompt at
a time, so the queue's running prompts are those on workers), gives it to the cluster's Scheduler (placement
by model and budget, retries when a worker dies) and turns its outcome into ComfyUI's messages. A worker
reports a prompt when it ends, so the messages come in ComfyUI's order but not live: execution_start when a
worker is given the prompt; when it ends, execution_cached, executing for each node that ran, executed for
each node that saved images (written first into the server's output folder, under a fresh name, so /view
serves them), then execution_success, execution_error or execution_interrupted, the history entry, the
queue's status and executing with node null. No progress messages or preview frames come from workers, and
PreviewImage's images stay on them. POST /free clears every worker's cache; POST /interrupt reaches the
worker that runs the prompt.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from app.server.engine_thread import MessageSink, image_ref
from app.server.queue import PromptQueue, QueueItem
from engine.cluster.output import write_image
from engine.cluster.scheduler import Job, Outcome, Scheduler, model_keys
from engine.settings import Settings


@dataclass
class _Prompt:
    item: QueueItem
    job: Job
    messages: list[list[Any]] = field(default_factory=list)  # [event, data] for the history's status
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)  # node id -> ComfyUI's ui output
    executed: list[str] = field(default_factory=list)


class RayEngine(threading.Thread):
    def __init__(self, queue: PromptQueue, sink: MessageSink, settings: Settings, lookup: Any,
                 workers: list[Any], retries: int = 2) -> None:
        super().__init__(name="sluice-ray-engine", daemon=True)
        self.queue = queue
        self.sink = sink
        self.settings = settings
        self.lookup = lookup
        self.scheduler = Scheduler(workers, retries=retries, depth=1)
        self._prompts: dict[int, _Prompt] = {}  # job index -> prompt, given to the scheduler
        self._lock = threading.Lock()
        self._interrupts: list[int | None] = []  # job indexes (None: every running one) to interrupt
        self._numbers = itertools.count()
        self._ui_cache: dict[tuple[str, str], dict[str, Any]] = {}  # (worker, node id) -> its last ui output

    # -- other threads --

    def interrupt(self, prompt_id: str | None = None) -> bool:
        """Interrupt the prompt `prompt_id` (every running one when None); False when none runs."""
        with self._lock:
            indexes = [index for index, prompt in self._prompts.items()
                       if prompt_id is None or prompt.item.prompt_id == prompt_id]
            if not indexes:
                return False
            self._interrupts.extend([None] if prompt_id is None else indexes)
        return True

    def executing(self) -> tuple[str | None, str | None, str | None]:
        """(client id, prompt id, None) of the prompt given to a worker last: a worker does not say which node
        it runs."""
        with self._lock:
            if not self._prompts:
                return None, None, None
            item = self._prompts[max(self._prompts)].item
            return item.client_id, item.prompt_id, None

    def stop(self, timeout: float = 30.0) -> None:
        self.queue.close()
        self.interrupt()
        self.join(timeout)

    # -- the thread --

    def run(self) -> None:
        scheduler = self.scheduler
        while not self.queue.closed:
            if scheduler.has_room():
                item = self.queue.take(timeout=0.0 if scheduler.busy() else None)
                flags = self.queue.take_flags()
                if flags.get("unload_models") or flags.get("free_memory"):
                    for worker in scheduler.workers:
                        worker.handle.free.remote()
                if item is not None:
                    self._start(item)
                    continue  # fill every free worker before waiting
            with self._lock:
                interrupts, self._interrupts = self._interrupts, []
            for index in interrupts:
                scheduler.interrupt_job(index)
            for outcome in scheduler.step(timeout=0.1):
                self._finish(outcome)
        scheduler.interrupt()  # the server stops: so do the prompts on workers

    def _start(self, item: QueueItem) -> None:
        job = Job(next(self._numbers), item.workflow.dumps(),
                  model_keys=model_keys(item.workflow, self.lookup, self.settings))
        prompt = _Prompt(item, job)
        with self._lock:
            self._prompts[job.index] = prompt
        self._add_message(prompt, "execution_start", {"prompt_id": item.prompt_id}, False)
        self.scheduler.add(job)

    def _finish(self, outcome: Outcome) -> None:
        with self._lock:
            prompt = self._prompts.pop(outcome.job.index)
        item = prompt.item
        self._replay(prompt, outcome)
        self._report_end(prompt, outcome)
        success = outcome.status == "finished"
        meta = {node_id: {"node_id": node_id, "display_node": node_id, "parent_node": None,
                          "real_node_id": node_id} for node_id in prompt.outputs}
        entry = {"prompt": item.as_list(), "outputs": prompt.outputs,
                 "status": {"status_str": "success" if success else "error", "completed": success,
                            "messages": prompt.messages},
                 "meta": meta}
        self.queue.finish(item, entry)
        if item.client_id is not None:
            self.sink.send("executing", {"node": None, "prompt_id": item.prompt_id}, item.client_id)

    def _replay(self, prompt: _Prompt, outcome: Outcome) -> None:
        """The worker's events as ComfyUI's messages; its images are written into the output folder."""
        item, data = prompt.item, dict(outcome.images)
        folders = {"output": os.path.realpath(self.settings.output_dir)}
        saved: dict[str, list[dict[str, str]]] = {}
        for event in outcome.events:
            kind, node_id = event["kind"], event.get("node_id")
            if kind == "job_started":
                self._add_message(prompt, "execution_cached", {"nodes": event.get("cached", []),
                                                               "prompt_id": item.prompt_id}, False)
            elif kind == "node_started" and item.client_id is not None:
                self.sink.send("executing", {"node": node_id, "display_node": node_id,
                                             "prompt_id": item.prompt_id}, item.client_id)
            elif kind == "image_saved" and event.get("name") in data:
                path = write_image(self.settings, event["name"], data[event["name"]], {})
                ref = image_ref(str(path), folders)
                if ref is not None:
                    saved.setdefault(str(node_id), []).append(ref)
            elif kind == "node_finished":
                prompt.executed.append(node_id)
                images = saved.pop(str(node_id), None)
                if images:
                    self._ui_cache[outcome.worker, node_id] = prompt.outputs[node_id] = {"images": images}
                    self._send_executed(prompt, node_id)
                else:
                    self._ui_cache.pop((outcome.worker, node_id), None)
            elif kind == "node_cached" and (outcome.worker, node_id) in self._ui_cache:
                prompt.outputs[node_id] = self._ui_cache[outcome.worker, node_id]
                self._send_executed(prompt, node_id)

    def _report_end(self, prompt: _Prompt, outcome: Outcome) -> None:
        prompt_id = prompt.item.prompt_id
        if outcome.status == "finished":
            self._add_message(prompt, "execution_success", {"prompt_id": prompt_id}, False)
        elif outcome.status == "interrupted":
            stopped = [event.get("node_id") for event in outcome.events if event["kind"] == "job_interrupted"]
            node_id = stopped[-1] if stopped else None
            self._add_message(prompt, "execution_interrupted", {
                "prompt_id": prompt_id, "node_id": node_id, "node_type": self._node_type(prompt, node_id),
                "executed": list(prompt.executed)}, True)
        elif outcome.failure is not None:
            failure = outcome.failure
            self._add_message(prompt, "execution_error", self._error_data(
                prompt, failure["node_id"], failure["exception_type"], failure["message"],
                failure["traceback"]), False)
        else:  # invalid (a model file went away), the worker's own error, or its workers died (lost)
            kind = {"invalid": "ValidationError", "lost": "WorkerLost"}.get(outcome.status, "WorkerError")
            self._add_message(prompt, "execution_error", self._error_data(
                prompt, None, kind, outcome.message or f"job {outcome.status}", ""), False)

    def _error_data(self, prompt: _Prompt, node_id: str | None, exception_type: str, message: str,
                    trace: str) -> dict[str, Any]:
        node = prompt.item.workflow.nodes.get(node_id) if node_id is not None else None
        inputs = {name: [repr(value)[:200]] for name, value in node.widgets.items()} if node else {}
        return {"prompt_id": prompt.item.prompt_id, "node_id": node_id,
                "node_type": self._node_type(prompt, node_id), "executed": list(prompt.executed),
                "exception_message": message, "exception_type": exception_type,
                "traceback": trace.splitlines(keepends=True), "current_inputs": inputs,
                "current_outputs": list(prompt.executed)}

    @staticmethod
    def _node_type(prompt: _Prompt, node_id: str | None) -> str | None:
        node = prompt.item.workflow.nodes.get(node_id) if node_id is not None else None
        return node.type if node is not None else None

    def _add_message(self, prompt: _Prompt, event: str, data: dict[str, Any], broadcast: bool) -> None:
        """As the engine thread's: timestamped, kept for the history, sent to the prompt's client (or to every
        client when `broadcast` and the prompt has none)."""
        data = {**data, "timestamp": int(time.time() * 1000)}
        prompt.messages.append([event, data])
        if prompt.item.client_id is not None or broadcast:
            self.sink.send(event, data, prompt.item.client_id)

    def _send_executed(self, prompt: _Prompt, node_id: str) -> None:
        item = prompt.item
        if item.client_id is not None:
            self.sink.send("executed", {"node": node_id, "display_node": node_id,
                                        "output": prompt.outputs[node_id], "prompt_id": item.prompt_id},
                           item.client_id)
