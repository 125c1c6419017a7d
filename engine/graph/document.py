"""The workflow document: nodes, links, groups, settings; JSON with a format name and a version.

Layout of version 2 (the current one):

    {"format": "sluice-workflow", "version": 2,
     "nodes": [{"id": "1", "type": "KSampler", "title": "", "pos": [x, y], "size": [w, h] | null,
                "widgets": {...}, "seed_controls": {"seed": "randomize"}, "mode": "normal",
                "collapsed": false, "color": null}, ...],
     "links": [{"id": "1", "source": "1", "output": 0, "target": "2", "input": "model", "type": "MODEL"},
               ...],
     "groups": [{"id": "1", "title": "...", "rect": [x, y, w, h], "color": null}, ...],
     "settings": {"memory": {"backend": "...", ...}, ...},
     "meta": {...}}

Version 1 kept nodes as {"id": 1, "type", "pos", "widgets_values": {...}} and links as
[source, output, target, input] arrays without ids or types; `migrate` upgrades it.
"""

from __future__ import annotations

import copy as copy_module
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.graph.errors import WorkflowError
from engine.graph.spec import ANY
from engine.jsonfile import MAX_BYTES, JsonInputError, load_json

FORMAT = "sluice-workflow"
# The largest canvas position or node size read from a file, either sign (Qt maps scene points to int pixels).
MAX_COORDINATE = 1e9
VERSION = 2
MODES = ("normal", "muted", "bypassed")


@dataclass
class NodeDoc:
    id: str
    type: str
    title: str = ""
    pos: tuple[float, float] = (0.0, 0.0)
    size: tuple[float, float] | None = None
    widgets: dict[str, Any] = field(default_factory=dict)
    seed_controls: dict[str, str] = field(default_factory=dict)  # input name -> a spec.SEED_CONTROLS entry
    mode: str = "normal"  # one of MODES
    collapsed: bool = False
    color: str | None = None


@dataclass
class Link:
    """Output `output` (an index) of node `source` feeds input `input` (a name) of node `target`."""

    id: str
    source: str
    output: int
    target: str
    input: str
    type: str  # the data type carried, e.g. "MODEL"


@dataclass
class Group:
    id: str
    title: str
    rect: tuple[float, float, float, float]  # x, y, width, height
    color: str | None = None


def id_sort_key(node_id: str) -> tuple[int, int, str]:
    """Numeric ids in numeric order, then the others by name."""
    return (0, int(node_id), "") if node_id.isdigit() else (1, 0, node_id)


def _next_id(existing: Any) -> str:
    return str(max((int(i) for i in existing if i.isdigit()), default=0) + 1)


@dataclass
class Workflow:
    nodes: dict[str, NodeDoc] = field(default_factory=dict)
    links: list[Link] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)  # reserved key "memory": {"backend": "...", ...}
    meta: dict[str, Any] = field(default_factory=dict)

    # -- editing --

    def new_node_id(self) -> str:
        return _next_id(self.nodes)

    def new_link_id(self) -> str:
        return _next_id(link.id for link in self.links)

    def new_group_id(self) -> str:
        return _next_id(group.id for group in self.groups)

    def add_node(self, type: str, widgets: dict[str, Any] | None = None,
                 pos: tuple[float, float] = (0.0, 0.0), **fields: Any) -> NodeDoc:
        """Add a node of type `type` under a fresh id; `fields` sets other NodeDoc fields (title, mode)."""
        node = NodeDoc(self.new_node_id(), type, pos=(float(pos[0]), float(pos[1])),
                       widgets=dict(widgets or {}), **fields)
        self.nodes[node.id] = node
        return node

    def connect(self, source: str, output: int, target: str, input: str, type: str) -> Link:
        """Link output `output` of `source` to input `input` of `target`, replacing a link into that input."""
        for node_id in (source, target):
            if node_id not in self.nodes:
                raise WorkflowError(f"cannot connect: no node with id {node_id!r}")
        self.links = [link for link in self.links if not (link.target == target and link.input == input)]
        link = Link(self.new_link_id(), source, int(output), target, input, type)
        self.links.append(link)
        return link

    def remove_node(self, node_id: str) -> NodeDoc:
        """Remove a node and every link into or out of it; returns the removed node."""
        if node_id not in self.nodes:
            raise WorkflowError(f"cannot remove: no node with id {node_id!r}")
        self.links = [link for link in self.links if node_id not in (link.source, link.target)]
        return self.nodes.pop(node_id)

    def links_into(self, node_id: str) -> dict[str, Link]:
        """The links into a node by input name (the last one wins if a malformed document has two)."""
        return {link.input: link for link in self.links if link.target == node_id}

    def links_from(self, node_id: str) -> list[Link]:
        return [link for link in self.links if link.source == node_id]

    def copy(self) -> Workflow:
        return copy_module.deepcopy(self)

    # -- serialisation --

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "nodes": [_node_to_dict(node) for node in self.nodes.values()],
            "links": [{"id": link.id, "source": link.source, "output": link.output, "target": link.target,
                       "input": link.input, "type": link.type} for link in self.links],
            "groups": [{"id": group.id, "title": group.title, "rect": list(group.rect), "color": group.color}
                       for group in self.groups],
            "settings": copy_module.deepcopy(self.settings),
            "meta": copy_module.deepcopy(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Workflow:
        """Build a workflow from a parsed file of any supported version; every problem is a WorkflowError."""
        data = migrate(data)
        nodes: dict[str, NodeDoc] = {}
        for index, raw in enumerate(_get(data, "nodes", list, "workflow", [])):
            node = _node_from_dict(raw, f"nodes[{index}]")
            if node.id in nodes:
                raise WorkflowError(f"duplicate node id {node.id!r} (nodes[{index}])")
            nodes[node.id] = node
        links: list[Link] = []
        link_ids: set[str] = set()
        for index, raw in enumerate(_get(data, "links", list, "workflow", [])):
            link = _link_from_dict(raw, f"links[{index}]")
            if link.id in link_ids:
                raise WorkflowError(f"duplicate link id {link.id!r} (links[{index}])")
            for end in (link.source, link.target):
                if end not in nodes:
                    raise WorkflowError(f"link {link.id!r} points at missing node {end!r}")
            link_ids.add(link.id)
            links.append(link)
        groups: list[Group] = []
        for index, raw in enumerate(_get(data, "groups", list, "workflow", [])):
            group = _group_from_dict(raw, f"groups[{index}]")
            if any(g.id == group.id for g in groups):
                raise WorkflowError(f"duplicate group id {group.id!r} (groups[{index}])")
            groups.append(group)
        settings = _get(data, "settings", dict, "workflow", {})
        memory = settings.get("memory", {})
        if not isinstance(memory, dict) or not all(isinstance(v, str) for v in memory.values()):
            raise WorkflowError(f"settings.memory must be an object of placement strings, got {memory!r}")
        meta = _get(data, "meta", dict, "workflow", {})
        return cls(nodes, links, groups, copy_module.deepcopy(settings), copy_module.deepcopy(meta))

    def dumps(self) -> str:
        """Stable, indented JSON (the same document always gives the same text)."""
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def loads(cls, text: str | bytes, source: str = "<string>") -> Workflow:
        """The workflow in JSON `text` (bytes must be UTF-8), read through engine.jsonfile's limits."""
        try:
            data = load_json(text, source)
        except JsonInputError as error:
            raise WorkflowError(str(error)) from None
        try:
            return cls.from_dict(data)
        except WorkflowError as error:
            raise WorkflowError(f"{source}: {error}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically: a temporary file in the same folder, then os.replace."""
        path = Path(path)
        fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(self.dumps())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp_name, path)
        except BaseException:
            if os.path.exists(temp_name):
                os.unlink(temp_name)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Workflow:
        try:
            with open(path, "rb") as handle:
                content = handle.read(MAX_BYTES + 1)  # more is refused by load_json
        except OSError as error:
            raise WorkflowError(f"cannot read workflow {str(path)!r}: {error}") from None
        return cls.loads(content, source=str(path))


# -- migration --

def _v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    """Version 1 -> 2: string ids, "widgets_values" -> "widgets", link arrays -> link objects with ids."""
    out = {key: value for key, value in data.items() if key not in ("nodes", "links")}
    nodes = []
    for index, raw in enumerate(_get(data, "nodes", list, "workflow", [])):
        if not isinstance(raw, dict):
            raise WorkflowError(f"nodes[{index}] must be an object, got {raw!r}")
        node = {key: value for key, value in raw.items() if key != "widgets_values"}
        if "id" in node and isinstance(node["id"], int) and not isinstance(node["id"], bool):
            node["id"] = str(node["id"])
        node["widgets"] = raw.get("widgets_values", {})
        nodes.append(node)
    links = []
    for index, raw in enumerate(_get(data, "links", list, "workflow", [])):
        if not isinstance(raw, list) or len(raw) != 4:
            raise WorkflowError(f"links[{index}] of a version 1 workflow must be "
                                f"[source, output, target, input], got {raw!r}")
        source, output, target, input_name = raw
        links.append({"id": str(index + 1), "source": str(source), "output": output, "target": str(target),
                      "input": input_name, "type": ANY})
    out["nodes"] = nodes
    out["links"] = links
    out["version"] = 2
    return out


MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _v1_to_v2}
SUPPORTED_VERSIONS = (*MIGRATIONS, VERSION)


def migrate(data: Any) -> dict[str, Any]:
    """Upgrade a parsed workflow file step by step to VERSION; returns a new dict."""
    if not isinstance(data, dict):
        raise WorkflowError(f"a workflow must be a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise WorkflowError(f"not a Sluice workflow: \"format\" is {data.get('format')!r}, "
                            f"expected {FORMAT!r}")
    version = data.get("version")
    supported = ", ".join(str(v) for v in SUPPORTED_VERSIONS)
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise WorkflowError(f"unsupported workflow version {version!r}; supported: {supported}")
    data = copy_module.deepcopy(data)
    while data["version"] != VERSION:
        data = MIGRATIONS[data["version"]](data)
    return data


# -- field parsing --

def _get(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str,
         default: Any = ...) -> Any:
    if key not in data:
        if default is ...:
            raise WorkflowError(f"{where}: missing field {key!r}")
        return default
    value = data[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        names = " or ".join(k.__name__ for k in _as_tuple(kind))
        raise WorkflowError(f"{where}: field {key!r} must be {names}, got {value!r}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _numbers(data: dict[str, Any], key: str, count: int, where: str, default: Any = ...) -> Any:
    value = _get(data, key, (list, type(None)) if default is None else list, where, default)
    if value is None or value is default:
        return value
    if len(value) != count or not all(is_coordinate(v) for v in value):
        raise WorkflowError(f"{where}: field {key!r} must be a list of {count} numbers within "
                            f"\u00b1{MAX_COORDINATE:g}, got {value!r}")
    return tuple(float(v) for v in value)


def _object(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise WorkflowError(f"{where} must be an object, got {raw!r}")
    return raw


def _node_from_dict(raw: Any, where: str) -> NodeDoc:
    raw = _object(raw, where)
    node_id = _get(raw, "id", str, where)
    where = f"node {node_id!r}"
    seed_controls = _get(raw, "seed_controls", dict, where, {})
    for name, control in seed_controls.items():
        if not isinstance(control, str):
            raise WorkflowError(f"{where}: seed control of {name!r} must be a string, got {control!r}")
    mode = _get(raw, "mode", str, where, "normal")
    if mode not in MODES:
        raise WorkflowError(f"{where}: unknown mode {mode!r}; accepted: {', '.join(MODES)}")
    return NodeDoc(
        id=node_id,
        type=_get(raw, "type", str, where),
        title=_get(raw, "title", str, where, ""),
        pos=_numbers(raw, "pos", 2, where, (0.0, 0.0)),
        size=_numbers(raw, "size", 2, where, None),
        widgets=copy_module.deepcopy(_get(raw, "widgets", dict, where, {})),
        seed_controls=dict(seed_controls),
        mode=mode,
        collapsed=_get(raw, "collapsed", bool, where, False),
        color=_get(raw, "color", (str, type(None)), where, None),
    )


def _link_from_dict(raw: Any, where: str) -> Link:
    raw = _object(raw, where)
    link_id = _get(raw, "id", str, where)
    where = f"link {link_id!r}"
    output = _get(raw, "output", int, where)
    if output < 0:
        raise WorkflowError(f"{where}: output index must be 0 or more, got {output}")
    return Link(link_id, _get(raw, "source", str, where), output, _get(raw, "target", str, where),
                _get(raw, "input", str, where), _get(raw, "type", str, where))


def _group_from_dict(raw: Any, where: str) -> Group:
    raw = _object(raw, where)
    group_id = _get(raw, "id", str, where)
    where = f"group {group_id!r}"
    return Group(group_id, _get(raw, "title", str, where, ""), _numbers(raw, "rect", 4, where),
                 _get(raw, "color", (str, type(None)), where, None))


def _node_to_dict(node: NodeDoc) -> dict[str, Any]:
    return {
        "id": node.id,
        "type": node.type,
        "title": node.title,
        "pos": list(node.pos),
        "size": None if node.size is None else list(node.size),
        "widgets": copy_module.deepcopy(node.widgets),
        "seed_controls": dict(node.seed_controls),
        "mode": node.mode,
        "collapsed": node.collapsed,
        "color": node.color,
    }


def is_coordinate(value: Any) -> bool:
    """Whether `value` is a number a canvas position or size may hold: finite, within ±MAX_COORDINATE."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and -MAX_COORDINATE <= value <= MAX_COORDINATE)
