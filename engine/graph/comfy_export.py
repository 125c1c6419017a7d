"""Write Sluice workflows as ComfyUI files: an API prompt (what ComfyUI's /prompt runs) or a UI workflow.

Node types are written under their Sluice names, which are ComfyUI's for the types both share. In the API
prompt muted nodes are left out and bypassed nodes are resolved through as Sluice's executor runs them (each
output passes on the first linked input of the same type); seed controls are not part of a prompt. The UI
workflow keeps every node with its mode, lists link inputs and linked widgets (as converted widgets) in
`inputs`, writes `widgets_values` positionally with each seed followed by its control (in ComfyUI's layout for
the types engine/graph/comfy_widgets.py translates), and turns `meta["notes"]` back into Note nodes. Sampler
and scheduler values under stable-diffusion.cpp's names (`dpm++2m`, `euler_a`, `discrete`), which Sluice
accepts and ComfyUI does not, are written under ComfyUI's names for the same sampler (`comfy_choice`).
"""

from __future__ import annotations

import json
from typing import Any

from engine.graph.comfy import NOTE_SIZE, Lookup
from engine.graph.comfy_widgets import comfy_api_extras, comfy_ui_values
from engine.graph.document import Link, NodeDoc, Workflow, id_sort_key
from engine.graph.spec import ANY, SEED, NodeType

EXPORT_FORMATS = ("comfy-ui", "comfy-api")  # a UI workflow (ComfyUI's Load), an API prompt (its /prompt)
UI_MODE_NUMBERS = {"normal": 0, "muted": 2, "bypassed": 4}
GROUP_COLOR = "#3f789e"  # ComfyUI's default group colour


def export_text(workflow: Workflow, lookup: Lookup, format_name: str) -> str:
    """`workflow` as the JSON text of a ComfyUI file in one of EXPORT_FORMATS."""
    if format_name not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {format_name!r}; accepted: {', '.join(EXPORT_FORMATS)}")
    data = to_comfy_ui(workflow, lookup) if format_name == "comfy-ui" else to_api_prompt(workflow, lookup)
    return json.dumps(data, indent=2) + "\n"


def to_api_prompt(workflow: Workflow, lookup: Lookup) -> dict[str, Any]:
    """The ComfyUI API prompt of `workflow`: {node_id: {"inputs", "class_type", "_meta": {"title"}}}."""
    prompt: dict[str, Any] = {}
    for node_id in sorted(workflow.nodes, key=id_sort_key):
        node = workflow.nodes[node_id]
        if node.mode != "normal":
            continue
        cls = lookup(node.type)
        sources = {name: _live_source(workflow, lookup, link)
                   for name, link in workflow.links_into(node_id).items()}
        inputs: dict[str, Any] = {}
        if cls is None:
            inputs.update(node.widgets)
        else:
            defaults = cls.default_widget_values()
            for spec in cls.inputs:
                if spec.is_widget and sources.get(spec.name) is None:
                    value = node.widgets.get(spec.name, defaults[spec.name])
                    inputs[spec.name] = comfy_choice(spec.name, value)
            inputs.update(comfy_api_extras(node.type, inputs))
        for name, source in sources.items():
            if source is not None:
                inputs[name] = [source[0], source[1]]
        title = node.title or (cls.display_name if cls is not None else node.type)
        prompt[node_id] = {"inputs": inputs, "class_type": node.type, "_meta": {"title": title}}
    return prompt


def _live_source(workflow: Workflow, lookup: Lookup, link: Link) -> tuple[str, int] | None:
    """The (node, output) that really feeds `link`, looking through bypassed nodes; None if nothing does."""
    seen: set[str] = set()
    while True:
        source = workflow.nodes.get(link.source)
        if source is None or source.mode == "muted" or link.source in seen:
            return None
        if source.mode == "normal":
            return link.source, link.output
        seen.add(link.source)
        passed = _bypassed_input(workflow, lookup, source, link)
        if passed is None:
            return None
        link = passed


def _bypassed_input(workflow: Workflow, lookup: Lookup, node: NodeDoc, out_link: Link) -> Link | None:
    """The link into bypassed `node` whose value output `out_link.output` passes on (first of its type)."""
    cls = lookup(node.type)
    links_in = workflow.links_into(node.id)
    if cls is None:
        return next((link for link in links_in.values() if link.type == out_link.type), None)
    if out_link.output >= len(cls.outputs):
        return None
    wanted = cls.outputs[out_link.output].type
    for spec in cls.inputs:
        link = links_in.get(spec.name)
        if link is not None and wanted in (spec.link_type, _output_type(workflow, lookup, link)):
            return link
    return None


def _output_type(workflow: Workflow, lookup: Lookup, link: Link) -> str | None:
    source = workflow.nodes.get(link.source)
    cls = lookup(source.type) if source is not None else None
    return cls.outputs[link.output].type if cls is not None and link.output < len(cls.outputs) else None


def to_comfy_ui(workflow: Workflow, lookup: Lookup) -> dict[str, Any]:
    """`workflow` as a ComfyUI UI-format workflow, version 0.4 (node ids kept where numeric)."""
    numbers = _comfy_ids(workflow.nodes)
    last_into = {(link.target, link.input): link for link in workflow.links}
    kept = [link for link in workflow.links if last_into[link.target, link.input] is link  # as links_into
            and link.source in workflow.nodes and link.target in workflow.nodes]
    link_numbers = {link.id: index + 1 for index, link in enumerate(kept)}
    nodes: list[dict[str, Any]] = []
    slots: dict[str, int] = {}  # link id -> index in its target's UI inputs
    for order, node_id in enumerate(workflow.nodes):
        node = workflow.nodes[node_id]
        cls = lookup(node.type)
        inputs = _ui_inputs(workflow, node, cls, link_numbers)
        for index, entry in enumerate(inputs):
            link_id = entry.pop("link_id")
            if link_id is not None:
                slots[link_id] = index
        outputs = _ui_outputs(workflow, node, cls, link_numbers)
        values = _ui_widgets_values(workflow, node, cls)
        entry = {"id": numbers[node_id], "type": node.type, "pos": list(node.pos),
                 "size": list(node.size) if node.size else [320.0, 30.0 + 24.0 * (len(inputs) + len(values))],
                 "flags": {"collapsed": True} if node.collapsed else {}, "order": order,
                 "mode": UI_MODE_NUMBERS[node.mode], "inputs": inputs, "outputs": outputs,
                 "properties": {"Node name for S&R": node.type}, "widgets_values": values}
        if node.title:
            entry["title"] = node.title
        if node.color:
            entry["color"] = node.color
        nodes.append(entry)
    for note in workflow.meta.get("notes", []):
        note = note if isinstance(note, dict) else {}
        wanted = str(note.get("id", ""))
        note_id = int(wanted) if wanted.isdigit() and int(wanted) not in numbers.values() \
            else max(entry["id"] for entry in nodes) + 1 if nodes else 1
        numbers[f"note {note_id}"] = note_id
        nodes.append(_note_node(note, note_id, len(nodes)))
    links = [[link_numbers[link.id], numbers[link.source], link.output, numbers[link.target], slots[link.id],
              link.type] for link in kept]
    groups = [{"title": group.title, "bounding": list(group.rect), "color": group.color or GROUP_COLOR,
               "font_size": 24} for group in workflow.groups]
    return {"last_node_id": max((node["id"] for node in nodes), default=0), "last_link_id": len(links),
            "nodes": nodes, "links": links, "groups": groups, "config": {}, "extra": {}, "version": 0.4}


def _comfy_ids(nodes: dict[str, NodeDoc]) -> dict[str, int]:
    """Numeric ids kept; other ids numbered after the largest."""
    numbers = {node_id: int(node_id) for node_id in nodes if node_id.isdigit()}
    next_id = max(numbers.values(), default=0) + 1
    for node_id in sorted(nodes, key=id_sort_key):
        if node_id not in numbers:
            numbers[node_id] = next_id
            next_id += 1
    return numbers


def _ui_inputs(workflow: Workflow, node: NodeDoc, cls: type[NodeType] | None,
               link_numbers: dict[str, int]) -> list[dict[str, Any]]:
    """Link inputs in declaration order, linked widgets as converted widgets, then links to undeclared names;
    each entry carries "link_id" (the Sluice link id) for the caller to pop."""
    links_in = workflow.links_into(node.id)
    entries: list[dict[str, Any]] = []
    declared = set()
    for spec in cls.inputs if cls is not None else ():
        link = links_in.get(spec.name)
        if spec.is_widget and link is None:
            continue
        declared.add(spec.name)
        entry = {"name": spec.name, "type": spec.link_type, "link": link_numbers[link.id] if link else None,
                 "link_id": link.id if link else None}
        if spec.is_widget:
            entry["widget"] = {"name": spec.name}
        entries.append(entry)
    for name, link in links_in.items():
        if name not in declared:
            entries.append({"name": name, "type": link.type, "link": link_numbers[link.id],
                            "link_id": link.id})
    return entries


def _ui_outputs(workflow: Workflow, node: NodeDoc, cls: type[NodeType] | None,
                link_numbers: dict[str, int]) -> list[dict[str, Any]]:
    links_out = workflow.links_from(node.id)
    if cls is not None:
        declared = [(output.name, output.type) for output in cls.outputs]
    else:
        count = max((link.output + 1 for link in links_out), default=0)
        types = {link.output: link.type for link in links_out}
        declared = [(types.get(index, ANY), types.get(index, ANY)) for index in range(count)]
    return [{"name": name, "type": type_name, "slot_index": index,
             "links": [link_numbers[link.id] for link in links_out
                       if link.output == index and link.id in link_numbers]}
            for index, (name, type_name) in enumerate(declared)]


def _ui_widgets_values(workflow: Workflow, node: NodeDoc, cls: type[NodeType] | None) -> list[Any]:
    if cls is None:
        raw = workflow.meta.get("comfy_widgets_values", {}).get(node.id)
        return list(raw) if isinstance(raw, list) else list(node.widgets.values())
    defaults = cls.default_widget_values()
    translated = comfy_ui_values(node.type, cls, {**defaults, **node.widgets})
    if translated is not None:
        return translated
    values: list[Any] = []
    for spec in cls.widget_inputs():
        values.append(comfy_choice(spec.name, node.widgets.get(spec.name, defaults[spec.name])))
        if spec.kind == SEED:
            values.append(node.seed_controls.get(spec.name, "fixed"))
    return values


def comfy_choice(name: str, value: Any) -> Any:
    """ComfyUI's name for a sampler or scheduler value given under another name of the same one (the first of
    its spellings in the engine's registries, which list ComfyUI's first), else `value` as it is."""
    if name in ("sampler_name", "scheduler") and isinstance(value, str):
        from engine.sampling.registry import SAMPLER_ALIASES, SAMPLERS
        from engine.sampling.schedulers import SCHEDULERS

        if name == "sampler_name" and value in SAMPLERS:
            function = SAMPLERS[value]
            return next((alias for alias, target in SAMPLER_ALIASES.items() if SAMPLERS[target] is function),
                        value)
        if name == "scheduler" and value in SCHEDULERS:
            return next(key for key, function in SCHEDULERS.items() if function is SCHEDULERS[value])
    return value


def _note_node(note: dict[str, Any], node_id: int, order: int) -> dict[str, Any]:
    pos = note.get("pos", [0.0, 0.0])
    size = note.get("size") or list(NOTE_SIZE)
    entry = {"id": node_id, "type": note.get("type", "Note"), "pos": pos, "size": size, "flags": {},
             "order": order, "mode": 0, "inputs": [], "outputs": [], "properties": {},
             "widgets_values": [note.get("text", "")]}
    if note.get("title"):
        entry["title"] = note["title"]
    return entry
