"""A node's connection point: a small coloured circle for one input or output, coloured by its data type;
while a wire is dragged, the ports it fits light up and the others dim."""

from __future__ import annotations

from typing import TYPE_CHECKING

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QPainter, QPen
from PySide6.QtWidgets import QGraphicsItem, QStyleOptionGraphicsItem, QWidget

from app import theme

if TYPE_CHECKING:
    from app.canvas.node_item import NodeItem

RADIUS = 5.0


class PortItem(QGraphicsItem):
    """An input (`key` is the input name) or an output (`key` is the output index) of a node item."""

    def __init__(self, node_item: NodeItem, is_output: bool, key: str | int, type_name: str,
                 label: str, is_widget: bool = False) -> None:
        super().__init__(node_item)
        self.node_item = node_item
        self.is_output = is_output
        self.key = key
        self.type_name = type_name
        self.label = label
        self.is_widget = is_widget  # an input that is a widget until something is linked into it
        self.connected = False
        self.highlight: str | None = None  # while a wire is dragged: "fits" or "dim"
        self.setAcceptHoverEvents(True)
        self._hovered = False
        self.setZValue(2)

    def set_highlight(self, state: str | None) -> None:
        if state != self.highlight:
            self.highlight = state
            self.update()

    @property
    def node_id(self) -> str:
        return self.node_item.node_id

    def boundingRect(self) -> QRectF:
        r = RADIUS + 6
        return QRectF(-r, -r, 2 * r, 2 * r)

    def center(self) -> QPointF:
        return self.scenePos()

    def hoverEnterEvent(self, event) -> None:
        self._hovered = True
        self.update()

    def hoverLeaveEvent(self, event) -> None:
        self._hovered = False
        self.update()

    def paint(self, painter: QPainter, option: QStyleOptionGraphicsItem,
              widget: QWidget | None = None) -> None:
        color = theme.type_color(self.type_name)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        if self.highlight == "fits":
            glow = theme.type_color(self.type_name)
            glow.setAlphaF(0.35)
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(glow)
            painter.drawEllipse(QPointF(0, 0), RADIUS + 5, RADIUS + 5)
            painter.setPen(QPen(theme.SELECTED, 1.5))
            painter.setBrush(color)
            painter.drawEllipse(QPointF(0, 0), RADIUS + 1.5, RADIUS + 1.5)
            return
        if self.highlight == "dim":
            painter.setOpacity(0.25)
        radius = RADIUS + (1.5 if self._hovered else 0.0)
        if self.is_widget and not self.connected:
            if not self._hovered:
                radius = 3.0
            color.setAlphaF(0.55 if not self._hovered else 1.0)
        painter.setPen(QPen(theme.NODE_BORDER, 1.2))
        if self.connected or self._hovered:
            painter.setBrush(color)
        else:
            painter.setBrush(Qt.BrushStyle.NoBrush)
            painter.setPen(QPen(color, 1.8))
        painter.drawEllipse(QPointF(0, 0), radius, radius)
