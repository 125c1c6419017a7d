"""`sluice serve --ray ADDRESS`: the server's prompts run on Ray workers (engine/cluster) instead of its one
engine thread; the routes, the queue and the history are the same.

RayEngine, one thread, takes a prompt from the queue whenever a worker is free (each worker runs one prompt at
a time, so the queue's running prompts are those on workers), gives it to the cluster's Scheduler (placement
by model and budget, retries when a worker dies) and turns what the worker reports into ComfyUI's messages,
in ComfyUI's order: execution_start when a worker is given the prompt; while it runs (the worker is asked
every POLL seconds), execution_cached, executing for each node it starts and progress (the latest step of
the node running); then, when the prompt ends, the rest: executed for each node that saved images (written
first into the server's output folder, under a fresh name, so /view serves them) and what followed it, then
execution_success, execution_error or execution_interrupted, the history entry, the queue's status and
executing with node null. Preview frames come with the workers' reports (the latest frame at each poll, as
binary messages to a client that takes them). A prompt whose worker died starts its messages again on the
next worker. The input-folder files a prompt names (uploads: LoadImage's image) go with it to its worker,
whose input folder is its own (engine/cluster/inputs.py). PreviewImage's images stay on the workers. POST
/free clears every worker's cache; POST /interrupt reaches the worker that runs the prompt.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from app.server.engine_thread import MessageSink, history_entry, image_ref, preview_message
from app.server.queue import PromptQueue, QueueItem
from engine.cluster import require_ray
from engine.cluster.inputs import job_inputs
from engine.cluster.output import write_image
from engine.cluster.scheduler import Job, Outcome, Scheduler, model_keys
from engine.cluster.worker import SAVED_EVENT
from engine.settings import Settings
from nodes.image import input_dir

POLL = 0.1  # seconds between asking the workers what their prompts did


@dataclass
class _Prompt:
    item: QueueItem
    job: Job
    messages: list[list[Any]] = field(default_factory=list)  # [event, data] for the history's status
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)  # node id -> ComfyUI's ui output
    executed: list[str] = field(default_factory=list)
    attempt: int = 0  # the job's attempts when its messages were last sent (a death starts them again)
    sent: int = 0  # the worker's events already sent while it ran
    live: bool = True  # until an image is saved: its bytes come at the end, the events after it too
    node: str | None = None  # the node running
    progress: dict[str, Any] | None = None  # the last progress sent
    poll: Any = None  # the report asked of the worker and not yet answered
    preview: int = -1  # the serial of the worker's last preview frame sent (report's preview_after)


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
        """(client id, prompt id, node id) of the prompt given to a worker last, the node as its worker last
        reported it (None before); Nones when none runs."""
        with self._lock:
            if not self._prompts:
                return None, None, None
            prompt = self._prompts[max(self._prompts)]
            return prompt.item.client_id, prompt.item.prompt_id, prompt.node

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
            for outcome in scheduler.step(timeout=POLL):
                self._finish(outcome)
            self._poll()
        scheduler.interrupt()  # the server stops: so do the prompts on workers

    def _start(self, item: QueueItem) -> None:
        job = Job(next(self._numbers), item.workflow.dumps(),
                  model_keys=model_keys(item.workflow, self.lookup, self.settings),
                  inputs=job_inputs(item.workflow, self.lookup, input_dir(self.settings)))
        prompt = _Prompt(item, job)
        with self._lock:
            self._prompts[job.index] = prompt
        self._add_message(prompt, "execution_start", {"prompt_id": item.prompt_id}, False)
        self.scheduler.add(job)

    def _poll(self) -> None:
        """Send what the running prompts' workers reported since the last poll; ask them again."""
        ray = require_ray()
        with self._lock:
            prompts = list(self._prompts.values())
        for prompt in prompts:
            if prompt.poll is None and prompt.live:
                handle = self.scheduler.worker_of(prompt.job.index)
                if handle is not None:
                    self._restart_if_retried(prompt)
                    wants = self.sink.wants_bytes(prompt.item.client_id)
                    prompt.poll = handle.report.remote(str(prompt.job.index), prompt.sent,
                                                       prompt.preview if wants else None)
        asked = {prompt.poll: prompt for prompt in prompts if prompt.poll is not None}
        if not asked:
            return
        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=0)
        for ref in ready:
            prompt = asked[ref]
            prompt.poll = None
            try:
                worker, events, progress, frame = ray.get(ref)
            except ray.exceptions.RayError:  # its worker died: the scheduler runs the prompt elsewhere
                continue
            if self._restart_if_retried(prompt):
                continue  # a report of the attempt before
            for event in events:
                if event["kind"] == SAVED_EVENT:
                    prompt.live = False
                    break
                self._event(prompt, event, worker, {}, {})
                prompt.sent += 1
            if prompt.live and progress is not None and progress["node_id"] == prompt.node \
                    and progress != prompt.progress:
                prompt.progress = progress
                self.sink.send("progress", {"value": progress["value"], "max": progress["max"],
                                            "prompt_id": prompt.item.prompt_id, "node": prompt.node},
                               prompt.item.client_id)
            if prompt.live and frame is not None:
                prompt.preview = frame[0]
                self.sink.send_bytes(preview_message(frame[1]), prompt.item.client_id)

    @staticmethod
    def _restart_if_retried(prompt: _Prompt) -> bool:
        """When the prompt's worker died since its messages were sent, send them again from its start."""
        if prompt.job.attempts == prompt.attempt:
            return False
        prompt.attempt, prompt.sent, prompt.live, prompt.node = prompt.job.attempts, 0, True, None
        prompt.preview = -1
        prompt.executed.clear()
        prompt.outputs.clear()
        return True

    def _finish(self, outcome: Outcome) -> None:
        with self._lock:
            prompt = self._prompts.pop(outcome.job.index)
        item = prompt.item
        self._restart_if_retried(prompt)
        data = dict(outcome.images)
        saved: dict[str, list[dict[str, str]]] = {}
        for event in outcome.events[prompt.sent:]:
            self._event(prompt, event, outcome.worker, data, saved)
        self._report_end(prompt, outcome)
        entry = history_entry(item, prompt.outputs, outcome.status == "finished", prompt.messages)
        self.queue.finish(item, entry)
        if item.client_id is not None:
            self.sink.send("executing", {"node": None, "prompt_id": item.prompt_id}, item.client_id)

    def _event(self, prompt: _Prompt, event: dict[str, Any], worker: str, data: dict[str, bytes],
               saved: dict[str, list[dict[str, str]]]) -> None:
        """One of the worker's events as ComfyUI's messages. A saved image (its bytes in `data`) is written
        into the output folder and kept in `saved` until its node's end."""
        item, kind, node_id = prompt.item, event["kind"], event.get("node_id")
        if kind == "job_started":
            self._add_message(prompt, "execution_cached", {"nodes": event.get("cached", []),
                                                           "prompt_id": item.prompt_id}, False)
        elif kind == "node_started":
            prompt.node = node_id
            if item.client_id is not None:
                self.sink.send("executing", {"node": node_id, "display_node": node_id,
                                             "prompt_id": item.prompt_id}, item.client_id)
        elif kind == SAVED_EVENT and event.get("name") in data:
            path = write_image(self.settings, event["name"], data[event["name"]], {})
            ref = image_ref(str(path), {"output": os.path.realpath(self.settings.output_dir)})
            if ref is not None:
                saved.setdefault(str(node_id), []).append(ref)
        elif kind == "node_finished":
            prompt.executed.append(node_id)
            images = saved.pop(str(node_id), None)
            if images:
                self._ui_cache[worker, node_id] = prompt.outputs[node_id] = {"images": images}
                self._send_executed(prompt, node_id)
            else:
                self._ui_cache.pop((worker, node_id), None)
        elif kind == "node_cached" and (worker, node_id) in self._ui_cache:
            prompt.outputs[node_id] = self._ui_cache[worker, node_id]
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
