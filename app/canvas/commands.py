"""Every edit of the document as a delta QUndoCommand: each stores only what it changes (the nodes, links
and groups it adds or removes with their positions in the document, or one field's old and new value) and
applies it through the scene's model methods, which change the document and its items together."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from PySide6.QtGui import QUndoCommand

from engine.graph.document import Group, Link, NodeDoc

if TYPE_CHECKING:
    from app.canvas.scene import WorkflowScene

MISSING = object()  # a mapping entry that did not exist (undo deletes it again)


class AddItemsCommand(QUndoCommand):
    """Add nodes, links and groups (at the end of the document's lists)."""

    def __init__(self, scene: WorkflowScene, nodes: list[NodeDoc], links: list[Link] = (),
                 groups: list[Group] = (), text: str = "Add nodes") -> None:
        super().__init__(text)
        self.scene = scene
        self.nodes = [copy.deepcopy(n) for n in nodes]
        self.links = [copy.deepcopy(link) for link in links]
        self.groups = [copy.deepcopy(g) for g in groups]

    def redo(self) -> None:
        for node in self.nodes:
            self.scene.insert_node(copy.deepcopy(node))
        for link in self.links:
            self.scene.insert_link(copy.deepcopy(link))
        for group in self.groups:
            self.scene.insert_group(copy.deepcopy(group))

    def undo(self) -> None:
        for group in reversed(self.groups):
            self.scene.take_group(group.id)
        for link in reversed(self.links):
            self.scene.take_link(link.id)
        for node in reversed(self.nodes):
            self.scene.take_node(node.id)


class RemoveItemsCommand(QUndoCommand):
    """Remove nodes (with every link touching them), links and groups; undo puts each back in its place."""

    def __init__(self, scene: WorkflowScene, node_ids: list[str] = (), link_ids: list[str] = (),
                 group_ids: list[str] = (), text: str = "Delete") -> None:
        super().__init__(text)
        self.scene = scene
        workflow = scene.workflow
        node_set = set(node_ids)
        order = list(workflow.nodes)
        self.nodes = sorted((order.index(i), copy.deepcopy(workflow.nodes[i])) for i in node_set)
        self.links = [(index, copy.deepcopy(link)) for index, link in enumerate(workflow.links)
                      if link.id in set(link_ids) or link.source in node_set or link.target in node_set]
        self.groups = [(index, copy.deepcopy(g)) for index, g in enumerate(workflow.groups)
                       if g.id in set(group_ids)]

    def redo(self) -> None:
        for _, link in reversed(self.links):
            self.scene.take_link(link.id)
        for _, node in reversed(self.nodes):
            self.scene.take_node(node.id)
        for _, group in reversed(self.groups):
            self.scene.take_group(group.id)

    def undo(self) -> None:
        for index, node in self.nodes:
            self.scene.insert_node(copy.deepcopy(node), index)
        for index, link in self.links:
            self.scene.insert_link(copy.deepcopy(link), index)
        for index, group in self.groups:
            self.scene.insert_group(copy.deepcopy(group), index)


class ConnectCommand(QUndoCommand):
    """Add a link, replacing the link that fed the same input (undo restores it in its place)."""

    def __init__(self, scene: WorkflowScene, link: Link) -> None:
        super().__init__(f"Connect {link.type}")
        self.scene = scene
        self.link = copy.deepcopy(link)
        self.replaced = [(index, copy.deepcopy(old)) for index, old in enumerate(scene.workflow.links)
                         if old.target == link.target and old.input == link.input]

    def redo(self) -> None:
        for _, old in reversed(self.replaced):
            self.scene.take_link(old.id)
        self.scene.insert_link(copy.deepcopy(self.link))

    def undo(self) -> None:
        self.scene.take_link(self.link.id)
        for index, old in self.replaced:
            self.scene.insert_link(copy.deepcopy(old), index)


class MoveCommand(QUndoCommand):
    """Nodes and groups moved (group resizes too): old and new positions / rects."""

    def __init__(self, scene: WorkflowScene, node_moves: dict[str, tuple[tuple, tuple]],
                 group_moves: dict[str, tuple[tuple, tuple]], text: str = "Move") -> None:
        super().__init__(text)
        self.scene = scene
        self.node_moves = node_moves
        self.group_moves = group_moves

    def redo(self) -> None:
        self._apply(1)

    def undo(self) -> None:
        self._apply(0)

    def _apply(self, which: int) -> None:
        for node_id, positions in self.node_moves.items():
            self.scene.set_node_field(node_id, "pos", positions[which])
        for group_id, rects in self.group_moves.items():
            self.scene.set_group_field(group_id, "rect", rects[which])


class SetNodeFieldCommand(QUndoCommand):
    """One field of a node (title, mode, collapsed, color, size)."""

    def __init__(self, scene: WorkflowScene, node_id: str, field: str, value: Any, text: str = "") -> None:
        super().__init__(text or f"Set {field}")
        self.scene = scene
        self.node_id = node_id
        self.field = field
        self.old = copy.deepcopy(getattr(scene.workflow.nodes[node_id], field))
        self.new = copy.deepcopy(value)

    def redo(self) -> None:
        self.scene.set_node_field(self.node_id, self.field, copy.deepcopy(self.new))

    def undo(self) -> None:
        self.scene.set_node_field(self.node_id, self.field, copy.deepcopy(self.old))


class SetEntryCommand(QUndoCommand):
    """One entry of a node's mapping: a widget value ("widgets") or a seed control ("seed_controls")."""

    def __init__(self, scene: WorkflowScene, node_id: str, mapping: str, key: str, value: Any) -> None:
        super().__init__(f"Set {key}")
        self.scene = scene
        self.node_id = node_id
        self.mapping = mapping
        self.key = key
        old = getattr(scene.workflow.nodes[node_id], mapping).get(key, MISSING)
        self.old = old if old is MISSING else copy.deepcopy(old)
        self.new = copy.deepcopy(value)

    def redo(self) -> None:
        self.scene.set_node_entry(self.node_id, self.mapping, self.key, copy.deepcopy(self.new))

    def undo(self) -> None:
        self.scene.set_node_entry(self.node_id, self.mapping, self.key,
                                  MISSING if self.old is MISSING else copy.deepcopy(self.old))


class SetGroupFieldCommand(QUndoCommand):
    """One field of a group (title, rect, color)."""

    def __init__(self, scene: WorkflowScene, group_id: str, field: str, value: Any, text: str = "") -> None:
        super().__init__(text or f"Set group {field}")
        self.scene = scene
        self.group_id = group_id
        self.field = field
        group = scene.group_by_id(group_id)
        self.old = copy.deepcopy(getattr(group, field))
        self.new = copy.deepcopy(value)

    def redo(self) -> None:
        self.scene.set_group_field(self.group_id, self.field, copy.deepcopy(self.new))

    def undo(self) -> None:
        self.scene.set_group_field(self.group_id, self.field, copy.deepcopy(self.old))


class SetNotesCommand(QUndoCommand):
    """The document's notes (`meta["notes"]`, the Note nodes of ComfyUI files) replaced as a whole: added,
    moved, edited or deleted notes."""

    def __init__(self, scene: WorkflowScene, notes: list[dict[str, Any]], text: str) -> None:
        super().__init__(text)
        self.scene = scene
        self.old = copy.deepcopy(scene.notes())
        self.new = copy.deepcopy(notes)

    def redo(self) -> None:
        self.scene.set_notes(copy.deepcopy(self.new))

    def undo(self) -> None:
        self.scene.set_notes(copy.deepcopy(self.old))
