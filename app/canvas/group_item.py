"""A group: a titled frame behind nodes; dragging its title moves the nodes inside, its corner resizes it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import QGraphicsItem, QGraphicsSceneMouseEvent

from app import theme
from engine.graph.document import Group

if TYPE_CHECKING:
    from app.canvas.node_item import NodeItem
    from app.canvas.scene import WorkflowScene

TITLE_HEIGHT = 28.0
HANDLE = 14.0
DEFAULT_COLOR = "#3f6f8f"


class GroupItem(QGraphicsItem):
    def __init__(self, workflow_scene: WorkflowScene, group: Group) -> None:
        super().__init__()
        self.workflow_scene = workflow_scene
        self.group = group
        self.setZValue(-10)
        self.setFlags(QGraphicsItem.GraphicsItemFlag.ItemIsMovable
                      | QGraphicsItem.GraphicsItemFlag.ItemIsSelectable
                      | QGraphicsItem.GraphicsItemFlag.ItemSendsGeometryChanges)
        self._carried: list[NodeItem] = []
        self._resizing = False
        self._live_size = (0.0, 0.0)  # the size while the corner is dragged
        self.sync()

    @property
    def group_id(self) -> str:
        return self.group.id

    def sync(self) -> None:
        """Position and size from the document's rect."""
        self.prepareGeometryChange()
        x, y, _, _ = self.group.rect
        self.setPos(QPointF(x, y))
        self.update()

    def size(self) -> tuple[float, float]:
        return self.group.rect[2], self.group.rect[3]

    def current_rect(self) -> tuple[float, float, float, float]:
        """The rect as the item shows it now (during a drag it differs from the document)."""
        width, height = self._live_size if self._resizing else self.size()
        return (self.pos().x(), self.pos().y(), width, height)

    def boundingRect(self) -> QRectF:
        width, height = self._live_size if self._resizing else self.size()
        return QRectF(0, 0, width, height).adjusted(-2, -2, 2, 2)

    def paint(self, painter: QPainter, option: Any, widget: Any = None) -> None:
        width, height = self._live_size if self._resizing else self.size()
        color = QColor(self.group.color or DEFAULT_COLOR)
        fill = QColor(color)
        fill.setAlphaF(0.18)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(QPen(theme.SELECTED if self.isSelected() else color, 1.5))
        painter.setBrush(fill)
        painter.drawRoundedRect(QRectF(0, 0, width, height), 6, 6)
        title_fill = QColor(color)
        title_fill.setAlphaF(0.55)
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(title_fill)
        painter.drawRoundedRect(QRectF(0, 0, width, TITLE_HEIGHT), 6, 6)
        font = QFont(painter.font())
        font.setPointSizeF(11)
        font.setBold(True)
        painter.setFont(font)
        painter.setPen(theme.TEXT)
        painter.drawText(QRectF(10, 0, width - 20, TITLE_HEIGHT),
                         Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft, self.group.title)
        painter.setPen(QPen(color, 1.5))
        for offset in (4.0, 8.0, 12.0):
            painter.drawLine(QPointF(width - offset, height - 2), QPointF(width - 2, height - offset))

    def _in_handle(self, pos: QPointF) -> bool:
        width, height = self.size()
        return pos.x() > width - HANDLE and pos.y() > height - HANDLE

    def mousePressEvent(self, event: QGraphicsSceneMouseEvent) -> None:
        pos = event.pos()
        if self._in_handle(pos):
            self._resizing = True
            self._live_size = self.size()
            event.accept()
            return
        if pos.y() > TITLE_HEIGHT:
            event.ignore()  # the body lets the rubber band start
            return
        self._carried = self.workflow_scene.nodes_inside(self.group.rect)
        super().mousePressEvent(event)

    def mouseMoveEvent(self, event: QGraphicsSceneMouseEvent) -> None:
        if self._resizing:
            self.prepareGeometryChange()
            self._live_size = (max(120.0, event.pos().x()), max(TITLE_HEIGHT + 20, event.pos().y()))
            self.update()
            return
        super().mouseMoveEvent(event)

    def mouseReleaseEvent(self, event: QGraphicsSceneMouseEvent) -> None:
        if self._resizing:
            rect = self.current_rect()
            self._resizing = False
            self.workflow_scene.commit_group_rect(self.group_id, rect)
            return
        super().mouseReleaseEvent(event)
        self._carried = []

    def mouseDoubleClickEvent(self, event: QGraphicsSceneMouseEvent) -> None:
        if event.pos().y() <= TITLE_HEIGHT:
            self.workflow_scene.request_group_title_edit(self.group_id)
            return
        super().mouseDoubleClickEvent(event)

    def itemChange(self, change: QGraphicsItem.GraphicsItemChange, value: Any) -> Any:
        if change == QGraphicsItem.GraphicsItemChange.ItemPositionChange and self._carried:
            delta = value - self.pos()
            for node_item in self._carried:
                if not node_item.isSelected() or not self.isSelected():
                    node_item.setPos(node_item.pos() + delta)
        return super().itemChange(change, value)
