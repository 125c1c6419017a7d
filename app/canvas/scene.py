"""The canvas scene: a view of one Workflow document. The document is the model; every edit goes through a
QUndoCommand (canvas/commands.py) that calls the model methods here, which change the document and the
matching items together. Run state (progress, previews, errors) lives only on the items. Notes (the Note nodes
of ComfyUI files) live in `workflow.meta["notes"]` and are drawn by NoteItems."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from PySide6.QtCore import QPointF, QRectF, Signal
from PySide6.QtGui import QImage, QPainter, QPen, QUndoCommand, QUndoStack
from PySide6.QtWidgets import QGraphicsScene, QGraphicsSceneMouseEvent

from app import theme
from app.canvas.commands import (
    MISSING,
    AddItemsCommand,
    ConnectCommand,
    MoveCommand,
    RemoveItemsCommand,
    SetEntryCommand,
    SetGroupFieldCommand,
    SetNodeFieldCommand,
    SetNotesCommand,
)
from app.canvas.group_item import GroupItem
from app.canvas.node_item import NodeItem
from app.canvas.note_item import NoteItem, note_id, note_pos
from app.canvas.port_item import PortItem
from app.canvas.wire_item import WireItem
from engine.graph.document import Group, Link, NodeDoc, Workflow, id_sort_key
from engine.graph.errors import WorkflowError
from engine.graph.spec import ANY, DEFAULT_SEED_CONTROL, SEED, NodeType

Lookup = Callable[[str], type[NodeType] | None]
GRID = 24


def types_compatible(output_type: str, input_type: str) -> bool:
    return ANY in (output_type, input_type) or output_type == input_type


class WorkflowScene(QGraphicsScene):
    document_changed = Signal()
    status_message = Signal(str)
    editor_requested = Signal(str, str, QRectF)  # node id, input name, the widget row in scene coordinates
    title_edit_requested = Signal(str)  # node id
    group_title_edit_requested = Signal(str)  # group id
    note_edit_requested = Signal(str)  # note id
    search_requested = Signal(QPointF)  # scene position; `pending_port` says what to connect afterwards

    def __init__(self, lookup: Lookup, parent: Any = None) -> None:
        super().__init__(parent)
        self.lookup = lookup
        self.workflow = Workflow()
        self.undo_stack = QUndoStack(self)
        self.node_items: dict[str, NodeItem] = {}
        self.wire_items: dict[str, WireItem] = {}
        self.group_items: dict[str, GroupItem] = {}
        self.note_items: dict[str, NoteItem] = {}
        self.pending_port: PortItem | None = None  # a dragged wire dropped on empty canvas
        self.setSceneRect(-50000, -50000, 100000, 100000)

    # -- whole document --

    def load_workflow(self, workflow: Workflow) -> None:
        """Show `workflow` (the caller clears the undo stack)."""
        for item in [*self.wire_items.values(), *self.node_items.values(), *self.group_items.values(),
                     *self.note_items.values()]:
            self.removeItem(item)
        self.node_items, self.wire_items, self.group_items, self.note_items = {}, {}, {}, {}
        self.workflow = workflow
        for group in workflow.groups:
            self._add_group_item(group)
        for node in workflow.nodes.values():
            self._add_node_item(node)
        for link in workflow.links:
            self._add_wire_item(link)
        self._add_note_items()
        self.document_changed.emit()

    # -- model methods (called by commands only) --

    def insert_node(self, node: NodeDoc, index: int | None = None) -> None:
        items = list(self.workflow.nodes.items())
        items.insert(len(items) if index is None else index, (node.id, node))
        self.workflow.nodes = dict(items)
        self._add_node_item(node)
        self.document_changed.emit()

    def take_node(self, node_id: str) -> NodeDoc:
        node = self.workflow.nodes.pop(node_id)
        item = self.node_items.pop(node_id)
        self.removeItem(item)
        self.document_changed.emit()
        return node

    def insert_link(self, link: Link, index: int | None = None) -> None:
        self.workflow.links.insert(len(self.workflow.links) if index is None else index, link)
        self._refresh_unknown_ports(link)
        self._add_wire_item(link)
        self.document_changed.emit()

    def take_link(self, link_id: str) -> Link:
        index = next(i for i, link in enumerate(self.workflow.links) if link.id == link_id)
        link = self.workflow.links.pop(index)
        self.removeItem(self.wire_items.pop(link_id))
        self._refresh_unknown_ports(link)
        self._update_port_flags(link)
        self.document_changed.emit()
        return link

    def insert_group(self, group: Group, index: int | None = None) -> None:
        self.workflow.groups.insert(len(self.workflow.groups) if index is None else index, group)
        self._add_group_item(group)
        self.document_changed.emit()

    def take_group(self, group_id: str) -> Group:
        group = self.group_by_id(group_id)
        self.workflow.groups.remove(group)
        self.removeItem(self.group_items.pop(group_id))
        self.document_changed.emit()
        return group

    def set_node_field(self, node_id: str, field: str, value: Any) -> None:
        node = self.workflow.nodes[node_id]
        setattr(node, field, tuple(value) if field in ("pos", "size") and value is not None else value)
        item = self.node_items[node_id]
        if field == "pos":
            item.setPos(QPointF(*node.pos))
        item.relayout()
        self.update_wires_of(node_id)
        self.document_changed.emit()

    def set_node_entry(self, node_id: str, mapping: str, key: str, value: Any) -> None:
        entries = getattr(self.workflow.nodes[node_id], mapping)
        if value is MISSING:
            entries.pop(key, None)
        else:
            entries[key] = value
        self.node_items[node_id].update()
        self.document_changed.emit()

    def set_group_field(self, group_id: str, field: str, value: Any) -> None:
        group = self.group_by_id(group_id)
        setattr(group, field, tuple(value) if field == "rect" else value)
        self.group_items[group_id].sync()
        self.document_changed.emit()

    def set_notes(self, notes: list[dict[str, Any]]) -> None:
        if notes:
            self.workflow.meta["notes"] = notes
        else:
            self.workflow.meta.pop("notes", None)
        for item in self.note_items.values():
            self.removeItem(item)
        self.note_items = {}
        self._add_note_items()
        self.document_changed.emit()

    def notes(self) -> list[dict[str, Any]]:
        """The document's notes: dicts with id, type ("Note" or "MarkdownNote"), title, text, pos, size."""
        notes = self.workflow.meta.get("notes", [])
        return [note for note in notes if isinstance(note, dict)] if isinstance(notes, list) else []

    # -- items --

    def _add_node_item(self, node: NodeDoc) -> None:
        item = NodeItem(self, node, self.lookup(node.type))
        self.node_items[node.id] = item
        self.addItem(item)

    def _add_wire_item(self, link: Link) -> None:
        wire = WireItem(link, theme.type_color(link.type))
        self.wire_items[link.id] = wire
        self.addItem(wire)
        self._update_port_flags(link)
        self._update_wire(wire)

    def _add_group_item(self, group: Group) -> None:
        item = GroupItem(self, group)
        self.group_items[group.id] = item
        self.addItem(item)

    def _add_note_items(self) -> None:
        for note in self.notes():
            item = NoteItem(self, note)
            self.note_items[item.note_id] = item
            self.addItem(item)

    def _refresh_unknown_ports(self, link: Link) -> None:
        """A node of an unknown type draws ports for its links, so they change with them."""
        for node_id in (link.source, link.target):
            item = self.node_items.get(node_id)
            if item is not None and item.node_type is None:
                item.rebuild()
                self.update_wires_of(node_id)

    def _update_port_flags(self, link: Link) -> None:
        target = self.node_items.get(link.target)
        if target is not None and link.input in target.inputs:
            port = target.inputs[link.input]
            port.connected = any(k.target == link.target and k.input == link.input
                                 for k in self.workflow.links)
            port.update()
            target.relayout()  # a linked widget row shrinks to one line
            self.update_wires_of(link.target)
        source = self.node_items.get(link.source)
        if source is not None and 0 <= link.output < len(source.outputs):
            port = source.outputs[link.output]
            port.connected = any(k.source == link.source and k.output == link.output
                                 for k in self.workflow.links)
            port.update()

    def port_of(self, node_id: str, is_output: bool, key: str | int) -> PortItem | None:
        item = self.node_items.get(node_id)
        if item is None:
            return None
        if is_output:
            return item.outputs[key] if isinstance(key, int) and 0 <= key < len(item.outputs) else None
        return item.inputs.get(str(key))

    def _update_wire(self, wire: WireItem) -> None:
        start = self.port_of(wire.link.source, True, wire.link.output)
        end = self.port_of(wire.link.target, False, wire.link.input)
        if start is not None and end is not None:
            wire.update_path(start.center(), end.center())

    def update_wires_of(self, node_id: str) -> None:
        for link in self.workflow.links:
            if node_id in (link.source, link.target) and link.id in self.wire_items:
                self._update_wire(self.wire_items[link.id])

    def group_by_id(self, group_id: str) -> Group:
        for group in self.workflow.groups:
            if group.id == group_id:
                return group
        raise WorkflowError(f"no group with id {group_id!r}")

    def nodes_inside(self, rect: tuple[float, float, float, float]) -> list[NodeItem]:
        frame = QRectF(*rect)
        return [item for item in self.node_items.values()
                if frame.contains(item.sceneBoundingRect().center())]

    def selected_node_ids(self) -> list[str]:
        ids = [item.node_id for item in self.selectedItems() if isinstance(item, NodeItem)]
        return sorted(ids, key=id_sort_key)

    # -- edits (each pushes commands) --

    def push(self, command: QUndoCommand) -> None:
        self.undo_stack.push(command)

    def add_node(self, type_name: str, pos: QPointF | tuple[float, float]) -> str:
        node_type = self.lookup(type_name)
        if node_type is None:
            raise WorkflowError(f"unknown node type {type_name!r}")
        x, y = (pos.x(), pos.y()) if isinstance(pos, QPointF) else pos
        defaults = node_type.default_widget_values()
        widgets = {name: value for name, value in defaults.items() if value is not None}
        controls = {spec.name: DEFAULT_SEED_CONTROL
                    for spec in node_type.widget_inputs() if spec.kind == SEED}  # as ComfyUI's new seeds
        node = NodeDoc(self.workflow.new_node_id(), type_name, pos=(round(x), round(y)), widgets=widgets,
                       seed_controls=controls)
        self.push(AddItemsCommand(self, [node], text=f"Add {node_type.display_name}"))
        return node.id

    def add_node_connected(self, type_name: str, pos: QPointF, port: PortItem) -> str:
        """Add a node and link its first port that fits `port` (a wire dropped on empty canvas)."""
        self.undo_stack.beginMacro(f"Add {type_name}")
        node_id = self.add_node(type_name, pos)
        new_item = self.node_items[node_id]
        if port.is_output:
            candidates = [p for p in new_item.inputs.values()
                          if types_compatible(port.type_name, p.type_name)]
            candidates.sort(key=lambda p: p.is_widget)
            if candidates:
                self.connect_ports(port, candidates[0])
        else:
            candidates = [p for p in new_item.outputs if types_compatible(p.type_name, port.type_name)]
            if candidates:
                self.connect_ports(candidates[0], port)
        self.undo_stack.endMacro()
        return node_id

    def connect_ports(self, first: PortItem, second: PortItem) -> bool:
        """Link an output to an input (either order); refused with a status message when types differ."""
        if first.is_output == second.is_output:
            self.status_message.emit("connect an output to an input")
            return False
        out_port, in_port = (first, second) if first.is_output else (second, first)
        if out_port.node_id == in_port.node_id:
            self.status_message.emit("a node cannot feed itself")
            return False
        if not types_compatible(out_port.type_name, in_port.type_name):
            self.status_message.emit(f"cannot connect {out_port.type_name} output '{out_port.label}' to "
                                     f"{in_port.type_name} input '{in_port.label}': the types differ")
            return False
        link = Link(self.workflow.new_link_id(), out_port.node_id, int(out_port.key), in_port.node_id,
                    str(in_port.key), out_port.type_name if out_port.type_name != ANY else in_port.type_name)
        self.push(ConnectCommand(self, link))
        return True

    def disconnect_input(self, node_id: str, input_name: str) -> None:
        link = self.workflow.links_into(node_id).get(input_name)
        if link is not None:
            self.push(RemoveItemsCommand(self, link_ids=[link.id], text="Disconnect"))

    def delete_selection(self) -> None:
        nodes = self.selected_node_ids()
        links = [i.link_id for i in self.selectedItems() if isinstance(i, WireItem)]
        groups = [i.group_id for i in self.selectedItems() if isinstance(i, GroupItem)]
        notes = {i.note_id for i in self.selectedItems() if isinstance(i, NoteItem)}
        if not (nodes or links or groups or notes):
            return
        self.undo_stack.beginMacro("Delete")
        if nodes or links or groups:
            self.push(RemoveItemsCommand(self, nodes, links, groups))
        if notes:
            kept = [note for note in self.notes() if note_id(note) not in notes]
            self.push(SetNotesCommand(self, kept, "Delete notes"))
        self.undo_stack.endMacro()

    def add_note(self, pos: QPointF | tuple[float, float], text: str = "") -> str:
        """A new empty Note at `pos`; returns its id."""
        x, y = (pos.x(), pos.y()) if isinstance(pos, QPointF) else pos
        taken = {note_id(n) for n in self.notes()} | set(self.workflow.nodes)
        number = 1
        while f"note{number}" in taken:
            number += 1
        note = {"id": f"note{number}", "type": "Note", "title": "", "text": text,
                "pos": [float(round(x)), float(round(y))]}
        self.push(SetNotesCommand(self, [*self.notes(), note], "Add note"))
        return note["id"]

    def set_note_text(self, wanted: str, text: str) -> None:
        notes = self.notes()
        if any(note_id(n) == wanted and n.get("text") != text for n in notes):
            edited = [{**note, "text": text} if note_id(note) == wanted else note for note in notes]
            self.push(SetNotesCommand(self, edited, "Edit note"))

    def set_widget(self, node_id: str, name: str, value: Any) -> None:
        if self.workflow.nodes[node_id].widgets.get(name, MISSING) != value:
            self.push(SetEntryCommand(self, node_id, "widgets", name, value))

    def set_seed_control(self, node_id: str, name: str, control: str) -> None:
        self.push(SetEntryCommand(self, node_id, "seed_controls", name, control))

    def set_title(self, node_id: str, title: str) -> None:
        if self.workflow.nodes[node_id].title != title:
            self.push(SetNodeFieldCommand(self, node_id, "title", title, "Rename node"))

    def _set_field_on(self, node_ids: Iterable[str], field: str, value: Any, text: str) -> None:
        node_ids = [n for n in node_ids if getattr(self.workflow.nodes[n], field) != value]
        if not node_ids:
            return
        self.undo_stack.beginMacro(text)
        for node_id in node_ids:
            self.push(SetNodeFieldCommand(self, node_id, field, value, text))
        self.undo_stack.endMacro()

    def set_collapsed(self, node_ids: Iterable[str], collapsed: bool) -> None:
        self._set_field_on(node_ids, "collapsed", collapsed, "Collapse" if collapsed else "Expand")

    def set_mode(self, node_ids: Iterable[str], mode: str) -> None:
        self._set_field_on(node_ids, "mode", mode, f"Set mode {mode}")

    def toggle_mode(self, mode: str) -> None:
        """Selected nodes to `mode` ("muted" or "bypassed"), or back to normal when all already are."""
        ids = self.selected_node_ids()
        if ids:
            target = "normal" if all(self.workflow.nodes[n].mode == mode for n in ids) else mode
            self._set_field_on(ids, "mode", target, f"Set mode {target}")

    def toggle_collapse_selection(self) -> None:
        ids = self.selected_node_ids()
        if ids:
            self.set_collapsed(ids, not all(self.workflow.nodes[n].collapsed for n in ids))

    def create_group(self, title: str = "Group") -> str:
        """A group framing the selected nodes (or an empty one near the origin)."""
        items = [self.node_items[n] for n in self.selected_node_ids()]
        if items:
            bounds = items[0].sceneBoundingRect()
            for item in items[1:]:
                bounds = bounds.united(item.sceneBoundingRect())
            bounds = bounds.adjusted(-20, -48, 20, 20)
        else:
            bounds = QRectF(0, 0, 400, 300)
        group = Group(self.workflow.new_group_id(), title,
                      (bounds.x(), bounds.y(), bounds.width(), bounds.height()))
        self.push(AddItemsCommand(self, [], [], [group], text="Add group"))
        return group.id

    def commit_group_rect(self, group_id: str, rect: tuple[float, float, float, float]) -> None:
        old = self.group_by_id(group_id).rect
        if tuple(rect) != tuple(old):
            self.push(MoveCommand(self, {}, {group_id: (tuple(old), tuple(rect))}, "Resize group"))

    def set_group_title(self, group_id: str, title: str) -> None:
        self.push(SetGroupFieldCommand(self, group_id, "title", title, "Rename group"))

    def commit_moves(self) -> None:
        """One undo step for every node, group and note whose item left its document position."""
        node_moves = {}
        for node_id, item in self.node_items.items():
            old = self.workflow.nodes[node_id].pos
            new = (round(item.pos().x(), 2), round(item.pos().y(), 2))
            if (abs(new[0] - old[0]) > 0.01) or (abs(new[1] - old[1]) > 0.01):
                node_moves[node_id] = (tuple(old), new)
        group_moves = {}
        note_moves: list[dict[str, Any]] = []
        for group_id, item in self.group_items.items():
            old = self.group_by_id(group_id).rect
            new = (round(item.pos().x(), 2), round(item.pos().y(), 2), old[2], old[3])
            if abs(new[0] - old[0]) > 0.01 or abs(new[1] - old[1]) > 0.01:
                group_moves[group_id] = (tuple(old), new)
        moved_notes = []
        for note in self.notes():
            item = self.note_items.get(note_id(note))
            new = [round(item.pos().x(), 2), round(item.pos().y(), 2)] if item is not None else None
            old = note_pos(note)
            if new is not None and (abs(new[0] - old[0]) > 0.01 or abs(new[1] - old[1]) > 0.01):
                note = {**note, "pos": new}
                moved_notes.append(note_id(note))
            note_moves.append(note)
        if not (node_moves or group_moves or moved_notes):
            return
        self.undo_stack.beginMacro("Move")
        if node_moves or group_moves:
            self.push(MoveCommand(self, node_moves, group_moves))
        if moved_notes:
            self.push(SetNotesCommand(self, note_moves, "Move notes"))
        self.undo_stack.endMacro()

    # -- requests the view or window answers --

    def request_editor(self, node_id: str, name: str, rect: QRectF) -> None:
        self.editor_requested.emit(node_id, name, rect)

    def request_title_edit(self, node_id: str) -> None:
        self.title_edit_requested.emit(node_id)

    def request_group_title_edit(self, group_id: str) -> None:
        self.group_title_edit_requested.emit(group_id)

    def request_note_edit(self, wanted: str) -> None:
        self.note_edit_requested.emit(wanted)

    # -- run state (not part of the document) --

    def clear_run_state(self) -> None:
        for item in self.node_items.values():
            item.set_run_state(False)

    def set_node_errors(self, errors: dict[str, list[str]]) -> None:
        for node_id, item in self.node_items.items():
            if item.errors != errors.get(node_id, []):
                item.set_errors(errors.get(node_id, []))
                self.update_wires_of(node_id)

    def set_node_running(self, node_id: str, running: bool, progress: tuple[int, int] | None = None) -> None:
        item = self.node_items.get(node_id)
        if item is not None:
            item.set_run_state(running, progress)

    def set_node_image(self, node_id: str, image: QImage) -> None:
        item = self.node_items.get(node_id)
        if item is not None:
            item.set_image(image)

    # -- events --

    def mouseReleaseEvent(self, event: QGraphicsSceneMouseEvent) -> None:
        super().mouseReleaseEvent(event)
        self.commit_moves()

    def drawBackground(self, painter: QPainter, rect: QRectF) -> None:
        painter.fillRect(rect, theme.BACKGROUND)
        scale = painter.transform().m11()
        if scale < 0.35:
            return
        left = int(rect.left()) - int(rect.left()) % GRID
        top = int(rect.top()) - int(rect.top()) % GRID
        for step, color in ((GRID, theme.GRID_MINOR), (GRID * 5, theme.GRID_MAJOR)):
            painter.setPen(QPen(color, 0))
            x = left - left % step
            while x < rect.right():
                painter.drawLine(QPointF(x, rect.top()), QPointF(x, rect.bottom()))
                x += step
            y = top - top % step
            while y < rect.bottom():
                painter.drawLine(QPointF(rect.left(), y), QPointF(rect.right(), y))
                y += step
