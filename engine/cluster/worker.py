"""SluiceWorker: what one Ray actor runs. It owns one Executor and its process's memory runtime, so models
stay loaded between jobs (the executor's cache keeps the last job's loaders), and its own budget: the memory
flags of `sluice run` (--max-vram, --backend, ...) apply per worker, over each workflow's settings["memory"].

A job is a Sluice document as JSON, with the input-folder files it reads (engine/cluster/inputs.py), which the
worker writes into its own input folder. SaveImage writes into the worker's private output folder; the worker
reads the files back, deletes them and returns their names and bytes, which the driver writes locally, with
what the job did (each node's start, cache hit and end, the failure), which a server turns into ComfyUI's
messages; `report(token, since, preview_after)` gives the running job's events so far, its latest progress
and its latest preview frame as JPEG bytes (encoded when asked for, at most once per frame), for a server to
send while the job runs. The class is plain Python (tests run it in-process); scheduler.py makes it an
actor with ray.remote.

`model_fit(document)` says, from the model files' headers alone (auto-fit's estimate in engine/memory/
autofit.py), whether each of the job's models fits the --max-vram budget of the device this worker computes it
on, at the size this worker would hold it (that device's dtype, its --type): the scheduler gives a job to a
worker it fits when there is one.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.cluster.inputs import write_inputs

SAVED_EVENT = "image_saved"  # what SaveImage publishes on the telemetry bus, with path=...
REPORTED_EVENTS = ("job_started", "node_started", "node_cached", "node_finished", "job_interrupted")


@dataclass
class WorkerResult:
    status: str  # the executor's: "finished" | "failed" | "interrupted" | "invalid"
    images: list[tuple[str, bytes]] = field(default_factory=list)  # (name under the output folder, PNG bytes)
    message: str = ""  # why, when not finished
    seconds: float = 0.0
    worker: str = ""  # host:pid of the worker
    # what the job did, in order: {"kind": one of REPORTED_EVENTS or SAVED_EVENT, "node_id": ...}, with
    # "cached" (node ids) for job_started and "name" (one of `images`) for image_saved
    events: list[dict[str, Any]] = field(default_factory=list)
    failure: dict[str, str] | None = None  # node_id, node_type, exception_type, message, traceback


def memory_settings(flags: dict[str, Any], workflow_memory: dict[str, Any]) -> Any:
    """`sluice run`'s memory settings: the CLI flags (MEMORY_FLAGS names) over the workflow's
    settings["memory"]; PlacementError names a bad value."""
    from engine.placement import MemorySettings, settings_from_namespace

    return settings_from_namespace(argparse.Namespace(**flags), MemorySettings.from_dict(workflow_memory))


@dataclass(frozen=True)
class ModelFit:
    """The job's model that is most over its budget, else its largest (one loader's module)."""

    size: int = 0  # bytes, as this worker would hold it
    budget: int | None = None  # the --max-vram bytes of the device it computes on; None: no managed budget
    model: str = ""  # which: "NODE_ID/module"

    @property
    def fits(self) -> bool:
        return self.budget is None or self.size <= self.budget


class SluiceWorker:
    """One worker: `run(document_json)` runs a job; `interrupt()` stops the running one and those waiting
    (call it from another thread: the actor has more threads than the jobs given to it at once, and a lock
    keeps runs one at a time)."""

    def __init__(self, registry_factory: Callable[[Any], Any], memory_flags: dict[str, Any] | None = None,
                 models_root: str | None = None, plugins_dir: str | None = None) -> None:
        from engine.graph.executor import Executor
        from engine.memory.runtime import get_runtime
        from engine.settings import load_settings

        self._folder = Path(tempfile.mkdtemp(prefix="sluice-worker-"))
        self._output = self._folder / "output"  # nodes.image.input_dir: "input" beside it
        self._input = self._folder / "input"
        self.settings = load_settings(models_root=models_root, output_dir=self._output,
                                      plugins_dir=plugins_dir)
        registry = registry_factory(self.settings)
        self.lookup = registry.get
        self.flags = {name: value for name, value in (memory_flags or {}).items() if value}
        self.runtime = get_runtime()
        self.runtime.overrides = self.flags
        self._memory: dict[str, Any] | None = None  # the workflow memory settings the runtime has now
        self.executor = Executor(self.lookup, settings=self.settings)
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self._run_lock = threading.Lock()
        self._interrupted_at = -1.0  # time.monotonic() of the last interrupt
        self._report_lock = threading.Lock()
        self._token = ""  # the running job's, as run() was given it
        self._events: list[dict[str, Any]] = []  # the running job's, as WorkerResult.events
        self._progress: dict[str, Any] | None = None  # its latest: node_id, value, max
        self._preview: tuple[int, Any] | None = None  # its latest frame: (serial, image)
        self._previews = 0  # frames seen by this worker: the serial of the next

    def ping(self) -> str:
        return self.name

    def model_fit(self, document: str) -> ModelFit:
        """The job's model most over this worker's budget, else its largest, from file headers (nothing
        loads). A loader whose file cannot be read is left out: the run reports it."""
        from engine.devices import list_devices, resolve_device
        from engine.graph.document import Workflow
        from engine.memory.autofit import TYPED_COMPONENTS, component_needs
        from engine.memory.ledger import resolve_budget
        from engine.placement import max_vram_for, resolve_node_placement
        from engine.quant.loading import WeightTypes

        workflow = Workflow.loads(document)
        memory = dict(workflow.settings.get("memory", {}))
        settings = memory_settings(self.flags, memory)
        types = (WeightTypes(settings.weight_type.upper() or None, settings.tensor_type_rules)
                 if settings.weight_type or settings.tensor_type_rules else None)
        devices = list_devices()
        models = []
        for node_id, node in workflow.nodes.items():
            node_type = self.lookup(node.type)
            files = getattr(node_type, "memory_files", None)
            if node.mode != "normal" or files is None or not getattr(node_type, "memory_module", None):
                continue
            widgets = {**node_type.default_widget_values(), **node.widgets}
            try:
                for module, paths in files(self.settings, widgets).items():
                    placed = resolve_node_placement(module, memory, str(widgets.get("backend", "auto")),
                                                    str(widgets.get("params_backend", "auto")), self.flags,
                                                    devices)
                    device = resolve_device(placed.compute[0], devices)
                    typed = types if module in TYPED_COMPONENTS else None
                    needs = [need for path in paths for need in component_needs(
                        path, {module: device.name}, node_id, types=typed,
                        ladder=settings.chooses_weight_types, devices=devices)]
                    if needs:  # the smallest weight types the ladder may take, else the types given
                        size = sum(min([need.weight_bytes, *(v.weight_bytes for v in need.variants)])
                                   for need in needs)
                        budget = resolve_budget(max_vram_for(device, settings.max_vram, devices), device)
                        models.append(ModelFit(size, budget, f"{node_id}/{module}"))
            except (OSError, ValueError):  # a missing or unreadable file, a bad placement: the run says so
                continue
        over = [model for model in models if not model.fits]
        return max(over or models, key=lambda model: model.size, default=ModelFit())

    def interrupt(self) -> None:
        """Stop the running job, and the jobs already given that wait for it."""
        self._interrupted_at = time.monotonic()
        self.executor.interrupt()

    def report(self, token: str, since: int, preview_after: int | None = None
               ) -> tuple[str, list[dict[str, Any]], dict[str, Any] | None, tuple[int, bytes] | None]:
        """(this worker's name, the events from `since` on, the latest progress, the latest preview frame
        as (serial, JPEG bytes) when its serial is above `preview_after`, None without it) of the running job,
        when it is the one run() was given `token` for; else no events, progress or frame. A saved image's
        event has the worker's "path", not yet its "name"."""
        with self._report_lock:
            if not token or token != self._token:
                return self.name, [], None, None
            events, progress = [dict(event) for event in self._events[since:]], self._progress
            preview = self._preview
        frame = None
        if preview is not None and preview_after is not None and preview[0] > preview_after:
            from engine.images import jpeg_bytes

            try:
                frame = (preview[0], jpeg_bytes(preview[1]))
            except (ValueError, TypeError, OSError):  # a frame that is not an image: none
                frame = None
        return self.name, events, progress, frame

    def run(self, document: str, token: str = "", inputs: dict[str, bytes] | None = None) -> WorkerResult:
        """Run one job; `token` names it for report(); `inputs` are the input-folder files it reads."""
        from engine import telemetry
        from engine.graph.document import Workflow
        from engine.placement import PlacementError

        called = time.monotonic()
        with self._run_lock:
            if self._interrupted_at > called:
                return WorkerResult("interrupted", message="interrupted before it started", worker=self.name)
            started = time.perf_counter()
            saved: list[str] = []
            events: list[dict[str, Any]] = []
            with self._report_lock:
                self._token, self._events, self._progress, self._preview = token, events, None, None

            def collect(event: Any) -> None:
                if event.kind == SAVED_EVENT and event.get("path") is not None:
                    saved.append(str(event.get("path")))
                    events.append({"kind": SAVED_EVENT, "node_id": event.get("node_id"), "path": saved[-1]})
                elif event.kind in REPORTED_EVENTS:
                    events.append({"kind": event.kind, "node_id": event.get("node_id"),
                                   **({"cached": list(event.get("cached", []))} if event.kind == "job_started"
                                      else {})})
                elif event.kind == "progress":
                    self._progress = {"node_id": event.get("node_id"), "value": event.get("value"),
                                      "max": event.get("max")}
                elif event.kind == "preview" and event.get("image") is not None:
                    with self._report_lock:
                        self._previews += 1
                        self._preview = (self._previews, event.get("image"))

            unsubscribe = telemetry.bus.subscribe(collect)
            try:
                write_inputs(self._input, inputs or {})
                workflow = Workflow.loads(document)
                memory = dict(workflow.settings.get("memory", {}))
                if memory != self._memory:
                    self.runtime.configure(memory_settings(self.flags, memory))
                    self._memory = memory
                result = self.executor.run(workflow)
                self.executor.forget(list(result.outputs))  # a repeated job saves its images again
            except PlacementError as error:
                return WorkerResult("invalid", message=f"invalid memory settings: {error}", worker=self.name)
            except (ValueError, OSError) as error:  # an input file that cannot be written
                if isinstance(error, ValueError) and "input file" not in str(error):
                    raise
                return WorkerResult("failed", message=f"input files: {error}", worker=self.name)
            except Exception as error:  # an engine bug fails this job, not the worker
                return WorkerResult("failed", message=f"{type(error).__name__}: {error}\n"
                                    f"{traceback.format_exc()}", worker=self.name)
            finally:
                unsubscribe()
                with self._report_lock:
                    self._token, self._preview = "", None
                images = self._take(saved)
                for event in events:
                    if event["kind"] == SAVED_EVENT:
                        event["name"] = Path(event.pop("path")).relative_to(self._output).as_posix()
            failure = None if result.failure is None else {
                name: str(getattr(result.failure, name))
                for name in ("node_id", "node_type", "exception_type", "message", "traceback")}
            return WorkerResult(result.status, images, _reason(result), time.perf_counter() - started,
                                self.name, events, failure)

    def free(self) -> None:
        """POST /free: drop the cached results and the models they hold (after the running job)."""
        with self._run_lock:
            self.executor.clear_cache()
            gc.collect()

    def close(self) -> None:
        shutil.rmtree(self._folder, ignore_errors=True)

    def _take(self, paths: list[str]) -> list[tuple[str, bytes]]:
        """The saved files' names (relative to the output folder) and bytes; the files are deleted."""
        images = []
        for path in paths:
            file = Path(path)
            images.append((file.relative_to(self._output).as_posix(), file.read_bytes()))
            file.unlink()
        return images


def _reason(result: Any) -> str:
    if result.status == "invalid":
        return "; ".join(str(error) for error in result.errors)
    if result.failure is not None:
        failure = result.failure
        return (f"node {failure.node_id} ({failure.node_type}) failed: {failure.exception_type}: "
                f"{failure.message}")
    return "" if result.status == "finished" else f"job {result.status}"
