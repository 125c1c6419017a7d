"""Widget values painted inside a node (text, a slider bar for bounded numbers, arrows to step) and the one
transient editor popup that opens on click; no proxy widget lives on the canvas."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QPoint, QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QFont, QKeyEvent, QPainter, QPolygonF
from PySide6.QtWidgets import QComboBox, QFrame, QLineEdit, QPlainTextEdit, QVBoxLayout, QWidget

from app import theme
from app.gui_words import INPUT_LABELS
from engine.graph.spec import BOOLEAN, COMBO, FLOAT, INT, SEED, SEED_MAX, STRING, Input

ARROW_WIDTH = 14.0


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
    font.setPointSizeF(8.5)
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
    """A transient popup editing one widget value; emits `committed(value)` on Enter, closes on Esc."""

    committed = Signal(object)
    rejected_text = Signal(str)

    def __init__(self, spec: Input, value: Any, choices: list[str], parent: QWidget | None = None) -> None:
        super().__init__(parent, Qt.WindowType.Popup)
        self.setObjectName("nodeSearch")
        self.spec = spec
        self._finished = False
        layout = QVBoxLayout(self)
        layout.setContentsMargins(3, 3, 3, 3)
        if spec.kind == COMBO:
            self.editor: QWidget = QComboBox()
            self.editor.addItems(choices)
            if value in choices:
                self.editor.setCurrentIndex(choices.index(value))
            self.editor.activated.connect(self._commit_combo)
        elif spec.kind == STRING and spec.multiline:
            self.editor = QPlainTextEdit(str(value))
            self.editor.setMinimumSize(320, 120)
            self.editor.installEventFilter(self)
        else:
            self.editor = QLineEdit(str(value))
            self.editor.selectAll()
            self.editor.returnPressed.connect(self.commit)
        layout.addWidget(self.editor)

    def open_at(self, global_pos: QPoint, width: int) -> None:
        self.setMinimumWidth(max(140, width))
        self.move(global_pos)
        self.show()
        self.editor.setFocus()

    def text(self) -> str:
        if isinstance(self.editor, QPlainTextEdit):
            return self.editor.toPlainText()
        if isinstance(self.editor, QComboBox):
            return self.editor.currentText()
        return self.editor.text()

    def set_text(self, text: str) -> None:
        if isinstance(self.editor, QPlainTextEdit):
            self.editor.setPlainText(text)
        elif isinstance(self.editor, QComboBox):
            self.editor.setCurrentText(text)
        else:
            self.editor.setText(text)

    def commit(self) -> None:
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

    def _commit_combo(self, index: int) -> None:
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
            if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and (
                    event.modifiers() & Qt.KeyboardModifier.ControlModifier):
                self.commit()
                return True
        return super().eventFilter(watched, event)

