"""Read ComfyUI files into Sluice workflows: the UI format (LiteGraph, versions 0.4 and 1) and the API format.

UI format. Nodes carry `inputs` (linkable slots plus widgets converted to inputs; a link's target slot
indexes this list), `outputs`, and `widgets_values`: the values of the type's widget inputs in declaration
order, where a seed is followed by its "control after generate" value (a string, or in older files and
the frontend's default graph a boolean: true = "randomize"), a converted widget keeps its slot, and
an input that is a socket only (listed in `inputs` without a "widget" key) has none. Links are [id, origin,
origin_slot, target, target_slot, type] arrays (0.4) or objects with those keys (1). Modes 2 ("never") and 4
("bypass") become muted and bypassed; a link from or to a node that is not in the file is dropped with a
warning (ComfyUI saves such stale links and opens the file anyway).

Subgraphs (`definitions.subgraphs`) are flattened first, their inner nodes named "instance:inner" as in
ComfyUI's API prompts (engine/graph/comfy_subgraph.py). Types whose widgets differ from ComfyUI's (a loader's
`device`) are translated by engine/graph/comfy_widgets.py; Sluice's own placement widgets (`backend`,
`params_backend`) are never in ComfyUI files and take their defaults silently.

Frontend-only nodes are resolved: a Reroute chain is replaced by direct links from its source, a
PrimitiveNode's value is written into the widgets it feeds, and Note / MarkdownNote texts move to
`workflow.meta["notes"]`. Nodes of types the lookup does not know are kept, with their links, so that
validation shows them as unknown types; one warning lists them all (their raw list of widget values is kept in
`workflow.meta["comfy_widgets_values"]`).

API format: {"3": {"class_type": "KSampler", "inputs": {"seed": 5, "model": ["4", 0], ...},
"_meta": {"title": ...}}, ...}; an input whose value is [node_id, output_index] is a link. It has no
positions, so nodes are laid out in columns by their depth in the graph.

Every malformed value raises WorkflowError naming the node or link and the field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from engine.graph.comfy_subgraph import flatten_subgraphs, has_subgraphs, list_field
from engine.graph.comfy_widgets import SLUICE_ONLY_WIDGETS, named_ui_values, sluice_api_inputs
from engine.graph.document import MAX_COORDINATE, Group, Link, NodeDoc, Workflow, id_sort_key, is_coordinate
from engine.graph.errors import WorkflowError
from engine.graph.spec import ANY, INT, SEED, SEED_CONTROLS, NodeType
from engine.graph.validate import output_type_of

Lookup = Callable[[str], type[NodeType] | None]

REROUTE = "Reroute"
PRIMITIVE = "PrimitiveNode"
NOTE_TYPES = ("Note", "MarkdownNote")
NOTE_SIZE = (400.0, 160.0)  # ComfyUI's default size of a Note node
UI_MODES = {0: "normal", 1: "normal", 2: "muted", 3: "normal", 4: "bypassed"}  # LiteGraph mode numbers
LINK_FIELDS = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")
COLUMN_WIDTH, ROW_HEIGHT = 380.0, 260.0  # spacing of the automatic layout of API prompts


@dataclass
class _UiInput:
    name: str
    link: str | None  # the id of the link into this slot
    widget: str | None  # the widget this slot was converted from, if any


@dataclass
class _UiNode:
    id: str
    type: str
    title: str
    pos: tuple[float, float]
    size: tuple[float, float] | None
    mode: str
    collapsed: bool
    color: str | None
    inputs: list[_UiInput]
    widgets_values: list[Any] | dict[str, Any]


def is_comfy_ui(data: Any) -> bool:
    """Whether parsed JSON looks like a ComfyUI UI-format workflow (a "nodes" list and no Sluice "format")."""
    return isinstance(data, dict) and "format" not in data and isinstance(data.get("nodes"), list)


def is_comfy_api(data: Any) -> bool:
    """Whether parsed JSON looks like a ComfyUI API prompt (every value an object with a "class_type")."""
    return (isinstance(data, dict) and bool(data)
            and all(isinstance(raw, dict) and "class_type" in raw for raw in data.values()))


# -- UI format --

def from_comfy_ui(data: Any, lookup: Lookup) -> tuple[Workflow, list[str]]:
    """A Sluice workflow from a parsed ComfyUI UI-format file, and warnings about what did not carry over."""
    if not is_comfy_ui(data):
        raise WorkflowError("not a ComfyUI workflow: expected an object with a \"nodes\" list")
    warnings: list[str] = []
    if has_subgraphs(data):
        flat = flatten_subgraphs(data, warnings)
        raw_nodes, raw_links, raw_groups, pushed = flat.nodes, flat.links, flat.groups, flat.pushed
    else:
        raw_nodes, raw_links = data["nodes"], data.get("links") or []
        raw_groups, pushed, flat = list_field(data, "groups", "workflow"), {}, None
    nodes: dict[str, _UiNode] = {}
    for index, raw in enumerate(raw_nodes):
        node = _ui_node(raw, f"nodes[{index}]")
        if node.id in nodes:
            raise WorkflowError(f"duplicate node id {node.id} (nodes[{index}])")
        nodes[node.id] = node
    if not isinstance(raw_links, list):
        raise WorkflowError(f"field 'links' must be a list, got {raw_links!r}")
    links = [link for index, raw in enumerate(raw_links)
             if (link := _ui_link(raw, f"links[{index}]", nodes, warnings)) is not None]
    links = _resolve_reroutes(nodes, links, warnings)
    links, from_primitives = _resolve_primitives(nodes, links, warnings)
    for node_id, values in from_primitives.items():
        pushed.setdefault(node_id, {}).update(values)

    workflow = Workflow(meta={"imported_from": f"ComfyUI workflow (version {data.get('version', '?')})"})
    unknown: dict[str, list[str]] = {}
    raw_values: dict[str, Any] = {}
    notes: list[dict[str, Any]] = []
    for node in nodes.values():
        if node.type in NOTE_TYPES:
            notes.append(_note(node))
            continue
        if node.type in (REROUTE, PRIMITIVE):
            continue
        cls = lookup(node.type)
        if cls is None:
            unknown.setdefault(node.type, []).append(node.id)
            if isinstance(node.widgets_values, list):
                raw_values[node.id] = list(node.widgets_values)
        workflow.nodes[node.id] = _node_doc(node, cls, pushed.get(node.id, {}), warnings)
    workflow.links = [link for link in links
                      if link.source in workflow.nodes and link.target in workflow.nodes]
    for link in workflow.links:
        if link.type == ANY:  # an untyped link (e.g. out of a reroute chain) takes its source's output type
            link.type = output_type_of(workflow, lookup, link) or ANY
    workflow.groups = [_ui_group(raw, f"groups[{index}]", str(index + 1))
                       for index, raw in enumerate(raw_groups)]
    if notes:
        workflow.meta["notes"] = notes
    if raw_values:
        workflow.meta["comfy_widgets_values"] = raw_values
    if flat is not None and flat.instances:
        workflow.meta["comfy_subgraphs"] = flat.instances
    if unknown:
        warnings.append(unknown_types_message(unknown))
    return workflow, warnings


def _node_doc(node: _UiNode, cls: type[NodeType] | None, pushed: dict[str, tuple[Any, str | None]],
              warnings: list[str]) -> NodeDoc:
    """The Sluice node of a UI node, with the values PrimitiveNodes push into its inputs."""
    if cls is not None:
        widgets, controls = _ui_widgets(node, cls, warnings)
    else:
        widgets = dict(node.widgets_values) if isinstance(node.widgets_values, dict) else {}
        controls = {}
    for input_name, (value, control) in pushed.items():
        widgets[input_name] = value
        spec = cls.input_named(input_name) if cls is not None else None
        if control is not None and (cls is None or (spec is not None and spec.kind == SEED)):
            controls[input_name] = control
    title = "" if node.title in (node.type, cls.display_name if cls else node.type) else node.title
    return NodeDoc(node.id, node.type, title, node.pos, node.size, widgets, controls, node.mode,
                   node.collapsed, node.color)


def unknown_types_message(unknown: dict[str, list[str]]) -> str:
    """One message naming every node type Sluice lacks and the nodes that use it."""
    parts = []
    for type_name in sorted(unknown):
        ids = sorted(unknown[type_name], key=id_sort_key)
        parts.append(f"{type_name} (node{'s' if len(ids) > 1 else ''} {', '.join(ids)})")
    count = sum(len(ids) for ids in unknown.values())
    return (f"{count} node(s) have types Sluice does not know: {'; '.join(parts)}. They are kept in the "
            f"graph and marked as errors; install a plugin that provides them, or replace them")


def _ui_node(raw: Any, where: str) -> _UiNode:
    if not isinstance(raw, dict):
        raise WorkflowError(f"{where} must be an object, got {raw!r}")
    node_id = _node_id(raw.get("id"), f"{where}: field 'id'")
    where = f"node {node_id}"
    type_name = raw.get("type")
    if not isinstance(type_name, str) or not type_name:
        raise WorkflowError(f"{where}: field 'type' must be a non-empty string, got {type_name!r}")
    where = f"node {node_id} ({type_name})"
    mode_number = raw.get("mode", 0)
    if not isinstance(mode_number, int) or isinstance(mode_number, bool) or mode_number not in UI_MODES:
        raise WorkflowError(f"{where}: unknown mode {mode_number!r}; accepted: 0 (always), 2 (never), "
                            f"4 (bypass)")
    flags = raw.get("flags") or {}
    if not isinstance(flags, dict):
        raise WorkflowError(f"{where}: field 'flags' must be an object, got {flags!r}")
    title = raw.get("title", "")
    color = raw.get("color", raw.get("bgcolor"))
    inputs = []
    for index, slot in enumerate(list_field(raw, "inputs", where)):
        if not isinstance(slot, dict):
            raise WorkflowError(f"{where}: inputs[{index}] must be an object, got {slot!r}")
        widget = slot.get("widget")
        widget_name = widget.get("name") if isinstance(widget, dict) else None
        link = slot.get("link")
        inputs.append(_UiInput(str(slot.get("name", "")), None if link is None else str(link),
                               str(widget_name) if widget_name is not None else None))
    values = raw.get("widgets_values", [])
    if values is None:
        values = []
    if not isinstance(values, (list, dict)):
        raise WorkflowError(f"{where}: field 'widgets_values' must be a list or an object, got {values!r}")
    size = raw.get("size")
    return _UiNode(
        id=node_id, type=type_name, title=title if isinstance(title, str) else "",
        pos=_pair(raw.get("pos", [0, 0]), f"{where}: field 'pos'"),
        size=None if size is None else _pair(size, f"{where}: field 'size'"),
        mode=UI_MODES[mode_number], collapsed=bool(flags.get("collapsed", False)),
        color=color if isinstance(color, str) else None, inputs=inputs, widgets_values=values)


def _node_id(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or value == "":
        raise WorkflowError(f"{where} must be an integer or a non-empty string, got {value!r}")
    return str(value)


def _pair(value: Any, where: str) -> tuple[float, float]:
    """[x, y] or LiteGraph's typed-array form {"0": x, "1": y}."""
    if isinstance(value, dict):
        value = [value.get("0"), value.get("1")]
    if not isinstance(value, list) or len(value) < 2 or not all(is_coordinate(v) for v in value[:2]):
        raise WorkflowError(f"{where} must be two numbers [a, b] or {{\"0\": a, \"1\": b}} within "
                            f"\u00b1{MAX_COORDINATE:g}, got {value!r}")
    return float(value[0]), float(value[1])



def _ui_link(raw: Any, where: str, nodes: dict[str, _UiNode], warnings: list[str]) -> Link | None:
    """A link of the file, its target slot turned into an input name; None (and a warning) if it dangles."""
    if isinstance(raw, list):
        if len(raw) < 6:
            raise WorkflowError(f"{where} must be [id, origin_id, origin_slot, target_id, target_slot, "
                                f"type], got {raw!r}")
        fields = dict(zip(LINK_FIELDS, raw[:6], strict=True))
    elif isinstance(raw, dict):
        missing = [key for key in LINK_FIELDS[:5] if key not in raw]
        if missing:
            raise WorkflowError(f"{where}: missing field(s) {', '.join(missing)} in {raw!r}")
        fields = raw
    else:
        raise WorkflowError(f"{where} must be a list or an object, got {raw!r}")
    link_id = _node_id(fields["id"], f"{where}: id")
    where = f"link {link_id}"
    source = _node_id(fields["origin_id"], f"{where}: origin_id")
    target = _node_id(fields["target_id"], f"{where}: target_id")
    output, slot = fields["origin_slot"], fields["target_slot"]
    for name, value in (("origin_slot", output), ("target_slot", slot)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise WorkflowError(f"{where}: {name} must be an integer 0 or more, got {value!r}")
    for end in (source, target):
        if end not in nodes:
            warnings.append(f"{where} points at missing node {end}; it was dropped")
            return None
    target_inputs = nodes[target].inputs
    if slot < len(target_inputs) and target_inputs[slot].link in (link_id, None):
        input_name = target_inputs[slot].name
    else:
        named = [entry.name for entry in target_inputs if entry.link == link_id]
        if not named:
            warnings.append(f"{where} goes to slot {slot} of node {target}, which has no such input; "
                            f"it was dropped")
            return None
        input_name = named[0]
    link_type = fields.get("type")
    return Link(link_id, source, output, target, input_name, link_type if isinstance(link_type, str) else ANY)


def _resolve_reroutes(nodes: dict[str, _UiNode], links: list[Link], warnings: list[str]) -> list[Link]:
    """Replace each chain source -> Reroute -> ... -> target by one link source -> target."""
    into_reroute = {link.target: link for link in links if nodes[link.target].type == REROUTE}
    resolved = []
    for link in links:
        if nodes[link.target].type == REROUTE:
            continue
        seen: set[str] = set()
        while nodes[link.source].type == REROUTE:
            if link.source in seen:
                raise WorkflowError(f"reroute nodes {', '.join(sorted(seen, key=id_sort_key))} form a loop")
            seen.add(link.source)
            upstream = into_reroute.get(link.source)
            if upstream is None:
                warnings.append(f"link {link.id} comes from reroute node {link.source}, which has no input; "
                                f"it was dropped")
                break
            link = replace(link, source=upstream.source, output=upstream.output,
                           type=upstream.type if link.type == ANY else link.type)
        else:
            resolved.append(link)
    return resolved


def _resolve_primitives(nodes: dict[str, _UiNode], links: list[Link], warnings: list[str]
                        ) -> tuple[list[Link], dict[str, dict[str, tuple[Any, str | None]]]]:
    """Drop the links out of PrimitiveNodes; return target -> input -> (value, seed control or None)."""
    kept: list[Link] = []
    pushed: dict[str, dict[str, tuple[Any, str | None]]] = {}
    for link in links:
        primitive = nodes[link.source]
        if primitive.type != PRIMITIVE:
            kept.append(link)
            continue
        values = primitive.widgets_values
        if not isinstance(values, list) or not values:
            warnings.append(f"node {primitive.id} (PrimitiveNode) has no value; input {link.input!r} of node "
                            f"{link.target} keeps its own")
            continue
        control = _seed_control(values[1]) if len(values) > 1 and (
            isinstance(values[1], bool) or values[1] in SEED_CONTROLS) else None
        pushed.setdefault(link.target, {})[link.input] = (values[0], control)
    return kept, pushed


def _seed_control(value: str | bool) -> str:
    """A seed's control after generate; older files (and the frontend's own default graph) hold a boolean,
    the old "random seed after every generation" toggle: true = "randomize", false = "fixed"."""
    if isinstance(value, bool):
        return "randomize" if value else "fixed"
    return value


def _ui_widgets(node: _UiNode, cls: type[NodeType],
                warnings: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Widget values by input name, and seed controls, from a node's positional (or named) widgets_values."""
    defaults = cls.default_widget_values()
    widgets: dict[str, Any] = {}
    controls: dict[str, str] = {}
    socket_only = {entry.name for entry in node.inputs if entry.widget is None}
    values = node.widgets_values
    if isinstance(values, list):
        values = named_ui_values(node.type, cls, values, f"node {node.id} ({node.type})", warnings)
    if isinstance(values, dict):
        widgets = {name: values[name] for name in defaults if name in values}
    else:
        slotted = [spec for spec in cls.widget_inputs() if spec.name not in socket_only]
        cursor = 0
        for index, spec in enumerate(slotted):
            if cursor >= len(values):
                break
            widgets[spec.name] = values[cursor]
            cursor += 1
            control_follows = cursor < len(values) and isinstance(values[cursor], str) \
                and values[cursor] in SEED_CONTROLS
            legacy_control = cursor < len(values) and isinstance(values[cursor], bool)
            if spec.kind == SEED and (control_follows or legacy_control):
                controls[spec.name] = _seed_control(values[cursor])
                cursor += 1
            elif spec.kind == INT and control_follows and len(values) - cursor > len(slotted) - index - 1:
                cursor += 1  # ComfyUI gave this INT a control after generate; Sluice keeps none for INT
    missing = [name for name in defaults
               if name not in widgets and name not in socket_only and name not in SLUICE_ONLY_WIDGETS]
    if missing:
        warnings.append(f"node {node.id} ({node.type}): widgets_values has no value for "
                        f"{', '.join(missing)}; using the default{'s' if len(missing) > 1 else ''}")
    return {name: widgets.get(name, default) for name, default in defaults.items()}, controls


def _note(node: _UiNode) -> dict[str, Any]:
    values = node.widgets_values
    text = values[0] if isinstance(values, list) and values else ""
    return {"id": node.id, "type": node.type, "title": node.title,
            "text": text if isinstance(text, str) else "", "pos": list(node.pos),
            "size": list(node.size or NOTE_SIZE)}


def _ui_group(raw: Any, where: str, group_id: str) -> Group:
    if not isinstance(raw, dict):
        raise WorkflowError(f"{where} must be an object, got {raw!r}")
    bounding = raw.get("bounding")
    if (not isinstance(bounding, list) or len(bounding) != 4
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bounding)):
        raise WorkflowError(f"{where}: field 'bounding' must be [x, y, width, height], got {bounding!r}")
    title, color = raw.get("title", ""), raw.get("color")
    return Group(group_id, title if isinstance(title, str) else "", tuple(float(v) for v in bounding),
                 color if isinstance(color, str) else None)


# -- API format --

def from_comfy_api(data: Any, lookup: Lookup) -> tuple[Workflow, list[str]]:
    """A Sluice workflow from a parsed ComfyUI API prompt, laid out in columns by depth, and warnings."""
    if not isinstance(data, dict) or not data:
        raise WorkflowError("not a ComfyUI API prompt: expected a non-empty object of nodes by id")
    warnings: list[str] = []
    workflow = Workflow(meta={"imported_from": "ComfyUI API prompt"})
    unknown: dict[str, list[str]] = {}
    pending: list[tuple[str, str, str, int]] = []  # (target, input, source, output)
    for node_id in sorted(data, key=id_sort_key):
        raw = data[node_id]
        where = f"node {node_id}"
        if not isinstance(raw, dict):
            raise WorkflowError(f"{where} must be an object, got {raw!r}")
        type_name = raw.get("class_type")
        if not isinstance(type_name, str) or not type_name:
            raise WorkflowError(f"{where}: field 'class_type' must be a non-empty string, got {type_name!r}")
        where = f"node {node_id} ({type_name})"
        inputs = raw.get("inputs", {})
        if not isinstance(inputs, dict):
            raise WorkflowError(f"{where}: field 'inputs' must be an object, got {inputs!r}")
        widgets: dict[str, Any] = {}
        for name, value in inputs.items():
            if _is_api_link(value):
                source = str(value[0])
                if source not in data:
                    raise WorkflowError(f"{where}: input {name!r} links to missing node {source!r}")
                pending.append((node_id, name, source, value[1]))
            else:
                widgets[name] = value
        cls = lookup(type_name)
        if cls is None:
            unknown.setdefault(type_name, []).append(node_id)
        else:
            widgets = _api_widgets(where, cls, widgets, {name for target, name, _, _ in pending
                                                         if target == node_id}, warnings)
        meta = raw.get("_meta")
        title = meta.get("title", "") if isinstance(meta, dict) else ""
        if not isinstance(title, str) or title in (type_name, cls.display_name if cls else type_name):
            title = ""
        workflow.nodes[node_id] = NodeDoc(node_id, type_name, title, widgets=widgets)
    for target, name, source, output in pending:
        workflow.links.append(Link(workflow.new_link_id(), source, output, target, name,
                                   _api_link_type(workflow, lookup, source, output, target, name)))
    for node_id, pos in layered_positions(workflow).items():
        workflow.nodes[node_id].pos = pos
    if unknown:
        warnings.append(unknown_types_message(unknown))
    return workflow, warnings


def _is_api_link(value: Any) -> bool:
    """ComfyUI's rule: a two-item list [node id, output index] is a link."""
    if not isinstance(value, list) or len(value) != 2:
        return False
    node_id, output = value
    return (isinstance(node_id, (str, int)) and not isinstance(node_id, bool)
            and isinstance(output, int) and not isinstance(output, bool) and output >= 0)


def _api_widgets(where: str, cls: type[NodeType], given: dict[str, Any], linked: set[str],
                 warnings: list[str]) -> dict[str, Any]:
    defaults = cls.default_widget_values()
    given = sluice_api_inputs(cls.type_name, given, where, warnings)
    extra = [name for name in given if name not in defaults]
    if extra:
        warnings.append(f"{where}: inputs {', '.join(extra)} are not widgets of the Sluice node type; "
                        f"ignored")
    missing = [name for name in defaults
               if name not in given and name not in linked and name not in SLUICE_ONLY_WIDGETS]
    if missing:
        warnings.append(f"{where}: no value for {', '.join(missing)}; using the "
                        f"default{'s' if len(missing) > 1 else ''}")
    return {name: given.get(name, default) for name, default in defaults.items()}


def _api_link_type(workflow: Workflow, lookup: Lookup, source: str, output: int, target: str,
                   name: str) -> str:
    """The source output's declared type, else the target input's, else "*"."""
    source_cls = lookup(workflow.nodes[source].type)
    if source_cls is not None and output < len(source_cls.outputs):
        return source_cls.outputs[output].type
    target_cls = lookup(workflow.nodes[target].type)
    spec = target_cls.input_named(name) if target_cls is not None else None
    return spec.link_type if spec is not None else ANY


def layered_positions(workflow: Workflow) -> dict[str, tuple[float, float]]:
    """A column per depth (longest path from a source; a cycle shares one column), rows in id order."""
    import networkx as nx  # here, not at import: opening a file in the desktop app does not need it

    graph = nx.DiGraph()
    graph.add_nodes_from(workflow.nodes)
    graph.add_edges_from((link.source, link.target) for link in workflow.links
                         if link.source in workflow.nodes and link.target in workflow.nodes)
    condensed = nx.condensation(graph)  # a DAG of strongly connected components
    depth: dict[int, int] = {}
    for component in nx.topological_sort(condensed):
        depth[component] = max((depth[p] + 1 for p in condensed.predecessors(component)), default=0)
    columns: dict[int, list[str]] = {}
    for node_id, component in condensed.graph["mapping"].items():
        columns.setdefault(depth[component], []).append(node_id)
    positions = {}
    for column, node_ids in columns.items():
        for row, node_id in enumerate(sorted(node_ids, key=id_sort_key)):
            positions[node_id] = (column * COLUMN_WIDTH, row * ROW_HEIGHT)
    return positions
