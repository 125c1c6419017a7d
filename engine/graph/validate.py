"""Check a workflow against its node types before anything runs; report every problem in one pass.

Muted nodes are left out of the graph (as in ComfyUI): they are not checked, and a link out of a muted
node counts as absent, so a required input fed only by a muted node is missing. Bypassed nodes are
checked for their links but not for missing inputs or widget values, since they never run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.graph.dag import WorkflowGraph
from engine.graph.document import Link, Workflow, id_sort_key
from engine.graph.errors import ValidationError
from engine.graph.job_guard import check_job_memory
from engine.graph.run_checks import check_memory_devices, check_non_finite, check_output_folder
from engine.graph.spec import ANY, SEED, SEED_CONTROLS, NodeType

Lookup = Callable[[str], type[NodeType] | None]


def build_graph(workflow: Workflow) -> WorkflowGraph:
    """The graph of the non-muted nodes in id order, with an edge per linked pair."""
    graph = WorkflowGraph()
    for node_id in sorted(workflow.nodes, key=id_sort_key):
        node = workflow.nodes[node_id]
        if node.mode != "muted":
            graph.add_node(node_id, node)
    for link in workflow.links:
        if link.source in graph and link.target in graph:
            graph.add_edge(link.source, link.target)
    return graph


def output_type_of(workflow: Workflow, lookup: Lookup, link: Link) -> str | None:
    """The declared type of the output a link starts from, or None when the source or index is unknown."""
    source = workflow.nodes.get(link.source)
    cls = lookup(source.type) if source is not None else None
    if cls is None or not 0 <= link.output < len(cls.outputs):
        return None
    return cls.outputs[link.output].type


def validate(workflow: Workflow, lookup: Lookup, output_dir: Path | None = None) -> list[ValidationError]:
    """Every problem of `workflow`: unknown types, bad links, type mismatches, missing inputs, bad widget
    values (non-finite numbers anywhere in them), cycles, the absence of an output node, memory settings
    naming a device this machine lacks, an `output_dir` (when given) its saving nodes cannot write
    (run_checks.py), and (when there is no other) a job too large for this machine's RAM or a
    device's budget (job_guard.py)."""
    errors: list[ValidationError] = []
    graph = build_graph(workflow)
    classes: dict[str, type[NodeType]] = {}
    for node_id in graph:
        node = workflow.nodes[node_id]
        cls = lookup(node.type)
        if cls is None:
            errors.append(ValidationError("unknown_type", f"unknown node type {node.type!r}", node_id,
                                          node_type=node.type))
        else:
            classes[node_id] = cls
    for link in workflow.links:
        for end in (link.source, link.target):
            if end not in workflow.nodes:
                errors.append(ValidationError("bad_link", f"link {link.id} points at missing node {end}"))
    live_links = [link for link in workflow.links if link.source in graph and link.target in graph]
    errors += _check_links(workflow, lookup, live_links, classes)
    for node_id, cls in classes.items():
        node = workflow.nodes[node_id]
        if node.mode == "normal":
            errors += _check_inputs(workflow, node_id, cls, live_links)
    errors += _check_cycles(graph)
    reported = {(error.node_id, error.input_name) for error in errors}
    errors += check_non_finite(workflow, reported)
    errors += check_memory_devices(workflow)
    errors += check_output_folder(workflow, classes, output_dir)
    has_output = any(cls.output_node and workflow.nodes[node_id].mode == "normal"
                     for node_id, cls in classes.items())
    if not has_output:
        errors.append(ValidationError("no_output", "the workflow has no output node (e.g. SaveImage, "
                                                   "PreviewImage) that is not muted or bypassed"))
    if not errors:
        errors += check_job_memory(workflow)  # sizes the specs allow but this machine cannot hold
    return errors


def _check_links(workflow: Workflow, lookup: Lookup, links: list[Link],
                 classes: dict[str, type[NodeType]]) -> list[ValidationError]:
    errors: list[ValidationError] = []
    seen_inputs: set[tuple[str, str]] = set()
    for link in links:
        source_cls, target_cls = classes.get(link.source), classes.get(link.target)
        target_type = workflow.nodes[link.target].type
        if (link.target, link.input) in seen_inputs:
            errors.append(ValidationError("bad_link", f"link {link.id} is a second link into the same input",
                                          link.target, link.input, target_type))
        seen_inputs.add((link.target, link.input))
        if source_cls is None or target_cls is None:
            continue  # already reported as an unknown type
        target_input = target_cls.input_named(link.input)
        if target_input is None:
            accepted = ", ".join(i.name for i in target_cls.inputs) or "none"
            errors.append(ValidationError("bad_link", f"link {link.id} goes to input {link.input!r}, which "
                                          f"{target_type} does not have; inputs: {accepted}",
                                          link.target, link.input, target_type))
            continue
        output_type = output_type_of(workflow, lookup, link)
        if output_type is None:
            errors.append(ValidationError("bad_link", f"link {link.id} comes from output {link.output} of "
                                          f"node {link.source} ({source_cls.type_name}), which has "
                                          f"{len(source_cls.outputs)} outputs", link.target, link.input,
                                          target_type))
            continue
        wanted = target_input.link_type
        if ANY not in (output_type, wanted) and output_type != wanted:
            errors.append(ValidationError("type_mismatch", f"link {link.id} carries {output_type} from node "
                                          f"{link.source} ({source_cls.type_name}) output {link.output}, "
                                          f"but the input takes {wanted}", link.target, link.input,
                                          target_type))
    return errors


def _check_inputs(workflow: Workflow, node_id: str, cls: type[NodeType],
                  live_links: list[Link]) -> list[ValidationError]:
    errors: list[ValidationError] = []
    node = workflow.nodes[node_id]
    linked = {link.input for link in live_links if link.target == node_id}
    defaults = cls.default_widget_values()
    muted_sources = {link.input: link.source for link in workflow.links if link.target == node_id
                     and link.source in workflow.nodes and workflow.nodes[link.source].mode == "muted"}
    for spec_input in cls.inputs:
        name = spec_input.name
        if name in linked:
            continue
        if not spec_input.is_widget:
            if spec_input.optional:
                continue
            fed = f" (fed only by muted node {muted_sources[name]})" if name in muted_sources else ""
            errors.append(ValidationError("missing_input", f"required input of type {spec_input.kind} is not "
                                          f"connected{fed}", node_id, name, node.type))
            continue
        value = node.widgets.get(name, defaults[name])
        problem = spec_input.check_value(value)
        if problem is not None:
            message = problem.removeprefix(f"{name}: ")
            errors.append(ValidationError("bad_value", message, node_id, name, node.type))
        if spec_input.kind == SEED:
            control = node.seed_controls.get(name, "fixed")
            if control not in SEED_CONTROLS:
                errors.append(ValidationError("bad_value", f"unknown control after generate {control!r}; "
                                              f"accepted: {', '.join(SEED_CONTROLS)}", node_id, name,
                                              node.type))
    return errors


def _check_cycles(graph: WorkflowGraph) -> list[ValidationError]:
    errors: list[ValidationError] = []
    for cycle in graph.cycles(key=id_sort_key):
        path = " -> ".join([*cycle, cycle[0]])
        errors.append(ValidationError("cycle", f"the graph has a cycle through nodes {path}", cycle[0]))
    errors.sort(key=lambda error: id_sort_key(error.node_id or ""))
    return errors
