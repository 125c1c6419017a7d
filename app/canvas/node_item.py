"""One node drawn on the canvas: a title bar (with a progress bar while it runs), typed ports, painted
widget rows, an image area for previews and a line for its error."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QFontMetricsF, QImage, QPainter, QPainterPath, QPen, QPolygonF
from PySide6.QtWidgets import QGraphicsItem, QGraphicsSceneHoverEvent, QGraphicsSceneMouseEvent

from app import theme
from app.canvas.port_item import PortItem
from app.canvas.widgets_paint import NODE_TEXT_POINTS, paint_widget_row, stepped, widget_zone
from app.device_badges import Badge, node_badge
from engine.graph.document import NodeDoc
from engine.graph.spec import ANY, BOOLEAN, STRING, NodeType

if TYPE_CHECKING:
    from app.canvas.scene import WorkflowScene

DEFAULT_WIDTH = 240.0
TITLE_HEIGHT = 26.0
ROW_HEIGHT = 22.0
TEXT_BOX_HEIGHT = 76.0  # a multiline text widget (a prompt) shows a few wrapped lines
IMAGE_MAX_HEIGHT = 320.0
COLLAPSE_BOX = 18.0


BADGE_SCREEN_PIXELS = 11.0  # the device badge's text height on screen at any zoom down to BADGE_MIN_ZOOM
BADGE_MIN_ZOOM = 0.6


def _badge_font(painter: QPainter) -> QFont:
    """The device badge's font: 12 px in the scene at least, larger when zoomed out so that it stays
    BADGE_SCREEN_PIXELS tall on screen down to zoom BADGE_MIN_ZOOM."""
    font = QFont(painter.font())
    zoom = max(BADGE_MIN_ZOOM, min(1.0, painter.worldTransform().m22() or 1.0))
    font.setPixelSize(round(max(12.0, BADGE_SCREEN_PIXELS / zoom)))
    font.setBold(True)
    return font


class NodeItem(QGraphicsItem):
    def __init__(self, workflow_scene: WorkflowScene, node: NodeDoc,
                 node_type: type[NodeType] | None) -> None:
        super().__init__()
        self.workflow_scene = workflow_scene
        self.node = node
        self.node_type = node_type
        self.inputs: dict[str, PortItem] = {}
        self.outputs: list[PortItem] = []
        self.widget_rects: dict[str, QRectF] = {}
        self.running = False
        self.progress: tuple[int, int] | None = None
        self.errors: list[str] = []
        self.image: QImage | None = None
        self.setFlags(QGraphicsItem.GraphicsItemFlag.ItemIsMovable
                      | QGraphicsItem.GraphicsItemFlag.ItemIsSelectable
                      | QGraphicsItem.GraphicsItemFlag.ItemSendsGeometryChanges)
        self.setAcceptHoverEvents(True)
        self.setPos(QPointF(*node.pos))
        self._height = TITLE_HEIGHT
        self._build_ports()
        self.relayout()

    # -- structure --

    @property
    def node_id(self) -> str:
        return self.node.id

    @property
    def width(self) -> float:
        return self.node.size[0] if self.node.size else DEFAULT_WIDTH

    def title_text(self) -> str:
        if self.node.title:
            return self.node.title
        return self.node_type.display_name if self.node_type is not None else f"{self.node.type} (unknown)"

    def link_inputs(self) -> list[tuple[str, str]]:
        """(name, type) of the inputs drawn as slots (not widgets); for an unknown type, those linked."""
        if self.node_type is None:
            links = self.workflow_scene.workflow.links_into(self.node_id)
            return [(name, link.type) for name, link in links.items()]
        return [(i.name, i.kind) for i in self.node_type.inputs if not i.is_widget]

    def output_slots(self) -> list[tuple[str, str]]:
        if self.node_type is None:
            used = [link.output for link in self.workflow_scene.workflow.links_from(self.node_id)]
            return [(f"output {i}", ANY) for i in range(max(used, default=-1) + 1)]
        return [(o.name, o.type) for o in self.node_type.outputs]

    def _build_ports(self) -> None:
        for port in [*self.inputs.values(), *self.outputs]:
            port.setParentItem(None)
            if port.scene() is not None:
                port.scene().removeItem(port)
        self.inputs = {name: PortItem(self, False, name, kind, name) for name, kind in self.link_inputs()}
        if self.node_type is not None:
            for spec in self.node_type.widget_inputs():
                self.inputs[spec.name] = PortItem(self, False, spec.name, spec.link_type, spec.name, True)
        self.outputs = [PortItem(self, True, index, kind, name)
                        for index, (name, kind) in enumerate(self.output_slots())]

    def rebuild(self) -> None:
        """Ports again from the type (an unknown type's ports follow its links)."""
        self._build_ports()
        self.relayout()

    def relayout(self) -> None:
        self.prepareGeometryChange()
        width = self.width
        slot_rows = max(len(self.link_inputs()), len(self.outputs))
        top = TITLE_HEIGHT + 4
        self.widget_rects = {}
        collapsed = self.node.collapsed
        middle = TITLE_HEIGHT / 2
        slot_names = [name for name, _ in self.link_inputs()]
        for index, name in enumerate(slot_names):
            self.inputs[name].setPos(0, middle if collapsed else top + (index + 0.5) * ROW_HEIGHT)
        for index, port in enumerate(self.outputs):
            port.setPos(width, middle if collapsed else top + (index + 0.5) * ROW_HEIGHT)
        y = top + slot_rows * ROW_HEIGHT
        if self.node_type is not None:
            for spec in self.node_type.widget_inputs():
                linked = self.inputs[spec.name].connected
                text_box = spec.kind == STRING and spec.multiline and not linked
                height = TEXT_BOX_HEIGHT if text_box else ROW_HEIGHT
                self.widget_rects[spec.name] = QRectF(10, y + 2, width - 20, height - 4)
                self.inputs[spec.name].setPos(0, middle if collapsed else y + ROW_HEIGHT / 2)
                y += height
        for port in [*self.inputs.values(), *self.outputs]:
            port.setVisible(not collapsed)
        self._image_top = y + 4
        if self.image is not None and not self.image.isNull():
            y += 8 + self._image_size().height()
        self._error_top = y + 2
        if self.errors:
            y += ROW_HEIGHT
        self._height = TITLE_HEIGHT if collapsed else y + 6
        self.update()

    def _image_size(self) -> QRectF:
        assert self.image is not None
        available = self.width - 16
        aspect = self.image.height() / max(1, self.image.width())
        height = min(IMAGE_MAX_HEIGHT, available * aspect)
        return QRectF(0, 0, height / aspect, height)

    def body_rect(self) -> QRectF:
        return QRectF(0, 0, self.width, self._height)

    def boundingRect(self) -> QRectF:
        return self.body_rect().adjusted(-9, -4, 9, 4)

    def shape(self) -> QPainterPath:
        path = QPainterPath()
        path.addRect(self.body_rect())
        return path

    # -- state set by the scene --

    def set_run_state(self, running: bool, progress: tuple[int, int] | None = None) -> None:
        self.running = running
        self.progress = progress
        self.update()

    def set_errors(self, errors: list[str]) -> None:
        self.errors = list(errors)
        self.relayout()
        self.setToolTip(self._tooltip_for_title())

    def set_image(self, image: QImage | None) -> None:
        self.image = image
        self.relayout()
        self.workflow_scene.update_wires_of(self.node_id)

    # -- painting --

    def paint(self, painter: QPainter, option: Any, widget: Any = None) -> None:
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        if self.node.mode == "muted":
            painter.setOpacity(0.4)
        body = self.body_rect()
        body_color = theme.BYPASSED.darker(220) if self.node.mode == "bypassed" else theme.NODE_BODY
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(body_color)
        painter.drawRoundedRect(body, 6, 6)
        title = QRectF(0, 0, self.width, TITLE_HEIGHT)
        path = QPainterPath()
        path.addRoundedRect(title, 6, 6)
        if not self.node.collapsed:
            path.addRect(QRectF(0, TITLE_HEIGHT / 2, self.width, TITLE_HEIGHT / 2))
        title_color = theme.BYPASSED if self.node.mode == "bypassed" else theme.NODE_TITLE
        painter.fillPath(path.simplified(), title_color)
        self._paint_title(painter, title)
        if not self.node.collapsed:
            self._paint_slots(painter)
            self._paint_widgets(painter)
            if self.image is not None and not self.image.isNull():
                size = self._image_size()
                target = QRectF((self.width - size.width()) / 2, self._image_top, size.width(), size.height())
                painter.drawImage(target, self.image)
            if self.errors:
                painter.setPen(theme.ERROR)
                rect = QRectF(10, self._error_top, self.width - 20, ROW_HEIGHT)
                text = painter.fontMetrics().elidedText(self.errors[0], Qt.TextElideMode.ElideRight,
                                                        int(rect.width()))
                painter.drawText(rect, Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft, text)
        self._paint_border(painter, body)

    def _paint_title(self, painter: QPainter, title: QRectF) -> None:
        painter.setBrush(theme.TEXT_DIM)
        painter.setPen(Qt.PenStyle.NoPen)
        cx, cy = 11.0, TITLE_HEIGHT / 2
        if self.node.collapsed:  # pointing right
            triangle = [QPointF(cx - 3, cy - 4), QPointF(cx + 4, cy), QPointF(cx - 3, cy + 4)]
        else:  # pointing down
            triangle = [QPointF(cx - 4, cy - 3), QPointF(cx + 4, cy - 3), QPointF(cx, cy + 4)]
        painter.drawPolygon(QPolygonF(triangle))
        font = QFont(painter.font())
        font.setPointSizeF(9.5)
        font.setBold(True)
        painter.setFont(font)
        painter.setPen(theme.TEXT)
        badge = self.badge() if not self.node.collapsed else None
        badge_room = QFontMetricsF(_badge_font(painter)).horizontalAdvance(badge.text) + 24 if badge else 0
        text_rect = title.adjusted(COLLAPSE_BOX + 4, 0, -8 - badge_room, 0)
        text = painter.fontMetrics().elidedText(self.title_text(), Qt.TextElideMode.ElideRight,
                                                int(text_rect.width()))
        painter.drawText(text_rect, Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft, text)
        if self.node.mode != "normal":
            painter.setPen(theme.TEXT_DIM)
            painter.drawText(text_rect, Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignRight,
                             self.node.mode)
        if badge is not None:
            self._paint_badge(painter, title, badge)
        if self.progress is not None and self.progress[1] > 0:
            fraction = min(1.0, self.progress[0] / self.progress[1])
            painter.fillRect(QRectF(0, TITLE_HEIGHT - 3, self.width * fraction, 3), theme.RUNNING)

    def badge(self) -> Badge | None:
        """Where this model-bearing node computes and where its weights rest (None for other nodes)."""
        if self.node_type is None or not self.node_type.memory_module:
            return None
        # the shared placement picture, resolved again only when a model node or the settings changed
        return node_badge(self.workflow_scene.workflow, self.workflow_scene.lookup, self.node_id)

    def _paint_badge(self, painter: QPainter, title: QRectF, badge: Badge) -> None:
        painter.setFont(_badge_font(painter))
        width = painter.fontMetrics().horizontalAdvance(badge.text) + 12
        height = max(TITLE_HEIGHT - 6, painter.fontMetrics().height() + 2)
        rect = QRectF(title.right() - width - 6, (TITLE_HEIGHT - height) / 2, width, height)
        color = QColor(badge.color)
        painter.setPen(QPen(color, 1))
        painter.setBrush(QColor(color.red(), color.green(), color.blue(), 40))
        painter.drawRoundedRect(rect, 4, 4)
        painter.drawText(rect, Qt.AlignmentFlag.AlignCenter, badge.text)

    def _paint_slots(self, painter: QPainter) -> None:
        font = QFont(painter.font())
        font.setPointSizeF(NODE_TEXT_POINTS)
        font.setBold(False)
        painter.setFont(font)
        painter.setPen(theme.TEXT)
        half = self.width / 2 - 12
        for name, _ in self.link_inputs():
            y = self.inputs[name].pos().y()
            painter.drawText(QRectF(12, y - ROW_HEIGHT / 2, half, ROW_HEIGHT),
                             Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft, name)
        for port in self.outputs:
            y = port.pos().y()
            painter.drawText(QRectF(self.width / 2, y - ROW_HEIGHT / 2, half, ROW_HEIGHT),
                             Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignRight, port.label)

    def _paint_widgets(self, painter: QPainter) -> None:
        if self.node_type is None:
            return
        defaults = self.node_type.default_widget_values()
        for spec in self.node_type.widget_inputs():
            value = self.node.widgets.get(spec.name, defaults[spec.name])
            paint_widget_row(painter, self.widget_rects[spec.name], spec, value,
                             self.inputs[spec.name].connected, self.node.seed_controls.get(spec.name))

    def _paint_border(self, painter: QPainter, body: QRectF) -> None:
        painter.setBrush(Qt.BrushStyle.NoBrush)
        if self.errors:
            painter.setPen(QPen(theme.ERROR, 2.5))
        elif self.running:
            painter.setPen(QPen(theme.RUNNING, 2.5))
        elif self.isSelected():
            painter.setPen(QPen(theme.SELECTED, 1.8))
        else:
            painter.setPen(QPen(theme.NODE_BORDER, 1.2))
        painter.drawRoundedRect(body, 6, 6)

    # -- interaction --

    def widget_at(self, pos: QPointF) -> str | None:
        if self.node.collapsed:
            return None
        for name, rect in self.widget_rects.items():
            if rect.adjusted(0, -2, 0, 2).contains(pos) and not self.inputs[name].connected:
                return name
        return None

    def mousePressEvent(self, event: QGraphicsSceneMouseEvent) -> None:
        pos = event.pos()
        if event.button() == Qt.MouseButton.LeftButton:
            if pos.y() < TITLE_HEIGHT and pos.x() < COLLAPSE_BOX:
                self.workflow_scene.set_collapsed([self.node_id], not self.node.collapsed)
                event.accept()
                return
            name = self.widget_at(pos)
            if name is not None:
                self._click_widget(name, pos)
                event.accept()
                return
        super().mousePressEvent(event)

    def _click_widget(self, name: str, pos: QPointF) -> None:
        assert self.node_type is not None
        spec = self.node_type.input_named(name)
        assert spec is not None
        value = self.node.widgets.get(name, self.node_type.default_widget_values()[name])
        zone = widget_zone(spec, self.widget_rects[name], pos.x())
        if spec.kind == BOOLEAN:
            self.workflow_scene.set_widget(self.node_id, name, not bool(value))
        elif zone == "edit":
            self.workflow_scene.request_editor(self.node_id, name,
                                               self.mapRectToScene(self.widget_rects[name]))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
                direction = 1 if zone == "inc" else -1
                self.workflow_scene.set_widget(self.node_id, name, stepped(spec, value, direction))

    def mouseDoubleClickEvent(self, event: QGraphicsSceneMouseEvent) -> None:
        if event.pos().y() < TITLE_HEIGHT:
            self.workflow_scene.request_title_edit(self.node_id)
            event.accept()
            return
        super().mouseDoubleClickEvent(event)

    def hoverMoveEvent(self, event: QGraphicsSceneHoverEvent) -> None:
        name = self.widget_at(event.pos())
        if name is None:
            for port in self.inputs.values():
                if (port.pos() - event.pos()).manhattanLength() < 10:
                    name = port.key
        if name is not None and self.node_type is not None:
            spec = self.node_type.input_named(str(name))
            tip = f"{name} ({spec.kind})" if spec is not None else str(name)
            if spec is not None and spec.description:
                tip += f"\n{spec.description}"
            self.setToolTip(tip)
        else:
            self.setToolTip(self._tooltip_for_title())

    def _tooltip_for_title(self) -> str:
        lines = [f"{self.title_text()}  [{self.node.type}, id {self.node_id}]"]
        if self.node_type is not None and self.node_type.description:
            lines.append(self.node_type.description)
        badge = self.badge()
        if badge is not None:
            lines.append(badge.tooltip)
        lines += [f"error: {message}" for message in self.errors]
        return "\n".join(lines)

    def itemChange(self, change: QGraphicsItem.GraphicsItemChange, value: Any) -> Any:
        if change == QGraphicsItem.GraphicsItemChange.ItemPositionHasChanged and self.scene() is not None:
            self.workflow_scene.update_wires_of(self.node_id)
        return super().itemChange(change, value)
