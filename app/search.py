"""Node search (Tab or double-click on the canvas): fuzzy matching over type name, display name, category
and description, recently used types first; optionally only the types that accept or provide a type."""

from __future__ import annotations

from collections.abc import Iterable

from PySide6.QtCore import QEvent, QObject, QPoint, Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QFrame, QLabel, QLineEdit, QListWidget, QListWidgetItem, QVBoxLayout, QWidget

from engine.graph.spec import ANY, NodeType

RECENT_LIMIT = 12


def fuzzy_score(query: str, text: str) -> float:
    """0 when `query`'s letters do not appear in order in `text`; higher for a substring, a prefix, word
    starts and letters close together."""
    query, text = query.lower(), text.lower()
    if not query:
        return 1.0
    position = text.find(query)
    if position >= 0:
        return 100.0 - min(position, 50) * 0.5 + (30.0 if position == 0 else 0.0)
    score, cursor, previous = 0.0, 0, -2
    for letter in query:
        found = text.find(letter, cursor)
        if found < 0:
            return 0.0
        score += 3.0 if found == previous + 1 else 1.0
        if found == 0 or not text[found - 1].isalnum():
            score += 2.0
        previous, cursor = found, found + 1
    return score


def type_fit(node_type: type[NodeType], wanted: str | None, needs_input: bool) -> int:
    """2 when the node type has an input (needs_input) or output of exactly type `wanted` (or no type is
    wanted), 1 when only through the wildcard type "*", 0 when it has none."""
    if wanted is None:
        return 2
    if needs_input:
        kinds = [i.link_type for i in node_type.inputs]
    else:
        kinds = [o.type for o in node_type.outputs]
    if wanted in kinds:
        return 2
    return 1 if any(ANY in (wanted, k) for k in kinds) else 0


def rank_node_types(node_types: Iterable[type[NodeType]], query: str, recent: list[str],
                    wanted: str | None = None, needs_input: bool = True) -> list[type[NodeType]]:
    """The matching node types, best first: exact type fits before wildcard ones, then recently used ones,
    then by fuzzy score."""
    scored = []
    for node_type in node_types:
        fit = type_fit(node_type, wanted, needs_input)
        if fit == 0:
            continue
        score = max(fuzzy_score(query, node_type.display_name) * 1.2, fuzzy_score(query, node_type.type_name),
                    fuzzy_score(query, node_type.category) * 0.6,
                    fuzzy_score(query, node_type.description) * 0.4)
        if score <= 0:
            continue
        recency = RECENT_LIMIT - recent.index(node_type.type_name) if node_type.type_name in recent else 0
        if not query:
            score = 0.0
        recency_weight = 1000 if not query else 5
        scored.append((-fit, -recency * recency_weight, -score, node_type.display_name.lower(), node_type))
    scored.sort(key=lambda entry: entry[:4])
    return [entry[4] for entry in scored]


class NodeSearch(QFrame):
    """A popup: a query field over a ranked list; Enter or a click emits `chosen(type_name)`."""

    chosen = Signal(str)

    def __init__(self, node_types: list[type[NodeType]], recent: list[str], parent: QWidget | None = None,
                 wanted: str | None = None, needs_input: bool = True) -> None:
        super().__init__(parent, Qt.WindowType.Popup)
        self.setObjectName("nodeSearch")
        self.node_types = node_types
        self.recent = recent
        self.wanted = wanted
        self.needs_input = needs_input
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        if wanted is not None:
            hint = f"nodes with an input of type {wanted}" if needs_input else f"nodes that output {wanted}"
            layout.addWidget(QLabel(hint))
        self.query = QLineEdit()
        self.query.setPlaceholderText("Search nodes...")
        self.query.textChanged.connect(self.refresh)
        self.query.installEventFilter(self)
        self.results = QListWidget()
        self.results.itemActivated.connect(self._activated)
        self.results.itemClicked.connect(self._activated)
        layout.addWidget(self.query)
        layout.addWidget(self.results)
        self.resize(380, 360)
        self.refresh()

    def open_at(self, global_pos: QPoint) -> None:
        self.move(global_pos)
        self.show()
        self.query.setFocus()

    def refresh(self) -> None:
        self.results.clear()
        for node_type in rank_node_types(self.node_types, self.query.text(), self.recent, self.wanted,
                                         self.needs_input)[:60]:
            item = QListWidgetItem(f"{node_type.display_name}    ·  {node_type.category}")
            item.setData(Qt.ItemDataRole.UserRole, node_type.type_name)
            item.setToolTip(node_type.description or node_type.type_name)
            self.results.addItem(item)
        if self.results.count():
            self.results.setCurrentRow(0)

    def choose_current(self) -> None:
        item = self.results.currentItem()
        if item is not None:
            self._activated(item)

    def _activated(self, item: QListWidgetItem) -> None:
        type_name = item.data(Qt.ItemDataRole.UserRole)
        self.close()
        self.chosen.emit(type_name)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if isinstance(event, QKeyEvent) and event.type() == QEvent.Type.KeyPress:
            key = event.key()
            if key in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
                self.choose_current()
                return True
            if key in (Qt.Key.Key_Down, Qt.Key.Key_Up):
                row = self.results.currentRow() + (1 if key == Qt.Key.Key_Down else -1)
                self.results.setCurrentRow(max(0, min(self.results.count() - 1, row)))
                return True
            if key == Qt.Key.Key_Escape:
                self.close()
                return True
        return super().eventFilter(watched, event)
