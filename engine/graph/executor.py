"""Run a workflow: validate, schedule the ancestors of the output nodes, reuse cached results, publish events.

Caching. Every node's result is kept under a signature: a hash of its type, mode, widget values (defaults
for missing ones) and the signatures and output indices of its linked inputs, in input order. A node whose
signature matches the cached one is not run, and nodes that only feed cached nodes are not needed at all,
so after a widget edit only that node and its descendants run again. The cache holds the outputs of
every node of the most recent run, one entry per node id (the latest signature), which bounds it by the
size of the graph; entries of nodes no longer in the document are dropped after each run. During a run
the executor also drops its own reference to an intermediate result once its last consumer has run.

Modes. A muted node is left out (a required input fed only by it fails validation). A bypassed node does
not run: each of its outputs passes on the first connected input whose type equals that output's type,
else None.

Events (on `bus`, with job_id): job_started(node_count, cached: the ids of the nodes whose cached result
matches, as ComfyUI's execution_cached lists them), then per node node_started / node_cached,
progress(node_id, value, max), preview(node_id, image), node_finished(node_id, seconds) or
node_failed(node_id, node_type, exception_type, message, traceback), job_interrupted(node_id), and
last always job_finished(status, seconds) (with errors, as strings, when the status is "invalid").

The executor is synchronous: the GUI's worker thread calls `run`; `interrupt` may be called from any thread.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine import telemetry
from engine.graph.document import Link, Workflow, id_sort_key
from engine.graph.errors import Interrupted, NodeFailure, ValidationError
from engine.graph.spec import SEED, NodeType, RunContext, next_seed
from engine.graph.validate import build_graph, output_type_of, validate

Lookup = Callable[[str], type[NodeType] | None]


@dataclass
class JobResult:
    job_id: str
    status: str  # "finished" | "failed" | "interrupted" | "invalid"
    outputs: dict[str, tuple] = field(default_factory=dict)  # output node id -> outputs (run or cached)
    errors: list[ValidationError] = field(default_factory=list)
    failure: NodeFailure | None = None
    seconds: float = 0.0
    executed: list[str] = field(default_factory=list)  # node ids that ran (not taken from the cache)


@dataclass
class _Plan:
    order: list[str]  # the nodes to produce, in topological order
    classes: dict[str, type[NodeType]]
    inputs: dict[str, dict[str, Link]]  # node id -> input name -> live link
    signatures: dict[str, str]
    hits: dict[str, tuple]  # node id -> cached outputs whose signature matches
    output_nodes: list[str]


class Executor:
    def __init__(self, lookup: Lookup, bus: telemetry.EventBus | None = None, settings: Any = None) -> None:
        self.lookup = lookup
        self.bus = bus if bus is not None else telemetry.bus
        self.settings = settings
        self._interrupt = threading.Event()
        self._cache_lock = threading.Lock()
        self._cache: dict[str, tuple[str, tuple]] = {}  # node id -> (signature, outputs)

    def interrupt(self) -> None:
        """Ask the running job to stop at its next check (thread-safe); cleared when the next job starts."""
        self._interrupt.set()

    def check_interrupt(self) -> None:
        if self._interrupt.is_set():
            raise Interrupted("the job was interrupted")

    def clear_cache(self) -> None:
        with self._cache_lock:
            self._cache.clear()

    def cached_node_ids(self) -> list[str]:
        with self._cache_lock:
            return sorted(self._cache, key=id_sort_key)

    def forget(self, node_ids: list[str]) -> None:
        """Drop the cached results of these nodes, so that the next run runs them again (e.g. a save node)."""
        with self._cache_lock:
            for node_id in node_ids:
                self._cache.pop(node_id, None)

    def signatures(self, workflow: Workflow) -> dict[str, str]:
        """The cache signature of every node the output nodes need (node id -> hash), as `run` computes it;
        the workflow must be valid."""
        return dict(self._plan(workflow).signatures)

    def run(self, workflow: Workflow, job_id: str | None = None) -> JobResult:
        job_id = job_id or uuid.uuid4().hex[:12]
        started = time.perf_counter()
        self._interrupt.clear()
        errors = validate(workflow, self.lookup, getattr(self.settings, "output_dir", None))
        if errors:
            self.bus.publish("job_started", job_id=job_id, node_count=0)
            return self._finish(JobResult(job_id, "invalid", errors=errors), workflow, started)
        plan = self._plan(workflow)
        self.bus.publish("job_started", job_id=job_id, node_count=len(plan.order),
                         cached=sorted(plan.hits, key=id_sort_key))
        result = JobResult(job_id, "finished")
        values: dict[str, tuple] = {}
        consumers = Counter(link.source for node_id in plan.order if node_id not in plan.hits
                            for link in plan.inputs[node_id].values())
        current = None
        try:
            for node_id in plan.order:
                current = node_id
                self.check_interrupt()
                node_type = plan.classes[node_id]
                if workflow.nodes[node_id].mode == "bypassed":
                    values[node_id] = self._bypass(workflow, node_id, node_type, plan, values)
                elif node_id in plan.hits:
                    values[node_id] = plan.hits[node_id]
                    self.bus.publish("node_cached", job_id=job_id, node_id=node_id)
                else:
                    values[node_id] = self._run_node(workflow, job_id, node_id, node_type, plan, values)
                    result.executed.append(node_id)
                if node_id in plan.output_nodes:
                    result.outputs[node_id] = values[node_id]
                if node_id not in plan.hits:
                    for link in plan.inputs[node_id].values():
                        consumers[link.source] -= 1
                        if consumers[link.source] == 0 and link.source not in plan.output_nodes:
                            values.pop(link.source, None)
        except Interrupted:
            result.status = "interrupted"
            self.bus.publish("job_interrupted", job_id=job_id, node_id=current)
        except NodeFailure as failure:
            result.status = "failed"
            result.failure = failure
            self.bus.publish("node_failed", job_id=job_id, node_id=failure.node_id,
                             node_type=failure.node_type, exception_type=failure.exception_type,
                             message=failure.message, traceback=failure.traceback)
        return self._finish(result, workflow, started)

    def _finish(self, result: JobResult, workflow: Workflow, started: float) -> JobResult:
        with self._cache_lock:
            for node_id in [n for n in self._cache if n not in workflow.nodes]:
                del self._cache[node_id]
        result.seconds = time.perf_counter() - started
        fields: dict[str, Any] = {"errors": [str(e) for e in result.errors]} if result.errors else {}
        self.bus.publish("job_finished", job_id=result.job_id, status=result.status, seconds=result.seconds,
                         **fields)
        return result

    def _plan(self, workflow: Workflow) -> _Plan:
        graph = build_graph(workflow)
        classes = {node_id: self.lookup(workflow.nodes[node_id].type) for node_id in graph}
        output_nodes = [n for n in graph if classes[n].output_node and workflow.nodes[n].mode == "normal"]
        needed = set(output_nodes).union(*(graph.ancestors(n) for n in output_nodes))
        order = graph.topological_order(needed, key=id_sort_key)
        inputs: dict[str, dict[str, Link]] = {n: {} for n in order}
        for link in workflow.links:
            if link.target in inputs and link.source in graph:
                inputs[link.target][link.input] = link
        signatures: dict[str, str] = {}
        for node_id in order:
            signatures[node_id] = _signature(workflow, node_id, classes[node_id], inputs[node_id], signatures,
                                             self.settings)
        with self._cache_lock:
            hits = {n: self._cache[n][1] for n in order if workflow.nodes[n].mode == "normal"
                    and n in self._cache and self._cache[n][0] == signatures[n]}
        # Keep only what an output node needs: nodes feeding only cached nodes are not produced.
        required = set(output_nodes)
        for node_id in reversed(order):
            if node_id in required and node_id not in hits:
                required.update(link.source for link in inputs[node_id].values())
        order = [n for n in order if n in required]
        return _Plan(order, classes, inputs, signatures, hits, output_nodes)

    def _node_inputs(self, workflow: Workflow, node_id: str, node_type: type[NodeType], plan: _Plan,
                     values: dict[str, tuple]) -> dict[str, Any]:
        node = workflow.nodes[node_id]
        defaults = node_type.default_widget_values()
        kwargs: dict[str, Any] = {}
        for spec_input in node_type.inputs:
            link = plan.inputs[node_id].get(spec_input.name)
            if link is not None:
                kwargs[spec_input.name] = values[link.source][link.output]
            elif spec_input.is_widget:
                kwargs[spec_input.name] = node.widgets.get(spec_input.name, defaults[spec_input.name])
            else:
                kwargs[spec_input.name] = None
        return kwargs

    def _bypass(self, workflow: Workflow, node_id: str, node_type: type[NodeType], plan: _Plan,
                values: dict[str, tuple]) -> tuple:
        """Each output passes on the first connected input of the same type, else None."""
        links = plan.inputs[node_id]
        passed: list[Any] = []
        for output in node_type.outputs:
            value = None
            for spec_input in node_type.inputs:
                link = links.get(spec_input.name)
                if link is not None and output.type in (spec_input.link_type,
                                                        output_type_of(workflow, self.lookup, link)):
                    value = values[link.source][link.output]
                    break
            passed.append(value)
        return tuple(passed)

    def _run_node(self, workflow: Workflow, job_id: str, node_id: str, node_type: type[NodeType], plan: _Plan,
                  values: dict[str, tuple]) -> tuple:
        kwargs = self._node_inputs(workflow, node_id, node_type, plan, values)
        bus = self.bus
        ctx = RunContext(
            node_id=node_id,
            check_interrupt=self.check_interrupt,
            report_progress=lambda value, maximum: bus.publish("progress", job_id=job_id, node_id=node_id,
                                                               value=value, max=maximum),
            report_preview=lambda image: bus.publish("preview", job_id=job_id, node_id=node_id, image=image),
            settings=self.settings,
            workflow=workflow,
            lookup=self.lookup,
        )
        bus.publish("node_started", job_id=job_id, node_id=node_id, node_type=node_type.type_name)
        started = time.perf_counter()
        try:
            outputs = node_type().run(ctx, **kwargs)
        except Interrupted:
            raise
        except Exception as error:
            raise NodeFailure(node_id, node_type.type_name, type(error).__name__, str(error),
                              traceback.format_exc()) from error
        outputs = _as_outputs(outputs, node_id, node_type)
        bus.publish("node_finished", job_id=job_id, node_id=node_id, seconds=time.perf_counter() - started)
        with self._cache_lock:
            self._cache[node_id] = (plan.signatures[node_id], outputs)
        return outputs


def _as_outputs(outputs: Any, node_id: str, node_type: type[NodeType]) -> tuple:
    if outputs is None and not node_type.outputs:
        return ()
    if isinstance(outputs, list):
        outputs = tuple(outputs)
    if not isinstance(outputs, tuple) or len(outputs) != len(node_type.outputs):
        got = f"{len(outputs)} values" if isinstance(outputs, tuple) else repr(outputs)
        message = f"run() returned {got}; expected a tuple of {len(node_type.outputs)} outputs"
        raise NodeFailure(node_id, node_type.type_name, "TypeError", message, "")
    return outputs


def _signature(workflow: Workflow, node_id: str, node_type: type[NodeType], links: dict[str, Link],
               signatures: dict[str, str], settings: Any) -> str:
    """Hash of the node's type, mode, widgets, fingerprint and its inputs' signatures, in input order."""
    node = workflow.nodes[node_id]
    defaults = node_type.default_widget_values()
    widgets = {**defaults, **node.widgets}
    try:
        fingerprint = node_type.fingerprint(settings, **widgets)
    except Exception as error:  # e.g. a missing file: the node reports it when it runs
        fingerprint = ("fingerprint failed", repr(error))
    parts: list[Any] = [node_type.type_name, node.mode, fingerprint]
    if node_type.memory_module:  # a loader's placement also follows the workflow's memory settings
        parts.append(sorted(workflow.settings.get("memory", {}).items()))
    for spec_input in node_type.inputs:
        link = links.get(spec_input.name)
        if link is not None:
            parts.append((spec_input.name, "link", signatures[link.source], link.output))
        elif spec_input.is_widget:
            value = node.widgets.get(spec_input.name, defaults[spec_input.name])
            parts.append((spec_input.name, "value", value))
        else:
            parts.append((spec_input.name, "unconnected"))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def advance_seeds(workflow: Workflow, lookup: Lookup | None = None,
                  rng: random.Random | None = None) -> dict[str, dict[str, int]]:
    """Apply control-after-generate to every unlinked seed of the document; call after a run, as ComfyUI.

    A seed without an entry in `seed_controls` is fixed. A seed missing from `widgets` starts from its
    type's default when `lookup` is given, else it is left alone. Returns {node id: {input: new seed}}.
    """
    changed: dict[str, dict[str, int]] = {}
    for node_id, node in workflow.nodes.items():
        linked = {link.input for link in workflow.links if link.target == node_id}
        node_type = lookup(node.type) if lookup is not None else None
        for name, control in node.seed_controls.items():
            if name in linked or control == "fixed":
                continue
            if node_type is not None:
                spec_input = node_type.input_named(name)
                if spec_input is None or spec_input.kind != SEED:
                    continue
            seed = node.widgets.get(name, spec_input.default if node_type is not None else None)
            if isinstance(seed, bool) or not isinstance(seed, int):
                continue
            node.widgets[name] = next_seed(seed, control, rng)
            changed.setdefault(node_id, {})[name] = node.widgets[name]
    return changed
