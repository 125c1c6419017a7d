"""Flatten the subgraphs of a ComfyUI UI-format workflow into one graph, as ComfyUI's frontend does.

Format (ComfyUI frontend, litegraph `subgraph/`): `definitions.subgraphs` lists subgraph definitions, each
{"id": uuid, "name", "nodes", "links", "groups", "inputs": [{"name", "type", "linkIds"}, ...], "outputs":
[...], "definitions"?}. A node whose "type" is a definition's id is an instance of it. Its inputs and outputs
are the definition's, by index (the saved `inputs` list may hold only some of them: they are matched by
name). Inside a definition, links from node -10 (the subgraph's input node) start at subgraph input
`origin_slot`, and links to node -20 (its output node) end at subgraph output `target_slot`.

Resolution follows the frontend's ExecutableNodeDTO: an inner input fed from subgraph input k takes what
feeds the instance's input k (a link from outside, resolved through further instances), else the value of
the instance's promoted widget for k. Promoted widgets are the subgraph inputs that reach a widget input
inside; the instance's `widgets_values` lists their values in input order (one more value after a seed when
the list is longer than the promoted inputs: its "control after generate"). An instance without values
(`widgets_values` empty, as with `properties.proxyWidgets`, whose widgets show the inner nodes' own values)
leaves each inner widget its own value. An outer link from instance output j comes from what feeds the
definition's output j.

Inner nodes get the ids ComfyUI gives them in an API prompt, "instance:inner" ("57:31", nested "57:12:31"), so
`--set 57:31.seed=5` addresses them; they keep their sizes and move so that their bounding box starts at the
instance's position, inside a group named after the subgraph. A muted or bypassed instance mutes or bypasses
its inner nodes.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from engine.graph.errors import WorkflowError
from engine.graph.spec import SEED_CONTROLS

SUBGRAPH_INPUT_ID, SUBGRAPH_OUTPUT_ID = "-10", "-20"  # litegraph's ids of a subgraph's input and output nodes
MAX_DEPTH = 16  # subgraphs nested deeper than this are refused
LINK_FIELDS = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")
MODE_NORMAL, MODE_NEVER, MODE_BYPASS = 0, 2, 4  # LiteGraph mode numbers
DEFAULT_NODE_SIZE = (300.0, 120.0)  # for the bounding box of inner nodes saved without a size
GROUP_PADDING, GROUP_TITLE = 30.0, 50.0  # room around the inner nodes in the group of an expanded instance
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.IGNORECASE)

PushedValues = dict[str, dict[str, tuple[Any, str | None]]]  # node id -> input -> (value, seed control)


@dataclass
class Flattened:
    """A UI workflow's nodes, links (objects with LINK_FIELDS) and groups with every subgraph expanded."""

    nodes: list[dict[str, Any]]
    links: list[dict[str, Any]]
    groups: list[dict[str, Any]]
    pushed: PushedValues  # promoted widget values for inner node inputs
    instances: dict[str, str]  # expanded instance id ("57", "57:12") -> subgraph name


@dataclass
class _Subgraph:
    id: str
    name: str
    nodes: list[dict[str, Any]]
    links: dict[str, dict[str, Any]]  # by link id
    inputs: list[str]  # input names, by slot
    outputs: list[str]
    groups: list[dict[str, Any]]

    def label(self) -> str:
        return f"subgraph {self.name!r} ({self.id})"


@dataclass
class _Scope:
    """One graph level: the top level, or one instance's copy of its definition."""

    prefix: str  # "" at the top, "57:" inside instance 57
    nodes: dict[str, dict[str, Any]]  # raw nodes by their id within this level
    links: dict[str, dict[str, Any]]
    mode: int  # the enclosing instances' mode (MODE_NORMAL, MODE_NEVER or MODE_BYPASS)
    subgraph: _Subgraph | None = None  # None at the top
    parent: _Scope | None = None
    instance_id: str = ""  # the instance's id in the parent level
    outer_links: dict[int, str] = field(default_factory=dict)  # input slot -> id of the parent's link into it
    values: dict[int, tuple[Any, str | None]] = field(default_factory=dict)  # input slot -> promoted value
    children: dict[str, _Scope] = field(default_factory=dict)  # instance node id -> its scope
    shifts: list[tuple[float, float]] = field(default_factory=list)  # (x, dx): nodes from x on move right dx
    offset: tuple[float, float] = (0.0, 0.0)  # where this level's (shifted) positions are placed

    def place(self, pos: Any) -> tuple[float, float]:
        """Where a node at `pos` of this level lands in the flat graph."""
        x, y = _position(pos)
        return self.offset[0] + self.shifted(x), self.offset[1] + y

    def shifted(self, x: float) -> float:
        """x moved right past the instances on its left that grew when expanded."""
        return x + sum(dx for start, dx in self.shifts if x >= start)


def has_subgraphs(data: dict[str, Any]) -> bool:
    """Whether a UI workflow defines subgraphs or has nodes whose type is a subgraph id."""
    definitions = data.get("definitions")
    if isinstance(definitions, dict) and definitions.get("subgraphs"):
        return True
    return any(isinstance(raw, dict) and isinstance(raw.get("type"), str) and UUID.match(raw["type"])
               for raw in data.get("nodes") or [])


def flatten_subgraphs(data: dict[str, Any], warnings: list[str]) -> Flattened:
    """The nodes, links and groups of UI workflow `data`, every subgraph instance replaced by its nodes."""
    return _Flattener(data, warnings).run()


class _Flattener:
    def __init__(self, data: dict[str, Any], warnings: list[str]) -> None:
        self.warnings = warnings
        self.definitions: dict[str, _Subgraph] = {}
        self._read_definitions(data.get("definitions"), "definitions")
        self.top = _Scope("", _nodes_by_id(list_field(data, "nodes", "workflow"), "workflow"),
                          _links_by_id(list_field(data, "links", "workflow"), "workflow"), MODE_NORMAL)
        self.groups = list(list_field(data, "groups", "workflow"))
        self.pushed: PushedValues = {}
        self.instances: dict[str, str] = {}
        self.undefined: set[str] = set()

    def run(self) -> Flattened:
        self._expand(self.top, [])
        self.groups = [_shifted_group(self.top, raw) for raw in self.groups]
        self._place(self.top)
        for type_name in sorted(self.undefined):
            self.warnings.append(f"node type {type_name} looks like a subgraph id, but the workflow defines "
                                 f"no such subgraph (definitions.subgraphs); its nodes are kept as unknown "
                                 f"types")
        nodes: list[dict[str, Any]] = []
        links: list[dict[str, Any]] = []
        self._emit(self.top, nodes, links)
        return Flattened(nodes, links, self.groups, self.pushed, self.instances)

    # -- definitions --

    def _read_definitions(self, definitions: Any, where: str) -> None:
        if definitions is None:
            return
        if not isinstance(definitions, dict):
            raise WorkflowError(f"{where} must be an object, got {definitions!r}")
        raw_list = definitions.get("subgraphs") or []
        if not isinstance(raw_list, list):
            raise WorkflowError(f"{where}.subgraphs must be a list, got {raw_list!r}")
        for index, raw in enumerate(raw_list):
            subgraph = _subgraph(raw, f"{where}.subgraphs[{index}]")
            self.definitions.setdefault(subgraph.id, subgraph)
            self._read_definitions(raw.get("definitions"), f"{subgraph.label()}: definitions")

    # -- expansion into scopes --

    def _expand(self, scope: _Scope, chain: list[_Subgraph]) -> None:
        """Make a child scope for every instance in `scope`, recursively."""
        for node_id, raw in scope.nodes.items():
            type_name = raw["type"]
            subgraph = self.definitions.get(type_name)
            if subgraph is None:
                if UUID.match(type_name):
                    self.undefined.add(type_name)
                continue
            if any(outer.id == subgraph.id for outer in chain):
                path = " -> ".join(s.name for s in [*chain, subgraph])
                raise WorkflowError(f"{subgraph.label()} contains itself ({path}); a subgraph cannot be "
                                    f"nested in itself")
            if len(chain) >= MAX_DEPTH:
                raise WorkflowError(f"{subgraph.label()} at node {scope.prefix}{node_id} is nested more than "
                                    f"{MAX_DEPTH} subgraphs deep")
            child = self._child(scope, node_id, raw, subgraph)
            scope.children[node_id] = child
            self.instances[scope.prefix + node_id] = subgraph.name
            self._expand(child, [*chain, subgraph])
            x, _ = _position(raw.get("pos"))
            width = _size(raw.get("size"))[0]
            left, _, right, _ = _extent(child)
            if right - left > width:
                scope.shifts.append((x + width, right - left - width))

    def _place(self, scope: _Scope) -> None:
        """Set the offsets of the instances' levels below `scope`, and add their groups."""
        for node_id, child in scope.children.items():
            x, y = scope.place(scope.nodes[node_id].get("pos"))
            left, top, _, _ = _extent(child)
            child.offset = (x - left, y - top)
            self._add_groups(child, scope.nodes[node_id])
            self._place(child)

    def _child(self, parent: _Scope, node_id: str, instance: dict[str, Any], subgraph: _Subgraph) -> _Scope:
        where = f"node {parent.prefix}{node_id} ({subgraph.label()})"
        mode = _combined_mode(parent.mode, instance.get("mode", MODE_NORMAL))
        child = _Scope(f"{parent.prefix}{node_id}:", _nodes_by_id(subgraph.nodes, subgraph.label()),
                       subgraph.links, mode, subgraph, parent, node_id)
        for index, slot in enumerate(list_field(instance, "inputs", where)):
            if not isinstance(slot, dict) or slot.get("link") is None:
                continue
            name = slot.get("name")
            k = subgraph.inputs.index(name) if name in subgraph.inputs else index
            if k >= len(subgraph.inputs):
                self.warnings.append(f"{where}: input {name!r} is not an input of the subgraph; its link "
                                     f"was dropped")
                continue
            child.outer_links[k] = str(slot["link"])
        child.values = self._promoted_values(child, instance.get("widgets_values"), where)
        return child

    def _promoted_values(self, child: _Scope, values: Any, where: str) -> dict[int, tuple[Any, str | None]]:
        """The instance's widget value for each promoted subgraph input (one that reaches a widget inside)."""
        subgraph = child.subgraph
        assert subgraph is not None
        promoted = [k for k in range(len(subgraph.inputs)) if self._reaches_widget(child, k)]
        if isinstance(values, dict):
            return {k: (values[subgraph.inputs[k]], None) for k in promoted
                    if values.get(subgraph.inputs[k]) is not None}
        if not isinstance(values, list):
            if values is not None:
                self.warnings.append(f"{where}: widgets_values must be a list or an object, got {values!r}; "
                                     f"the inner nodes keep their own values")
            return {}
        with_controls = len(values) > len(promoted)
        found: dict[int, tuple[Any, str | None]] = {}
        cursor = 0
        for k in promoted:
            if cursor >= len(values):
                break
            value, cursor = values[cursor], cursor + 1
            control = None
            is_int = isinstance(value, int) and not isinstance(value, bool)
            if (with_controls and is_int and cursor < len(values) and isinstance(values[cursor], str)
                    and values[cursor] in SEED_CONTROLS):
                control, cursor = values[cursor], cursor + 1
            if value is not None:
                found[k] = (value, control)
        return found

    def _reaches_widget(self, child: _Scope, k: int) -> bool:
        for link in child.links.values():
            if str(link["origin_id"]) != SUBGRAPH_INPUT_ID or link["origin_slot"] != k:
                continue
            target = child.nodes.get(str(link["target_id"]))
            slot = _target_slot(target, link) if target is not None else None
            if slot is not None and isinstance(slot.get("widget"), dict):
                return True
        return False

    def _add_groups(self, child: _Scope, instance: dict[str, Any]) -> None:
        """The definition's groups moved with its nodes, and a group around them named after the subgraph."""
        subgraph = child.subgraph
        assert subgraph is not None
        for raw in subgraph.groups:
            if _bounding(raw) is not None:
                self.groups.append(_shifted_group(child, raw, placed=True))
            else:
                self.warnings.append(f"{subgraph.label()}: a group without a valid 'bounding' was dropped")
        left, top, right, bottom = _extent(child)
        x, y = child.offset
        title = instance.get("title")
        self.groups.append({"title": title if isinstance(title, str) and title else subgraph.name,
                            "bounding": [x + left - GROUP_PADDING, y + top - GROUP_TITLE,
                                         right - left + 2 * GROUP_PADDING,
                                         bottom - top + GROUP_TITLE + GROUP_PADDING]})

    # -- resolution of links through instances --

    def _resolve(self, scope: _Scope, link: dict[str, Any], seen: set[tuple[str, str]]
                 ) -> tuple[str, Any, Any, Any] | None:
        """What feeds `link`'s target: ("link", source id, output, type), ("value", value, control, None), or
        None (nothing: the input is left unconnected)."""
        key = (scope.prefix, str(link["id"]))
        if key in seen:
            self.warnings.append(f"link {scope.prefix}{link['id']} runs in a loop through subgraph inputs "
                                 f"and outputs; it was dropped")
            return None
        seen.add(key)
        origin = str(link["origin_id"])
        if origin == SUBGRAPH_INPUT_ID:
            return self._through_input(scope, link, seen)
        child = scope.children.get(origin)
        if child is not None:
            return self._through_output(child, link, seen)
        return "link", scope.prefix + origin, link["origin_slot"], link.get("type")

    def _through_input(self, scope: _Scope, link: dict[str, Any], seen: set[tuple[str, str]]
                       ) -> tuple[str, Any, Any, Any] | None:
        subgraph, k = scope.subgraph, link["origin_slot"]
        if subgraph is None or scope.parent is None:
            self.warnings.append(f"link {link['id']} comes from a subgraph input node outside any subgraph; "
                                 f"it was dropped")
            return None
        if k >= len(subgraph.inputs):
            self.warnings.append(f"{subgraph.label()}: link {link['id']} comes from input slot {k}, but the "
                                 f"subgraph has {len(subgraph.inputs)} input(s); it was dropped")
            return None
        outer_id = scope.outer_links.get(k)
        if outer_id is not None:
            outer = scope.parent.links.get(outer_id)
            if outer is None:
                self.warnings.append(f"node {scope.parent.prefix}{scope.instance_id}: input "
                                     f"{subgraph.inputs[k]!r} names link {outer_id}, which the workflow "
                                     f"lacks; it was dropped")
            else:
                resolved = self._resolve(scope.parent, outer, seen)
                if resolved is not None:
                    return resolved
        if k in scope.values:
            value, control = scope.values[k]
            return "value", value, control, None
        return None

    def _through_output(self, child: _Scope, link: dict[str, Any], seen: set[tuple[str, str]]
                        ) -> tuple[str, Any, Any, Any] | None:
        subgraph, j = child.subgraph, link["origin_slot"]
        assert subgraph is not None
        inner = next((candidate for candidate in subgraph.links.values()
                      if str(candidate["target_id"]) == SUBGRAPH_OUTPUT_ID and candidate["target_slot"] == j),
                     None)
        if inner is None:
            what = f"output {j} ({subgraph.outputs[j]!r})" if j < len(subgraph.outputs) else f"output {j}"
            self.warnings.append(f"{subgraph.label()}: {what} is fed by nothing inside; link {link['id']} "
                                 f"from node {child.prefix[:-1]} was dropped")
            return None
        return self._resolve(child, inner, seen)

    # -- output --

    def _emit(self, scope: _Scope, nodes: list[dict[str, Any]], links: list[dict[str, Any]]) -> None:
        """Append the real nodes of `scope` (and of its instances, recursively) and the links into them."""
        cleared: set[tuple[str, str]] = set()  # (node id, link id) of inputs left without a link
        for link in scope.links.values():
            target = str(link["target_id"])
            if target == SUBGRAPH_OUTPUT_ID or target in scope.children:
                continue  # resolved from the other end
            if target not in scope.nodes:
                links.append({**link, "id": scope.prefix + str(link["id"]),
                              "origin_id": scope.prefix + str(link["origin_id"]),
                              "target_id": scope.prefix + target})  # dangling: the importer warns
                continue
            resolved = self._resolve(scope, link, set())
            if resolved is not None and resolved[0] == "link":
                _, source, output, link_type = resolved
                links.append({**link, "id": scope.prefix + str(link["id"]), "origin_id": source,
                              "origin_slot": output, "target_id": scope.prefix + target,
                              "type": link_type if link_type is not None else link.get("type")})
                continue
            cleared.add((target, str(link["id"])))
            slot = _target_slot(scope.nodes[target], link)
            if resolved is not None and slot is not None:
                _, value, control, _ = resolved
                name = str(slot.get("name", ""))
                self.pushed.setdefault(scope.prefix + target, {})[name] = (value, control)
        for node_id, raw in scope.nodes.items():
            child = scope.children.get(node_id)
            if child is not None:
                self._emit(child, nodes, links)
                continue
            nodes.append(self._flat_node(scope, node_id, raw, cleared))

    def _flat_node(self, scope: _Scope, node_id: str, raw: dict[str, Any],
                   cleared: set[tuple[str, str]]) -> dict[str, Any]:
        node = copy.deepcopy(raw)
        node["id"] = scope.prefix + node_id
        if scope.prefix or scope.shifts:
            node["pos"] = list(scope.place(raw.get("pos")))
        if scope.prefix:
            node["mode"] = _combined_mode(scope.mode, raw.get("mode", MODE_NORMAL))
        for slot in node.get("inputs") or []:
            if isinstance(slot, dict) and slot.get("link") is not None:
                link_id = str(slot["link"])
                slot["link"] = None if (node_id, link_id) in cleared else scope.prefix + link_id
        return node


# -- parsing helpers --

def _subgraph(raw: Any, where: str) -> _Subgraph:
    if not isinstance(raw, dict):
        raise WorkflowError(f"{where} must be an object, got {raw!r}")
    subgraph_id = raw.get("id")
    if not isinstance(subgraph_id, str) or not subgraph_id:
        raise WorkflowError(f"{where}: field 'id' must be a non-empty string, got {subgraph_id!r}")
    name = raw.get("name")
    label = f"subgraph {name if isinstance(name, str) and name else subgraph_id!r} ({subgraph_id})"
    slots = {}
    for key in ("inputs", "outputs"):
        slots[key] = []
        for index, slot in enumerate(list_field(raw, key, label)):
            if not isinstance(slot, dict) or not isinstance(slot.get("name"), str):
                raise WorkflowError(f"{label}: {key}[{index}] must be an object with a 'name', got {slot!r}")
            slots[key].append(slot["name"])
    return _Subgraph(subgraph_id, name if isinstance(name, str) and name else subgraph_id,
                     list_field(raw, "nodes", label), _links_by_id(list_field(raw, "links", label), label),
                     slots["inputs"], slots["outputs"], list_field(raw, "groups", label))


def list_field(data: dict[str, Any], key: str, where: str) -> list[Any]:
    """data[key] as a list ([] when absent); anything else is a WorkflowError naming `where`."""
    value = data.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise WorkflowError(f"{where}: field {key!r} must be a list, got {value!r}")
    return value


def _nodes_by_id(raw_nodes: list[Any], where: str) -> dict[str, dict[str, Any]]:
    """Nodes by id; the importer checks every other field, this only needs ids and types."""
    nodes: dict[str, dict[str, Any]] = {}
    for index, raw in enumerate(raw_nodes):
        if not isinstance(raw, dict):
            raise WorkflowError(f"{where}: nodes[{index}] must be an object, got {raw!r}")
        node_id, type_name = raw.get("id"), raw.get("type")
        if isinstance(node_id, bool) or not isinstance(node_id, (int, str)) or node_id == "":
            raise WorkflowError(f"{where}: nodes[{index}]: field 'id' must be an integer or a non-empty "
                                f"string, got {node_id!r}")
        if not isinstance(type_name, str) or not type_name:
            raise WorkflowError(f"{where}: node {node_id}: field 'type' must be a non-empty string, got "
                                f"{type_name!r}")
        if str(node_id) in nodes:
            raise WorkflowError(f"{where}: duplicate node id {node_id} (nodes[{index}])")
        nodes[str(node_id)] = raw
    return nodes


def _links_by_id(raw_links: list[Any], where: str) -> dict[str, dict[str, Any]]:
    """Links as objects with LINK_FIELDS, from [id, origin, slot, target, slot, type] arrays or objects."""
    links: dict[str, dict[str, Any]] = {}
    for index, raw in enumerate(raw_links):
        if isinstance(raw, list) and len(raw) >= 6:
            link = dict(zip(LINK_FIELDS, raw[:6], strict=True))
        elif isinstance(raw, dict) and all(key in raw for key in LINK_FIELDS[:5]):
            link = {key: raw.get(key) for key in LINK_FIELDS}
        else:
            raise WorkflowError(f"{where}: links[{index}] must be [id, origin_id, origin_slot, target_id, "
                                f"target_slot, type] or an object with those keys, got {raw!r}")
        for key in ("origin_slot", "target_slot"):
            if isinstance(link[key], bool) or not isinstance(link[key], int) or link[key] < 0:
                raise WorkflowError(f"{where}: link {link['id']}: {key} must be an integer 0 or more, got "
                                    f"{link[key]!r}")
        links[str(link["id"])] = link
    return links


def _target_slot(node: dict[str, Any], link: dict[str, Any]) -> dict[str, Any] | None:
    """The entry of `node`'s inputs that `link` feeds: the one naming the link, else the one at its slot."""
    inputs = [slot for slot in node.get("inputs") or [] if isinstance(slot, dict)]
    named = [slot for slot in inputs if slot.get("link") is not None and str(slot["link"]) == str(link["id"])]
    if named:
        return named[0]
    index = link["target_slot"]
    return inputs[index] if index < len(inputs) else None


def _extent(scope: _Scope) -> tuple[float, float, float, float]:
    """The box (left, top, right, bottom) around a level's nodes in its own shifted coordinates."""
    boxes = []
    for raw in scope.nodes.values():
        x, y = _position(raw.get("pos"))
        width, height = _size(raw.get("size"))
        boxes.append((scope.shifted(x), y, scope.shifted(x) + width, y + height))
    if not boxes:
        return 0.0, 0.0, 0.0, 0.0
    return (min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes),
            max(b[3] for b in boxes))


def _bounding(raw: Any) -> list[float] | None:
    bounding = raw.get("bounding") if isinstance(raw, dict) else None
    if isinstance(bounding, list) and len(bounding) == 4 and all(_is_number(v) for v in bounding):
        return [float(v) for v in bounding]
    return None


def _shifted_group(scope: _Scope, raw: Any, placed: bool = False) -> Any:
    """A group of `scope` moved with its nodes (and `placed` at the level's offset); a group across a grown
    instance widens with it. A malformed group is returned as it is, for the importer to report."""
    bounding = _bounding(raw)
    if bounding is None:
        return raw
    x, y, width, height = bounding
    x, right = scope.shifted(x), scope.shifted(x + width)
    if placed:
        x, y, right = x + scope.offset[0], y + scope.offset[1], right + scope.offset[0]
    return {**raw, "bounding": [x, y, right - x, height]}


def _combined_mode(outer: int, inner: Any) -> Any:
    """Never (muted) wins over bypass, which wins over any other mode."""
    if MODE_NEVER in (outer, inner):
        return MODE_NEVER
    if MODE_BYPASS in (outer, inner):
        return MODE_BYPASS
    return inner


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _position(value: Any) -> tuple[float, float]:
    """[x, y] or {"0": x, "1": y}; (0, 0) when malformed (the importer reports that on the node)."""
    if isinstance(value, dict):
        value = [value.get("0"), value.get("1")]
    if isinstance(value, list) and len(value) >= 2 and _is_number(value[0]) and _is_number(value[1]):
        return float(value[0]), float(value[1])
    return 0.0, 0.0


def _size(value: Any) -> tuple[float, float]:
    if isinstance(value, dict):
        value = [value.get("0"), value.get("1")]
    if isinstance(value, list) and len(value) >= 2 and _is_number(value[0]) and _is_number(value[1]):
        return float(value[0]), float(value[1])
    return DEFAULT_NODE_SIZE
