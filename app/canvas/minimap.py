"""A small overview of the whole graph in a corner of the canvas; click or drag in it to move the view."""

from __future__ import annotations

from typing import TYPE_CHECKING

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QMouseEvent, QPainter, QPen
from PySide6.QtWidgets import QWidget

from app import theme

if TYPE_CHECKING:
    from app.canvas.view import CanvasView


class Minimap(QWidget):
    def __init__(self, view: CanvasView) -> None:
        super().__init__(view)
        self.view = view
        self.setFixedSize(200, 130)  # the view shrinks it in small windows
        self.setCursor(Qt.CursorShape.PointingHandCursor)
        self.setToolTip("Overview: click or drag to move the view")

    def _world(self) -> QRectF:
        """The scene area shown: every node and group plus what the view shows now."""
        scene = self.view.workflow_scene
        visible = self.view.mapToScene(self.view.viewport().rect()).boundingRect()
        world = visible
        for item in [*scene.node_items.values(), *scene.group_items.values()]:
            world = world.united(item.sceneBoundingRect())
        return world.adjusted(-40, -40, 40, 40)

    def _transform(self) -> tuple[QRectF, float, QPointF]:
        world = self._world()
        scale = min(self.width() / world.width(), self.height() / world.height())
        offset = QPointF((self.width() - world.width() * scale) / 2,
                         (self.height() - world.height() * scale) / 2)
        return world, scale, offset

    def _to_map(self, rect: QRectF) -> QRectF:
        world, scale, offset = self._transform()
        return QRectF((rect.x() - world.x()) * scale + offset.x(),
                      (rect.y() - world.y()) * scale + offset.y(),
                      rect.width() * scale, rect.height() * scale)

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(QPen(QColor("#3a3f48"), 1))
        painter.setBrush(QColor(20, 22, 25, 220))
        painter.drawRoundedRect(QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5), 5, 5)
        scene = self.view.workflow_scene
        for group in scene.group_items.values():
            color = QColor(group.group.color or "#3f6f8f")
            color.setAlphaF(0.35)
            painter.fillRect(self._to_map(group.sceneBoundingRect()), color)
        painter.setPen(Qt.PenStyle.NoPen)
        for item in scene.node_items.values():
            color = theme.ERROR if item.errors else (theme.RUNNING if item.running else QColor("#6b7382"))
            painter.setBrush(color)
            painter.drawRect(self._to_map(item.sceneBoundingRect()))
        visible = self.view.mapToScene(self.view.viewport().rect()).boundingRect()
        painter.setPen(QPen(theme.ACCENT, 1.2))
        painter.setBrush(Qt.BrushStyle.NoBrush)
        painter.drawRect(self._to_map(visible))

    def _center_at(self, pos: QPointF) -> None:
        world, scale, offset = self._transform()
        self.view.centerOn(QPointF((pos.x() - offset.x()) / scale + world.x(),
                                   (pos.y() - offset.y()) / scale + world.y()))
        self.update()

    def mousePressEvent(self, event: QMouseEvent) -> None:
        self._center_at(event.position())

    def mouseMoveEvent(self, event: QMouseEvent) -> None:
        if event.buttons() & Qt.MouseButton.LeftButton:
            self._center_at(event.position())
