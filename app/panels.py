"""Small docks: the categorised node palette, the job queue and the image gallery."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QMimeData, QPoint, QSize, Qt, QUrl, Signal, Slot
from PySide6.QtGui import QAction, QDesktopServices, QIcon, QImage, QPixmap
from PySide6.QtWidgets import (
    QApplication,
    QHBoxLayout,
    QLineEdit,
    QListView,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.canvas.view import NODE_TYPE_MIME
from engine.graph.spec import NodeType
from nodes.registry import NodeRegistry

TESTING_CATEGORY = "_for_testing"  # ComfyUI's category of experimental nodes, hidden unless asked for


def is_testing_node(node_type: type[NodeType]) -> bool:
    return node_type.category.split("/")[0] == TESTING_CATEGORY


class PaletteTree(QTreeWidget):
    """Node types by category (nested on "/"); drag an entry to the canvas or double-click it. The
    `_for_testing` category is left out unless `fill` is asked to show it."""

    add_requested = Signal(str)

    def __init__(self, registry: NodeRegistry, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.registry = registry
        self.setHeaderHidden(True)
        self.setDragEnabled(True)
        self.itemDoubleClicked.connect(self._double_clicked)
        self.fill(show_testing=False)

    def fill(self, show_testing: bool) -> None:
        self.show_testing = show_testing
        self.clear()
        folders: dict[str, QTreeWidgetItem] = {}
        for category, node_types in self.registry.categories().items():
            node_types = [t for t in node_types if show_testing or not is_testing_node(t)]
            if not node_types:
                continue
            parent_item = None
            path = ""
            for part in category.split("/"):
                path = f"{path}/{part}" if path else part
                if path not in folders:
                    folder = QTreeWidgetItem([part])
                    folder.setFlags(Qt.ItemFlag.ItemIsEnabled)
                    if parent_item is None:
                        self.addTopLevelItem(folder)
                    else:
                        parent_item.addChild(folder)
                    folders[path] = folder
                parent_item = folders[path]
            for node_type in node_types:
                leaf = QTreeWidgetItem([node_type.display_name])
                leaf.setData(0, Qt.ItemDataRole.UserRole, node_type.type_name)
                leaf.setToolTip(0, node_type.description or node_type.type_name)
                parent_item.addChild(leaf)
        self.expandAll()

    def mimeData(self, items: list[QTreeWidgetItem]) -> QMimeData:
        data = QMimeData()
        names = [i.data(0, Qt.ItemDataRole.UserRole) for i in items if i.data(0, Qt.ItemDataRole.UserRole)]
        if names:
            data.setData(NODE_TYPE_MIME, names[0].encode())
        return data

    def mimeTypes(self) -> list[str]:
        return [NODE_TYPE_MIME]

    def _double_clicked(self, item: QTreeWidgetItem, column: int) -> None:
        type_name = item.data(0, Qt.ItemDataRole.UserRole)
        if type_name:
            self.add_requested.emit(type_name)


class PalettePanel(QWidget):
    """A filter field over the palette tree."""

    def __init__(self, registry: NodeRegistry, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        self.filter = QLineEdit()
        self.filter.setPlaceholderText("Filter nodes...")
        self.tree = PaletteTree(registry)
        self.filter.textChanged.connect(self._apply_filter)
        layout.addWidget(self.filter)
        layout.addWidget(self.tree)

    def set_show_testing(self, show: bool) -> None:
        self.tree.fill(show)
        self._apply_filter(self.filter.text())

    def _apply_filter(self, text: str) -> None:
        text = text.lower()

        def visit(item: QTreeWidgetItem) -> bool:
            shown = any([visit(item.child(i)) for i in range(item.childCount())])
            if item.childCount() == 0:
                type_name = str(item.data(0, Qt.ItemDataRole.UserRole)).lower()
                shown = text in item.text(0).lower() or text in type_name
            item.setHidden(not shown)
            return shown

        for index in range(self.tree.topLevelItemCount()):
            visit(self.tree.topLevelItem(index))
        if text:
            self.tree.expandAll()


class QueuePanel(QWidget):
    """Queued and running jobs; Cancel removes a pending job or interrupts the running one."""

    cancel_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        self.jobs = QListWidget()
        buttons = QHBoxLayout()
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setToolTip("Remove the selected pending job, or interrupt it when it runs")
        self.cancel_button.clicked.connect(self._cancel_selected)
        buttons.addStretch(1)
        buttons.addWidget(self.cancel_button)
        layout.addWidget(self.jobs)
        layout.addLayout(buttons)

    def _item(self, job_id: str) -> QListWidgetItem | None:
        for row in range(self.jobs.count()):
            if self.jobs.item(row).data(Qt.ItemDataRole.UserRole) == job_id:
                return self.jobs.item(row)
        return None

    def set_job(self, job_id: str, label: str, state: str) -> None:
        """Add or update a job line: state is pending, running, finished, failed, interrupted or invalid."""
        item = self._item(job_id)
        if item is None:
            item = QListWidgetItem()
            item.setData(Qt.ItemDataRole.UserRole, job_id)
            self.jobs.insertItem(0, item)
        marks = {"pending": "…", "running": "▶", "finished": "✓", "failed": "✗", "interrupted": "■",
                 "invalid": "!", "cancelled": "–"}
        item.setText(f"{marks.get(state, '?')}  {label}  ({state})")
        item.setData(Qt.ItemDataRole.UserRole + 1, state)
        while self.jobs.count() > 50:
            self.jobs.takeItem(self.jobs.count() - 1)

    def set_job_note(self, job_id: str, text: str) -> None:
        """What a job's line says when hovered (why it failed)."""
        item = self._item(job_id)
        if item is not None:
            item.setToolTip(text)

    def state_of(self, job_id: str) -> str | None:
        item = self._item(job_id)
        return None if item is None else item.data(Qt.ItemDataRole.UserRole + 1)

    def _cancel_selected(self) -> None:
        item = self.jobs.currentItem()
        if item is not None and item.data(Qt.ItemDataRole.UserRole + 1) in ("pending", "running"):
            self.cancel_requested.emit(item.data(Qt.ItemDataRole.UserRole))


class GalleryList(QListWidget):
    """Thumbnails of the output images; drag one out as a file, right-click to copy or open its folder."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setViewMode(QListView.ViewMode.IconMode)
        self.setIconSize(QSize(112, 112))
        self.setResizeMode(QListView.ResizeMode.Adjust)
        self.setMovement(QListView.Movement.Static)
        self.setDragEnabled(True)
        self.setSpacing(4)
        self.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.customContextMenuRequested.connect(self._menu)
        self.itemDoubleClicked.connect(self._open_image)

    def add_image(self, path: str) -> bool:
        image = QImage(path)
        if image.isNull():
            return False
        thumbnail = image.scaled(224, 224, Qt.AspectRatioMode.KeepAspectRatio,
                                 Qt.TransformationMode.SmoothTransformation)
        item = QListWidgetItem(QIcon(QPixmap.fromImage(thumbnail)), Path(path).name)
        item.setData(Qt.ItemDataRole.UserRole, path)
        item.setToolTip(path)
        self.insertItem(0, item)
        return True

    def paths(self) -> list[str]:
        return [self.item(row).data(Qt.ItemDataRole.UserRole) for row in range(self.count())]

    def mimeData(self, items: list[QListWidgetItem]) -> QMimeData:
        data = QMimeData()
        data.setUrls([QUrl.fromLocalFile(i.data(Qt.ItemDataRole.UserRole)) for i in items])
        return data

    def copy_image(self, item: QListWidgetItem) -> None:
        QApplication.clipboard().setImage(QImage(item.data(Qt.ItemDataRole.UserRole)))

    @Slot(QPoint)
    def _menu(self, pos: QPoint) -> None:
        item = self.itemAt(pos)
        if item is None:
            return
        menu = QMenu(self)
        copy_action = QAction("Copy image", menu)
        copy_action.triggered.connect(lambda: self.copy_image(item))
        folder_action = QAction("Open folder", menu)
        folder = str(Path(item.data(Qt.ItemDataRole.UserRole)).parent)
        folder_action.triggered.connect(lambda: QDesktopServices.openUrl(QUrl.fromLocalFile(folder)))
        menu.addAction(copy_action)
        menu.addAction(folder_action)
        menu.exec(self.mapToGlobal(pos))

    def _open_image(self, item: QListWidgetItem) -> None:
        QDesktopServices.openUrl(QUrl.fromLocalFile(item.data(Qt.ItemDataRole.UserRole)))
