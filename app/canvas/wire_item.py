"""Links drawn as horizontal bezier curves from an output port to an input port."""

from __future__ import annotations

from PySide6.QtCore import QPointF, Qt
from PySide6.QtGui import QColor, QPainterPath, QPen
from PySide6.QtWidgets import QGraphicsPathItem

from app import theme
from engine.graph.document import Link


def bezier_path(start: QPointF, end: QPointF) -> QPainterPath:
    """A cubic curve leaving `start` to the right and entering `end` from the left."""
    bend = max(40.0, abs(end.x() - start.x()) * 0.5)
    path = QPainterPath(start)
    path.cubicTo(QPointF(start.x() + bend, start.y()), QPointF(end.x() - bend, end.y()), end)
    return path


class WireItem(QGraphicsPathItem):
    """The drawing of one document link; `update_path` follows its two ports."""

    def __init__(self, link: Link, color: QColor) -> None:
        super().__init__()
        self.link = link
        self.setZValue(-1)
        self.setFlag(QGraphicsPathItem.GraphicsItemFlag.ItemIsSelectable, True)
        self.setPen(QPen(color, 2.6, Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap))
        self.setToolTip(f"{link.type}: node {link.source} output {link.output} -> node {link.target} "
                        f"input {link.input}")

    @property
    def link_id(self) -> str:
        return self.link.id

    def update_path(self, start: QPointF, end: QPointF) -> None:
        self.setPath(bezier_path(start, end))

    def paint(self, painter, option, widget=None) -> None:
        pen = QPen(self.pen())
        if self.isSelected():
            pen.setColor(theme.SELECTED)
            pen.setWidthF(3.4)
        painter.setPen(pen)
        painter.setBrush(Qt.BrushStyle.NoBrush)
        painter.drawPath(self.path())


class DragWire(QGraphicsPathItem):
    """The wire that follows the cursor while the user drags from a port."""

    def __init__(self, color: QColor) -> None:
        super().__init__()
        self.setZValue(10)
        self.setPen(QPen(color, 2.4, Qt.PenStyle.DashLine, Qt.PenCapStyle.RoundCap))

    def update_path(self, start: QPointF, end: QPointF) -> None:
        self.setPath(bezier_path(start, end))
