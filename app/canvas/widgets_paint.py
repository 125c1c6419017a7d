"""Widget values painted inside a node (text, a slider bar for bounded numbers, arrows to step) and the one
transient editor popup that opens on click (a combo opens as its list of choices, so one more click chooses);
no proxy widget lives on the canvas."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QPoint, QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QFont, QKeyEvent, QPainter, QPolygonF
from PySide6.QtWidgets import (
    QFrame,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPlainTextEdit,
    QVBoxLayout,
    QWidget,
)

from app import theme
from app.gui_words import INPUT_LABELS
from engine.graph.spec import BOOLEAN, COMBO, FLOAT, INT, SEED, SEED_MAX, STRING, Input

ARROW_WIDTH = 14.0
FILTER_FROM = 10  # a combo with at least this many choices gets a filter field above its list
LIST_ROWS = 14  # the most rows a combo's list shows before it scrolls
NODE_TEXT_POINTS = 8.5  # the size of slot names and widget rows on a node


def format_value(spec: Input, value: Any) -> str:
    """A widget value as shown on the node: floats with the precision of their step, text on one line."""
    if spec.kind == FLOAT and isinstance(value, (int, float)) and not isinstance(value, bool):
        step = spec.step or 0.01
        decimals = max(0, min(6, len(f"{step:.6f}".rstrip("0").split(".")[1])))
        return f"{value:.{decimals}f}"
    if spec.kind == BOOLEAN:
        return "true" if value else "false"
    if spec.kind == STRING:
        text = str(value).replace("\n", " ")
        return text if text else "(empty)"
    return str(value)


def is_steppable(spec: Input) -> bool:
    return spec.kind in (INT, FLOAT, SEED)


def stepped(spec: Input, value: Any, direction: int) -> Any:
    """`value` moved one step up (direction 1) or down (-1), kept inside min/max."""
    step = spec.step or (1 if spec.kind != FLOAT else 0.01)
    new = value + direction * step
    low = 0 if spec.kind == SEED else spec.min
    high = SEED_MAX if spec.kind == SEED else spec.max
    if low is not None:
        new = max(low, new)
    if high is not None:
        new = min(high, new)
    return int(new) if spec.kind in (INT, SEED) else round(float(new), 10)


def widget_zone(spec: Input, rect: QRectF, x: float) -> str:
    """Which part of a painted widget row an x coordinate hits: "dec", "inc" or "edit"."""
    if is_steppable(spec):
        if x < rect.left() + ARROW_WIDTH:
            return "dec"
        if x > rect.right() - ARROW_WIDTH:
            return "inc"
    return "edit"


def paint_widget_row(painter: QPainter, rect: QRectF, spec: Input, value: Any, linked: bool,
                     seed_control: str | None = None) -> None:
    """One widget row: a rounded field, a fill bar for bounded numbers, the name left, the value right."""
    painter.setPen(Qt.PenStyle.NoPen)
    painter.setBrush(theme.WIDGET_BG)
    if not (spec.kind == STRING and spec.multiline and not linked):
        painter.drawRoundedRect(rect, rect.height() / 2, rect.height() / 2)
    font = QFont(painter.font())
    font.setPointSizeF(NODE_TEXT_POINTS)
    painter.setFont(font)
    text_rect = rect.adjusted(10, 0, -10, 0)
    if linked:
        painter.setPen(theme.TEXT_DIM)
        painter.drawText(text_rect, Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft,
                         f"{spec.name}  (linked)")
        return
    if spec.kind == STRING and spec.multiline:
        painter.setBrush(theme.WIDGET_BG)
        painter.drawRoundedRect(rect, 6, 6)
        box = rect.adjusted(8, 4, -8, -4)
        flags = Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft | Qt.TextFlag.TextWordWrap
        painter.setPen(theme.TEXT if value else theme.TEXT_DIM)
        painter.drawText(box, flags, str(value) if value else spec.name)
        return
    if spec.kind in (INT, FLOAT) and spec.min is not None and spec.max is not None and spec.max > spec.min:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            fraction = min(1.0, max(0.0, (value - spec.min) / (spec.max - spec.min)))
            fill = QRectF(rect.left(), rect.top(), rect.width() * fraction, rect.height())
            painter.save()
            painter.setClipRect(fill)
            painter.setBrush(theme.WIDGET_FILL)
            painter.drawRoundedRect(rect, rect.height() / 2, rect.height() / 2)
            painter.restore()
    if is_steppable(spec):
        painter.setBrush(theme.TEXT_DIM)
        mid = rect.center().y()
        left, right = rect.left() + 5, rect.right() - 5
        painter.drawPolygon(QPolygonF([QPointF(left + 5, mid - 3.5), QPointF(left, mid),
                                       QPointF(left + 5, mid + 3.5)]))
        painter.drawPolygon(QPolygonF([QPointF(right - 5, mid - 3.5), QPointF(right, mid),
                                       QPointF(right - 5, mid + 3.5)]))
        text_rect = rect.adjusted(ARROW_WIDTH, 0, -ARROW_WIDTH, 0)
    painter.setPen(theme.TEXT_DIM)
    label = INPUT_LABELS.get(spec.name, spec.name)
    painter.drawText(text_rect, Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft, label)
    shown = format_value(spec, value)
    if seed_control and seed_control != "fixed":
        shown += f"  ({seed_control})"
    if spec.kind == BOOLEAN:
        painter.setPen(theme.ACCENT if value else theme.TEXT_DIM)
    else:
        painter.setPen(theme.TEXT)
    name_width = painter.fontMetrics().horizontalAdvance(label) + 12
    value_rect = text_rect.adjusted(name_width, 0, 0, 0)
    elided = painter.fontMetrics().elidedText(shown, Qt.TextElideMode.ElideRight, int(value_rect.width()))
    painter.drawText(value_rect, Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignRight, elided)


def parse_value(spec: Input, text: str) -> Any:
    """The text of an editor as a value of the widget's kind; ValueError naming the text and the kind."""
    text = text.strip() if spec.kind != STRING else text
    if spec.kind in (INT, SEED):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{spec.name}: {text!r} is not an integer") from None
    if spec.kind == FLOAT:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{spec.name}: {text!r} is not a number") from None
    return text


class ValueEditor(QFrame):
    """A transient popup editing one widget value; emits `committed(value)` on Enter (a combo: on a click on a
    choice), closes on Esc."""

    committed = Signal(object)
    rejected_text = Signal(str)

    def __init__(self, spec: Input, value: Any, choices: list[str], parent: QWidget | None = None) -> None:
        super().__init__(parent, Qt.WindowType.Popup)
        self.setObjectName("nodeSearch")
        self.spec = spec
        self._finished = False
        layout = QVBoxLayout(self)
        layout.setContentsMargins(3, 3, 3, 3)
        self.filter: QLineEdit | None = None
        if spec.kind == COMBO:
            self.editor: QWidget = self._choice_list(choices, str(value))
            if len(choices) >= FILTER_FROM:
                self.filter = QLineEdit()
                self.filter.setPlaceholderText("Filter...")
                self.filter.textChanged.connect(self._filter_choices)
                self.filter.returnPressed.connect(self.commit)
                self.filter.installEventFilter(self)
                layout.addWidget(self.filter)
        elif spec.kind == STRING and spec.multiline:
            self.editor = QPlainTextEdit(str(value))
            self.editor.setMinimumSize(320, 120)
            self.editor.installEventFilter(self)
        else:
            self.editor = QLineEdit(str(value))
            self.editor.selectAll()
            self.editor.returnPressed.connect(self.commit)
        layout.addWidget(self.editor)

    def _choice_list(self, choices: list[str], value: str) -> QListWidget:
        choice_list = QListWidget()
        choice_list.addItems(choices)
        if value in choices:
            choice_list.setCurrentRow(choices.index(value))
        elif choices:
            choice_list.setCurrentRow(0)
        rows = max(1, min(LIST_ROWS, len(choices)))
        choice_list.setFixedHeight(rows * max(18, choice_list.sizeHintForRow(0)) + 6)
        choice_list.itemClicked.connect(self._commit_choice)
        choice_list.itemActivated.connect(self._commit_choice)
        return choice_list

    def _filter_choices(self, text: str) -> None:
        assert isinstance(self.editor, QListWidget)
        needle = text.lower()
        first = None
        for row in range(self.editor.count()):
            item = self.editor.item(row)
            item.setHidden(needle not in item.text().lower())
            if first is None and not item.isHidden():
                first = item
        if first is not None and (self.editor.currentItem() is None or self.editor.currentItem().isHidden()):
            self.editor.setCurrentItem(first)

    def open_at(self, global_pos: QPoint, width: int) -> None:
        self.setMinimumWidth(max(140, width))
        self.move(global_pos)
        self.show()
        if isinstance(self.editor, QListWidget) and self.editor.currentItem() is not None:
            self.editor.scrollToItem(self.editor.currentItem())
        (self.filter or self.editor).setFocus()

    def text(self) -> str:
        if isinstance(self.editor, QPlainTextEdit):
            return self.editor.toPlainText()
        if isinstance(self.editor, QListWidget):
            current = self.editor.currentItem()
            return current.text() if current is not None and not current.isHidden() else ""
        return self.editor.text()

    def set_text(self, text: str) -> None:
        if isinstance(self.editor, QPlainTextEdit):
            self.editor.setPlainText(text)
        elif isinstance(self.editor, QListWidget):
            found = self.editor.findItems(text, Qt.MatchFlag.MatchExactly)
            if found:
                self.editor.setCurrentItem(found[0])
        else:
            self.editor.setText(text)

    def commit(self) -> None:
        if self.spec.kind == COMBO and not self.text():
            return  # the filter hides every choice
        try:
            value = parse_value(self.spec, self.text())
        except ValueError as error:
            self.rejected_text.emit(str(error))
            return
        problem = self.spec.check_value(value) if self.spec.kind != COMBO else None
        if problem is not None:
            self.rejected_text.emit(problem)
            return
        self._finished = True
        self.committed.emit(value)
        self.close()

    def _commit_choice(self, item: QListWidgetItem) -> None:
        assert isinstance(self.editor, QListWidget)
        self.editor.setCurrentItem(item)
        self.commit()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() == Qt.Key.Key_Escape:
            self._finished = True  # Esc discards the edit
        super().keyPressEvent(event)

    def hideEvent(self, event: Any) -> None:
        """A prompt typed in the text box is kept when the popup closes by a click elsewhere."""
        if not self._finished and isinstance(self.editor, QPlainTextEdit):
            self.commit()
        self._finished = True
        super().hideEvent(event)

    def eventFilter(self, watched: Any, event: Any) -> bool:
        if isinstance(event, QKeyEvent) and event.type() == QKeyEvent.Type.KeyPress:
            if watched is self.filter and event.key() in (Qt.Key.Key_Up, Qt.Key.Key_Down):
                self._step_choice(-1 if event.key() == Qt.Key.Key_Up else 1)
                return True
            if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and (
                    event.modifiers() & Qt.KeyboardModifier.ControlModifier):
                self.commit()
                return True
        return super().eventFilter(watched, event)

    def _step_choice(self, direction: int) -> None:
        """Arrow keys in the filter field move through the visible choices."""
        assert isinstance(self.editor, QListWidget)
        row = self.editor.currentRow()
        while 0 <= row + direction < self.editor.count():
            row += direction
            if not self.editor.item(row).isHidden():
                self.editor.setCurrentRow(row)
                return
