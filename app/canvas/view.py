"""The canvas view: zoom around the cursor, pan and select as ComfyUI (left-drag on empty canvas pans,
Ctrl+drag draws a selection box; `left_drag_selects` swaps the two; middle drag and space + drag always pan),
wires dragged between ports with the ports that fit lit up, the widget editor popup, drops of files and
palette entries, a minimap that can be hidden."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QPoint, QPointF, QRectF, Qt, QTimer, Signal, Slot
from PySide6.QtGui import QDragEnterEvent, QDropEvent, QKeyEvent, QMouseEvent, QPainter, QWheelEvent
from PySide6.QtWidgets import QGraphicsView, QMenu

from app import theme
from app.canvas.minimap import Minimap
from app.canvas.node_item import NodeItem
from app.canvas.port_item import PortItem
from app.canvas.scene import WorkflowScene, types_compatible
from app.canvas.widgets_paint import NODE_TEXT_POINTS, ValueEditor
from app.canvas.wire_item import DragWire
from engine.graph.spec import COMBO

NODE_TYPE_MIME = "application/x-sluice-node-type"
MIN_ZOOM, MAX_ZOOM = 0.1, 4.0
READABLE_TEXT_PIXELS = 9.0  # the first fit of a document never shrinks node text below this height
FIT_MARGIN = 60.0  # scene units around the content when fitting
MINIMAP_REFRESH_MS = 200  # the minimap follows scene changes at most this often (a run changes it constantly)


class CanvasView(QGraphicsView):
    files_dropped = Signal(list)  # local file paths dropped on the canvas
    search_requested = Signal(QPointF)  # scene position for the node search

    def __init__(self, scene: WorkflowScene, parent: Any = None) -> None:
        super().__init__(scene, parent)
        self.workflow_scene = scene
        self.setRenderHints(QPainter.RenderHint.Antialiasing | QPainter.RenderHint.TextAntialiasing
                            | QPainter.RenderHint.SmoothPixmapTransform)
        self.setViewportUpdateMode(QGraphicsView.ViewportUpdateMode.BoundingRectViewportUpdate)
        self.setCacheMode(QGraphicsView.CacheModeFlag.CacheBackground)  # the grid is drawn once per view
        self.setTransformationAnchor(QGraphicsView.ViewportAnchor.NoAnchor)
        self.setRubberBandSelectionMode(Qt.ItemSelectionMode.IntersectsItemShape)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setAcceptDrops(True)
        self.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        self._pan_start: QPoint | None = None
        self._space_down = False
        self.left_drag_selects = False  # the other way round: left-drag selects, Ctrl+drag pans
        self._drag_port: PortItem | None = None
        self._drag_wire: DragWire | None = None
        self.active_editor: ValueEditor | None = None
        self.minimap = Minimap(self)
        self._minimap_timer = QTimer(self, singleShot=True, interval=MINIMAP_REFRESH_MS)
        self._minimap_timer.timeout.connect(self.minimap.update)
        scene.changed.connect(self._scene_changed)
        scene.editor_requested.connect(self.open_editor)

    # -- zoom and fit --

    def zoom(self) -> float:
        return self.transform().m11()

    def wheelEvent(self, event: QWheelEvent) -> None:
        """Zoom keeping the scene point under the cursor where it is."""
        factor = 1.15 ** (event.angleDelta().y() / 120)
        factor = max(MIN_ZOOM / self.zoom(), min(MAX_ZOOM / self.zoom(), factor))
        cursor = event.position().toPoint()
        anchor = self.mapToScene(cursor)
        self.scale(factor, factor)
        drift = self.mapFromScene(anchor) - cursor
        self.horizontalScrollBar().setValue(self.horizontalScrollBar().value() + drift.x())
        self.verticalScrollBar().setValue(self.verticalScrollBar().value() + drift.y())
        self.minimap.update()
        event.accept()

    def readable_zoom(self) -> float:
        """The zoom at which node text (NODE_TEXT_POINTS) is READABLE_TEXT_PIXELS high on this screen."""
        text_pixels = NODE_TEXT_POINTS * self.logicalDpiY() / 72.0
        return min(MAX_ZOOM, READABLE_TEXT_PIXELS / text_pixels)

    def content_rect(self) -> QRectF | None:
        scene = self.workflow_scene
        items = [*scene.node_items.values(), *scene.group_items.values(), *scene.note_items.values()]
        if not items:
            return None
        bounds = items[0].sceneBoundingRect()
        for item in items[1:]:
            bounds = bounds.united(item.sceneBoundingRect())
        return bounds

    def fit_to_content(self, keep_readable: bool = False) -> None:
        """Show every node (at most 1.2x zoom). `keep_readable` (a document's first fit) never zooms out below
        readable_zoom: a graph too large for the window then shows its top-left part, the minimap the rest."""
        bounds = self.content_rect()
        if bounds is None:
            self.resetTransform()
            self.centerOn(0, 0)
            return
        self.fitInView(bounds.adjusted(-FIT_MARGIN, -FIT_MARGIN, FIT_MARGIN, FIT_MARGIN),
                       Qt.AspectRatioMode.KeepAspectRatio)
        if self.zoom() > 1.2:
            factor = 1.2 / self.zoom()
            self.scale(factor, factor)
            self.centerOn(bounds.center())
        floor = self.readable_zoom()
        if keep_readable and self.zoom() < floor:
            factor = floor / self.zoom()
            self.scale(factor, factor)
            visible = self.mapToScene(self.viewport().rect()).boundingRect()
            left = bounds.left() - FIT_MARGIN / 2
            top = bounds.top() - FIT_MARGIN / 2 if bounds.height() + FIT_MARGIN > visible.height() \
                else bounds.center().y() - visible.height() / 2
            self.centerOn(left + visible.width() / 2, top + visible.height() / 2)
        self.minimap.update()

    def cursor_scene_pos(self) -> QPointF:
        local = self.viewport().mapFromGlobal(self.cursor().pos())
        if not self.viewport().rect().contains(local):
            local = self.viewport().rect().center()
        return self.mapToScene(local)

    # -- mouse --

    def mousePressEvent(self, event: QMouseEvent) -> None:
        if event.button() == Qt.MouseButton.MiddleButton or (
                event.button() == Qt.MouseButton.LeftButton and self._space_down):
            self._start_pan(event.position().toPoint())
            event.accept()
            return
        if event.button() != Qt.MouseButton.LeftButton:
            super().mousePressEvent(event)
            return
        port = self._port_at(event.position().toPoint())
        if port is not None:
            self._start_wire(port)
            event.accept()
            return
        control = bool(event.modifiers() & Qt.KeyboardModifier.ControlModifier)
        selects = control != self.left_drag_selects
        self.setDragMode(QGraphicsView.DragMode.RubberBandDrag if selects else QGraphicsView.DragMode.NoDrag)
        super().mousePressEvent(event)  # an item under the cursor takes the press (and the drag) first
        if not selects and self.workflow_scene.mouseGrabberItem() is None:
            self._start_pan(event.position().toPoint())

    def _start_pan(self, pos: QPoint) -> None:
        self._pan_start = pos
        self.viewport().setCursor(Qt.CursorShape.ClosedHandCursor)

    def mouseMoveEvent(self, event: QMouseEvent) -> None:
        if self._pan_start is not None:
            delta = event.position().toPoint() - self._pan_start
            self._pan_start = event.position().toPoint()
            self.horizontalScrollBar().setValue(self.horizontalScrollBar().value() - delta.x())
            self.verticalScrollBar().setValue(self.verticalScrollBar().value() - delta.y())
            self.minimap.update()
            event.accept()
            return
        if self._drag_wire is not None and self._drag_port is not None:
            here = self.mapToScene(event.position().toPoint())
            anchor = self._drag_port.center()
            if self._drag_port.is_output:
                self._drag_wire.update_path(anchor, here)
            else:
                self._drag_wire.update_path(here, anchor)
            event.accept()
            return
        super().mouseMoveEvent(event)

    def mouseReleaseEvent(self, event: QMouseEvent) -> None:
        if self._pan_start is not None:
            self._pan_start = None
            self.viewport().unsetCursor()
            if self._space_down:
                self.viewport().setCursor(Qt.CursorShape.OpenHandCursor)
            event.accept()
            return
        if self._drag_port is not None:
            self._finish_wire(event.position().toPoint())
            event.accept()
            return
        super().mouseReleaseEvent(event)

    def mouseDoubleClickEvent(self, event: QMouseEvent) -> None:
        if self.itemAt(event.position().toPoint()) is None:
            self.search_requested.emit(self.mapToScene(event.position().toPoint()))
            event.accept()
            return
        super().mouseDoubleClickEvent(event)

    def _port_at(self, pos: QPoint) -> PortItem | None:
        for item in self.items(QRectF(pos.x() - 6, pos.y() - 6, 12, 12).toRect()):
            if isinstance(item, PortItem) and item.isVisible():
                return item
        return None

    def _start_wire(self, port: PortItem) -> None:
        scene = self.workflow_scene
        if not port.is_output and port.connected:
            # Pick the existing link up at its input end: drag from its source instead.
            link = scene.workflow.links_into(port.node_id).get(str(port.key))
            source = scene.port_of(link.source, True, link.output) if link is not None else None
            if source is not None:
                scene.disconnect_input(port.node_id, str(port.key))
                port = source
        self._drag_port = port
        self._drag_wire = DragWire(theme.type_color(port.type_name))
        scene.addItem(self._drag_wire)
        self._drag_wire.update_path(port.center(), port.center())
        self.light_up_ports(port)

    def light_up_ports(self, dragged: PortItem | None) -> None:
        """While a wire is dragged from `dragged`, every port it could connect to lights up and the others
        dim; None puts every port back."""
        for item in self.workflow_scene.node_items.values():
            for other in [*item.inputs.values(), *item.outputs]:
                if dragged is None or other is dragged:
                    other.set_highlight(None)
                    continue
                fits = other.node_id != dragged.node_id and other.is_output != dragged.is_output and (
                    types_compatible(dragged.type_name, other.type_name) if dragged.is_output
                    else types_compatible(other.type_name, dragged.type_name))
                other.set_highlight("fits" if fits else "dim")

    def _finish_wire(self, pos: QPoint) -> None:
        port, wire = self._drag_port, self._drag_wire
        self._drag_port, self._drag_wire = None, None
        self.light_up_ports(None)
        if wire is not None:
            self.workflow_scene.removeItem(wire)
        assert port is not None
        target = self._port_at(pos)
        if target is None:
            target = self._nearest_fitting_port(port, self.mapToScene(pos))
        if target is not None and target is not port:
            self.workflow_scene.connect_ports(port, target)
        elif target is None:
            self.workflow_scene.pending_port = port
            self.search_requested.emit(self.mapToScene(pos))

    def _nearest_fitting_port(self, port: PortItem, scene_pos: QPointF) -> PortItem | None:
        """Dropping a wire on a node's body links the node's first input (or output) that fits."""
        for item in self.workflow_scene.items(scene_pos):
            if isinstance(item, NodeItem) and item.node_id != port.node_id:
                if port.is_output:
                    fits = [p for p in item.inputs.values() if types_compatible(port.type_name, p.type_name)]
                    fits.sort(key=lambda p: (p.is_widget, p.connected))
                else:
                    fits = [p for p in item.outputs if types_compatible(p.type_name, port.type_name)]
                return fits[0] if fits else None
        return None

    def contextMenuEvent(self, event: Any) -> None:
        """Right-click: the canvas actions (copy, paste, mute, bypass, group, ...) for the selection."""
        item = self.itemAt(event.pos())
        while item is not None and not isinstance(item, NodeItem) and item.parentItem() is not None:
            item = item.parentItem()
        if isinstance(item, NodeItem) and not item.isSelected():
            self.workflow_scene.clearSelection()
            item.setSelected(True)
        menu = QMenu(self)
        menu.addActions(self.actions())
        menu.exec(event.globalPos())

    # -- keys --

    def focusNextPrevChild(self, next: bool) -> bool:
        return False  # Tab opens the node search instead of moving the focus

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() == Qt.Key.Key_Tab:
            self.search_requested.emit(self.cursor_scene_pos())
            event.accept()
            return
        if event.key() == Qt.Key.Key_Space and not event.isAutoRepeat():
            self._space_down = True
            self.viewport().setCursor(Qt.CursorShape.OpenHandCursor)
            event.accept()
            return
        super().keyPressEvent(event)

    def keyReleaseEvent(self, event: QKeyEvent) -> None:
        if event.key() == Qt.Key.Key_Space and not event.isAutoRepeat():
            self._space_down = False
            self.viewport().unsetCursor()
            event.accept()
            return
        super().keyReleaseEvent(event)

    # -- the widget editor --

    @Slot(str, str, QRectF)
    def open_editor(self, node_id: str, name: str, scene_rect: QRectF) -> None:
        scene = self.workflow_scene
        item = scene.node_items[node_id]
        spec = item.node_type.input_named(name) if item.node_type is not None else None
        if spec is None:
            return
        value = item.node.widgets.get(name, item.node_type.default_widget_values()[name])
        try:
            choices = spec.current_choices()
        except Exception as error:  # a choice list read from disk that cannot be listed now
            scene.status_message.emit(f"{name}: cannot list the choices: {error}")
            choices = [str(value)]
        if spec.kind == COMBO and str(value) not in choices:  # e.g. an alias a file holds
            choices = [str(value), *choices]
        if self.active_editor is not None:
            self.active_editor.close()
        editor = ValueEditor(spec, value, choices, self)
        editor.committed.connect(self._editor_committed)
        editor.rejected_text.connect(scene.status_message)
        editor.setProperty("node_id", node_id)
        editor.setProperty("input_name", name)
        self.active_editor = editor
        top_left = self.viewport().mapToGlobal(self.mapFromScene(scene_rect.topLeft()))
        editor.open_at(top_left, int(scene_rect.width() * self.zoom()))

    @Slot(object)
    def _editor_committed(self, value: Any) -> None:
        editor = self.active_editor
        if editor is None:
            return
        node_id, name = editor.property("node_id"), editor.property("input_name")
        self.active_editor = None
        if node_id in self.workflow_scene.node_items:
            self.workflow_scene.set_widget(node_id, name, value)

    # -- drops --

    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        if event.mimeData().hasUrls() or event.mimeData().hasFormat(NODE_TYPE_MIME):
            event.acceptProposedAction()
        else:
            super().dragEnterEvent(event)

    def dragMoveEvent(self, event: Any) -> None:
        if event.mimeData().hasUrls() or event.mimeData().hasFormat(NODE_TYPE_MIME):
            event.acceptProposedAction()
        else:
            super().dragMoveEvent(event)

    def dropEvent(self, event: QDropEvent) -> None:
        data = event.mimeData()
        if data.hasFormat(NODE_TYPE_MIME):
            type_name = bytes(data.data(NODE_TYPE_MIME)).decode()
            self.workflow_scene.add_node(type_name, self.mapToScene(event.position().toPoint()))
            event.acceptProposedAction()
            return
        paths = [url.toLocalFile() for url in data.urls() if url.isLocalFile()]
        if paths:
            self.files_dropped.emit(paths)
            event.acceptProposedAction()
            return
        super().dropEvent(event)

    # -- minimap --

    def set_minimap_visible(self, visible: bool) -> None:
        self.minimap.setVisible(visible)

    @Slot(list)
    def _scene_changed(self, regions: list) -> None:
        if self.minimap.isVisible() and not self._minimap_timer.isActive():
            self._minimap_timer.start()

    def resizeEvent(self, event: Any) -> None:
        super().resizeEvent(event)
        margin = 12
        self.minimap.setFixedSize(max(80, min(200, self.width() // 5)), max(54, min(130, self.height() // 5)))
        self.minimap.move(self.width() - self.minimap.width() - margin,
                          self.height() - self.minimap.height() - margin)
