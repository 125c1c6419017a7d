"""The main window: the canvas in the middle, docks around it (palette, inspector, queue, gallery, and
slots for other panels through `add_dock`) that keep their share of the window as it resizes, files with
autosave and crash recovery, export to ComfyUI's formats, the settings dialog, and `run_gui`."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import shiboken6
from PySide6.QtCore import QPoint, QPointF, Qt, QTimer, Slot
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QDockWidget,
    QFileDialog,
    QInputDialog,
    QLabel,
    QMainWindow,
    QMenu,
    QMessageBox,
    QProgressBar,
    QWidget,
)

from app import theme
from app.canvas.clipboard import paste_json, selection_json
from app.canvas.scene import WorkflowScene
from app.canvas.view import CanvasView
from app.gui_garbage import GuiThreadGarbageCollector
from app.inspector import Inspector
from app.memory_panel import TraceReplayWindow, install_memory_views
from app.panels import GalleryList, PalettePanel, QueuePanel, is_testing_node
from app.run_controller import RunController
from app.search import RECENT_LIMIT, NodeSearch
from app.session import (
    RecoveryStore,
    add_recent_file,
    app_data_dir,
    app_settings,
    is_native_workflow_file,
    load_workflow_file,
    recent_files,
)
from app.settings_dialog import SettingsDialog, left_drag_selects
from app.shortcuts import ShortcutsDialog
from engine.graph.document import Workflow
from engine.graph.errors import WorkflowError
from engine.settings import Settings, resources_dir
from nodes.registry import NodeRegistry, default_registry

log = logging.getLogger(__name__)

AUTOSAVE_SECONDS = 30
AUTOSAVE_DEBOUNCE_MS = 1500
WORKFLOW_FILTER = "Workflows (*.json);;Images with a workflow (*.png);;All files (*)"
SAVE_FILTER = "Workflows (*.json)"  # a workflow is saved as JSON; PNGs with a workflow come from Save Image
COMFY_FILTER = "ComfyUI workflows (*.json);;All files (*)"
TRACE_FILTER = "Memory traces (*.jsonl);;All files (*)"
# The side docks' widths as the window's changes: (share of the window's width, least, most pixels).
SIDE_DOCK_SHARE = {"dock_nodes": (0.14, 180, 320), "dock_inspector": (0.2, 250, 480)}
# The bottom docks' heights (the memory and Devices views, tabbed): (share of the window's height, least, most
# pixels); the memory plots grow with the window instead of staying 100 px tall on a large screen.
BOTTOM_DOCK_SHARE = {"dock_memory": (0.33, 230, 640), "dock_devices": (0.33, 230, 640)}
RUN_REDRAW_MS = 250  # while a job runs, dock timers that fire more often slow to this interval
DOCK_DRAG_SLACK = 6  # pixels a dock may differ from the size it was given before it counts as dragged
MINIMAP_KEY = "canvas/minimap"  # QSettings: whether the canvas shows its minimap
TESTING_NODES_KEY = "palette/show_testing"  # QSettings: whether _for_testing nodes are offered


class MainWindow(QMainWindow):
    def __init__(self, settings: Settings, registry: NodeRegistry | None = None,
                 auto_restore: bool | None = None, autosave_seconds: int = AUTOSAVE_SECONDS) -> None:
        super().__init__()
        self.settings = settings
        self.registry = registry if registry is not None else default_registry(settings)
        self.app_settings = app_settings()
        self.recovery = RecoveryStore(app_data_dir(), self.app_settings)
        self.file_path: str | None = None
        self.restored_unsaved = False  # a restored recovery counts as unsaved until saved
        self._closing_done = False
        self.scene = WorkflowScene(self.registry.get, self)
        self.view = CanvasView(self.scene, self)
        self.setCentralWidget(self.view)
        self.setDockNestingEnabled(True)
        self.resize(1440, 900)
        self._build_status_bar()
        self._docks: list[QDockWidget] = []
        self._dock_shares: dict[str, float] = {}  # dock -> the share of the window the user gave it
        self._dock_sizes: dict[str, tuple[int, int]] = {}  # dock -> (width or height given, got)
        self._dock_given: dict[str, int] = {}  # dock -> the width (side) or height (bottom) last given
        self._slowed_timers: list[tuple[QTimer, int]] = []  # (timer, its own interval) while a job runs
        self.view_menu: QMenu | None = None  # docks added later (add_dock) list themselves in it
        self._build_docks()
        self.memory_panel, self.devices_view = install_memory_views(self)
        self.runs = RunController(self.scene, self.registry, settings, self.queue_panel, self.gallery,
                                  self.inspector, self.progress_bar, self.show_message, self)
        self._build_actions()
        self._connect()
        self._autosave_debounce = QTimer(self, singleShot=True, interval=AUTOSAVE_DEBOUNCE_MS)
        self._autosave_debounce.timeout.connect(self.autosave_now)
        self._autosave_timer = QTimer(self, interval=max(1, autosave_seconds) * 1000)
        self._autosave_timer.timeout.connect(self.autosave_now)
        self._autosave_timer.start()
        self._apply_preferences()
        self._restore_layout()
        if auto_restore is None and os.environ.get("SLUICE_AUTO_RESTORE"):
            auto_restore = os.environ["SLUICE_AUTO_RESTORE"] not in ("0", "")
        if not self._offer_recovery(auto_restore):
            self._open_default()
        self.update_title()
        for failure in getattr(self.registry, "plugin_failures", []):
            self.show_message(f"plugin not loaded: {failure}")

    # -- construction --

    def _build_status_bar(self) -> None:
        self.status_label = QLabel("Ready")
        self.progress_bar = QProgressBar()
        self.progress_bar.setVisible(False)
        self.progress_bar.setTextVisible(False)
        self.statusBar().addWidget(self.status_label, 1)
        self.statusBar().addPermanentWidget(self.progress_bar)

    def add_dock(self, widget: QWidget, area: Qt.DockWidgetArea, title: str) -> QDockWidget:
        """Add a panel as a dock (its object name from the title, so the layout is restored)."""
        dock = QDockWidget(title, self)
        dock.setObjectName(f"dock_{title.lower().replace(' ', '_')}")
        dock.setWidget(widget)
        self.addDockWidget(area, dock)
        if self.view_menu is not None:
            self.view_menu.addAction(dock.toggleViewAction())
        self._docks.append(dock)
        return dock

    def _build_docks(self) -> None:
        self.palette = PalettePanel(self.registry)
        self.inspector = Inspector(self.scene)
        self.queue_panel = QueuePanel()
        self.gallery = GalleryList()
        self.add_dock(self.palette, Qt.DockWidgetArea.LeftDockWidgetArea, "Nodes")
        self.add_dock(self.inspector, Qt.DockWidgetArea.RightDockWidgetArea, "Inspector")
        self.add_dock(self.queue_panel, Qt.DockWidgetArea.RightDockWidgetArea, "Queue")
        self.add_dock(self.gallery, Qt.DockWidgetArea.RightDockWidgetArea, "Gallery")
        self._size_docks(SIDE_DOCK_SHARE, self.width())
        self.resizeDocks(self._docks[1:4], [420, 160, 260], Qt.Orientation.Vertical)

    def _following_docks(self, shares: dict[str, tuple[float, int, int]]) -> list[QDockWidget]:
        """The docks of `shares` in the window, one of each group of tabs (they share one size)."""
        docks: list[QDockWidget] = []
        for dock in self._docks:
            if (dock.objectName() in shares and dock.isVisibleTo(self) and not dock.isFloating()
                    and not set(self.tabifiedDockWidgets(dock)) & set(docks)):
                docks.append(dock)
        return docks

    def _size_docks(self, shares: dict[str, tuple[float, int, int]], extent: int) -> None:
        """The docks of `shares` (SIDE_DOCK_SHARE: widths, BOTTOM_DOCK_SHARE: heights) at their share of the
        window's `extent`: the table's, or the one the user gave a dock by dragging its edge, within the
        table's bounds."""
        docks = self._following_docks(shares)
        sizes = []
        for dock in docks:
            default, least, most = shares[dock.objectName()]
            share = self._dock_shares.get(dock.objectName(), default)
            sizes.append(int(max(least, min(most, share * extent))))
        if docks:
            orientation = Qt.Orientation.Horizontal if shares is SIDE_DOCK_SHARE else Qt.Orientation.Vertical
            self.resizeDocks(docks, sizes, orientation)
            self._dock_given.update((d.objectName(), size) for d, size in zip(docks, sizes, strict=True))
            QTimer.singleShot(0, self._note_dock_sizes)  # once the layout has given them

    @Slot()
    def _note_dock_sizes(self) -> None:
        """The sizes the docks got beside those they were given (a tabbed dock's height leaves out its tab
        bar): a later difference from what they got is the user's drag."""
        for shares, horizontal in ((SIDE_DOCK_SHARE, True), (BOTTOM_DOCK_SHARE, False)):
            for dock in self._following_docks(shares):
                name = dock.objectName()
                if name in self._dock_given:
                    got = dock.width() if horizontal else dock.height()
                    self._dock_sizes[name] = (self._dock_given[name], got)

    def resizeEvent(self, event: Any) -> None:
        """Side docks grow and shrink with the window's width, bottom docks with its height (_size_docks)."""
        super().resizeEvent(event)
        for shares, old, new in ((SIDE_DOCK_SHARE, event.oldSize().width(), event.size().width()),
                                 (BOTTOM_DOCK_SHARE, event.oldSize().height(), event.size().height())):
            if old <= 0 or new <= 0 or old == new:
                continue
            for dock in self._following_docks(shares):
                given, got = self._dock_sizes.get(dock.objectName(), (0, None))
                size = dock.width() if shares is SIDE_DOCK_SHARE else dock.height()
                if got is not None and abs(size - got) > DOCK_DRAG_SLACK:  # the user dragged it
                    self._dock_shares[dock.objectName()] = (size + given - got) / old
            self._size_docks(shares, new)

    def _action(self, text: str, slot: Any, shortcut: Any = None, icon: str | None = None,
                canvas_only: bool = False) -> QAction:
        action = QAction(text, self)
        if icon is not None:
            action.setIcon(theme.make_icon(icon))
        if shortcut is not None:
            keys = shortcut if isinstance(shortcut, list) else [shortcut]
            action.setShortcuts([QKeySequence(k) for k in keys])
        if canvas_only:  # only while the canvas has the focus (Delete in a text field stays there)
            action.setShortcutContext(Qt.ShortcutContext.WidgetWithChildrenShortcut)
            self.view.addAction(action)
        action.triggered.connect(slot)
        return action

    def _build_actions(self) -> None:
        stack = self.scene.undo_stack
        self.new_action = self._action("&New", self.new_document, QKeySequence.StandardKey.New, "new")
        self.open_action = self._action("&Open...", self.open_file_dialog, QKeySequence.StandardKey.Open,
                                        "open")
        self.save_action = self._action("&Save", self.save, QKeySequence.StandardKey.Save, "save")
        self.save_as_action = self._action("Save &As...", self.save_as, "Ctrl+Shift+S")
        self.export_ui_action = self._action("ComfyUI &workflow (UI format)...", self.export_comfy_ui_dialog)
        self.export_api_action = self._action("ComfyUI &API prompt...", self.export_comfy_api_dialog)
        self.settings_action = self._action("Se&ttings...", self.show_settings, "Ctrl+,")
        self.add_note_action = self._action("Add no&te", self.add_note_at_cursor)
        self.minimap_action = self._action("&Minimap", self.set_minimap_visible)
        self.minimap_action.setCheckable(True)
        self.testing_nodes_action = self._action("Show &testing nodes (_for_testing)", self.set_show_testing)
        self.testing_nodes_action.setCheckable(True)
        self.quit_action = self._action("&Quit", self.close, QKeySequence.StandardKey.Quit)
        self.undo_action = stack.createUndoAction(self, "&Undo")
        self.undo_action.setShortcuts(QKeySequence.StandardKey.Undo)
        self.undo_action.setIcon(theme.make_icon("undo"))
        self.redo_action = stack.createRedoAction(self, "&Redo")
        self.redo_action.setShortcuts([QKeySequence("Ctrl+Shift+Z"), QKeySequence("Ctrl+Y")])
        self.redo_action.setIcon(theme.make_icon("redo"))
        self.copy_action = self._action("&Copy", self.copy_selection, "Ctrl+C", canvas_only=True)
        self.paste_action = self._action("&Paste", self.paste, "Ctrl+V", canvas_only=True)
        self.duplicate_action = self._action("&Duplicate", self.duplicate, "Ctrl+D", canvas_only=True)
        self.delete_action = self._action("De&lete", self.scene.delete_selection,
                                          [QKeySequence.StandardKey.Delete, "Backspace"], canvas_only=True)
        self.mute_action = self._action("&Mute", self.toggle_mute, "Ctrl+M", canvas_only=True)
        self.bypass_action = self._action("&Bypass", self.toggle_bypass, "Ctrl+B", canvas_only=True)
        self.collapse_action = self._action("C&ollapse", self.scene.toggle_collapse_selection, "Alt+C",
                                            canvas_only=True)
        self.group_action = self._action("&Group selection", self.group_selection, "Ctrl+G", canvas_only=True)
        self.fit_action = self._action("&Fit to view", self.view.fit_to_content, ["F", "Home"], "fit",
                                       canvas_only=True)
        self.search_action = self._action("Add &node...", self.open_search_at_cursor)
        self.queue_action = self._action("&Queue", self.queue, ["Ctrl+Return", "Ctrl+Enter"], "queue")
        self.interrupt_action = self._action("&Interrupt", self.interrupt, "Esc", "interrupt")
        self.queue_action.setToolTip("Queue the workflow (Ctrl+Enter)")
        self.interrupt_action.setToolTip("Interrupt the running job (Esc)")
        self.shortcuts_action = self._action("&Shortcuts", self.show_shortcuts, "F1")

        menus = self.menuBar()
        file_menu = menus.addMenu("&File")
        for action in (self.new_action, self.open_action):
            file_menu.addAction(action)
        self.recent_menu = file_menu.addMenu("Open &recent")
        for action in (self.save_action, self.save_as_action):
            file_menu.addAction(action)
        export_menu = file_menu.addMenu("&Export")
        export_menu.addAction(self.export_ui_action)
        export_menu.addAction(self.export_api_action)
        file_menu.addSeparator()
        file_menu.addAction(self.settings_action)
        file_menu.addSeparator()
        file_menu.addAction(self.quit_action)
        edit_menu = menus.addMenu("&Edit")
        for action in (self.undo_action, self.redo_action, None, self.copy_action, self.paste_action,
                       self.duplicate_action, self.delete_action, None, self.search_action,
                       self.add_note_action, self.mute_action, self.bypass_action, self.collapse_action,
                       self.group_action):
            edit_menu.addSeparator() if action is None else edit_menu.addAction(action)
        self.view_menu = menus.addMenu("&View")
        self.view_menu.addAction(self.fit_action)
        self.view_menu.addAction(self.minimap_action)
        self.view_menu.addAction(self.testing_nodes_action)
        self.view_menu.addSeparator()
        for dock in self._docks:
            self.view_menu.addAction(dock.toggleViewAction())
        self.view_menu.addSeparator()
        self.view_menu.addAction(self._action("Save memory &trace...", self.save_memory_trace_dialog))
        self.view_menu.addAction(self._action("&Replay memory trace...", self.replay_memory_trace_dialog))
        run_menu = menus.addMenu("&Run")
        run_menu.addAction(self.queue_action)
        run_menu.addAction(self.interrupt_action)
        help_menu = menus.addMenu("&Help")
        help_menu.addAction(self.shortcuts_action)

        toolbar = self.addToolBar("Main")
        toolbar.setObjectName("toolbar_main")
        toolbar.setMovable(False)
        for action in (self.new_action, self.open_action, self.save_action, None, self.undo_action,
                       self.redo_action, None, self.fit_action, None, self.queue_action,
                       self.interrupt_action):
            toolbar.addSeparator() if action is None else toolbar.addAction(action)
        self._fill_recent_menu()

    def _connect(self) -> None:
        stack = self.scene.undo_stack
        stack.cleanChanged.connect(self._clean_changed)
        stack.indexChanged.connect(self._document_edited)
        self.scene.status_message.connect(self.show_message)
        self.scene.title_edit_requested.connect(self._edit_title)
        self.scene.group_title_edit_requested.connect(self._edit_group_title)
        self.scene.note_edit_requested.connect(self._edit_note)
        self.runs.node_failed.connect(self._node_failed)
        self.runs.busy_changed.connect(self._slow_dock_timers)
        self.runs.target_changed.connect(self._queue_target_changed)
        self.memory_panel.set_remote_queue(self.runs.target.server)
        self.view.search_requested.connect(self.open_search)
        self.view.files_dropped.connect(self._files_dropped)
        self.palette.tree.add_requested.connect(self._palette_add)

    # -- status and title --

    @Slot(str)
    def show_message(self, text: str) -> None:
        self.status_label.setText(text)
        self.status_label.setToolTip(text)

    def is_dirty(self) -> bool:
        return self.restored_unsaved or not self.scene.undo_stack.isClean()

    def update_title(self) -> None:
        name = Path(self.file_path).name if self.file_path else "Untitled"
        self.setWindowTitle(f"{name}{'*' if self.is_dirty() else ''} — Sluice")

    def show_error_box(self, title: str, text: str, details: str = "") -> QMessageBox:
        """A non-modal error dialog: the app keeps running behind it."""
        box = QMessageBox(QMessageBox.Icon.Warning, title, text, QMessageBox.StandardButton.Ok, self)
        if details:
            box.setDetailedText(details)
        box.setModal(False)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.show()
        return box

    @Slot(bool)
    def _clean_changed(self, clean: bool) -> None:
        self.update_title()

    @Slot(int)
    def _document_edited(self, index: int) -> None:
        self.update_title()
        self._autosave_debounce.start()

    # -- files --

    def prompt_unsaved(self) -> str:
        """"save", "discard" or "cancel" for unsaved changes (tests replace this method)."""
        answer = QMessageBox.question(
            self, "Unsaved changes", "The workflow has unsaved changes. Save them first?",
            QMessageBox.StandardButton.Save | QMessageBox.StandardButton.Discard
            | QMessageBox.StandardButton.Cancel)
        return {QMessageBox.StandardButton.Save: "save",
                QMessageBox.StandardButton.Discard: "discard"}.get(answer, "cancel")

    def maybe_discard(self) -> bool:
        """True when the document may be replaced: it is saved, or the user saved or discarded it."""
        if not self.is_dirty():
            return True
        answer = self.prompt_unsaved()
        if answer == "save":
            return self.save()
        return answer == "discard"

    def set_document(self, workflow: Workflow, file_path: str | None) -> None:
        self.scene.load_workflow(workflow)
        self.scene.undo_stack.clear()
        self.scene.undo_stack.setClean()
        self.file_path = file_path
        self.restored_unsaved = False
        self.runs.node_errors = {}
        self.inspector.set_messages({})
        self.update_title()
        QTimer.singleShot(0, self._first_fit)

    @Slot()
    def _first_fit(self) -> None:
        self.view.fit_to_content(keep_readable=True)

    def new_document(self) -> None:
        if self.maybe_discard():
            self.set_document(Workflow(), None)

    @Slot()
    def save_memory_trace_dialog(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save memory trace", self._last_folder(), TRACE_FILTER)
        if path:
            self.save_memory_trace(path)

    def save_memory_trace(self, path: str) -> None:
        """Write what the memory panel has seen as a trace (JSON lines) that Replay opens again."""
        self.memory_panel.model.save_trace(path)
        self.show_message(f"memory trace saved to {path}")

    @Slot()
    def replay_memory_trace_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Replay memory trace", self._last_folder(), TRACE_FILTER)
        if path:
            self.replay_memory_trace(path)

    def replay_memory_trace(self, path: str, speed: float = 1.0) -> TraceReplayWindow | None:
        try:
            window = TraceReplayWindow(path, speed, self)
        except (OSError, ValueError) as error:  # TraceError names the file and line
            self.show_message(f"cannot replay {path}: {error}")
            return None
        window.show()
        return window

    def open_file_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open workflow", self._last_folder(), WORKFLOW_FILTER)
        if path:
            self.open_file(path)

    def open_file(self, path: str) -> bool:
        """Open a workflow JSON (Sluice or ComfyUI) or a PNG with an embedded workflow."""
        if not self.maybe_discard():
            return False
        try:
            workflow, warnings = load_workflow_file(path, self.registry.get)
        except WorkflowError as error:
            self.show_message(str(error))
            self.show_error_box("Cannot open", str(error))
            return False
        keeps_file = is_native_workflow_file(path)  # Save never overwrites an image or a ComfyUI file
        self.set_document(workflow, str(Path(path).resolve()) if keeps_file else None)
        add_recent_file(self.app_settings, path)
        self._fill_recent_menu()
        self.show_message(f"Opened {Path(path).name}" + (f" ({len(warnings)} import warnings: {warnings[0]})"
                                                         if warnings else ""))
        return True

    def save(self) -> bool:
        if self.file_path is None:
            return self.save_as()
        return self.save_to(self.file_path)

    def save_as(self) -> bool:
        path, _ = QFileDialog.getSaveFileName(self, "Save workflow", self._last_folder(), SAVE_FILTER)
        if not path:
            return False
        return self.save_to(json_path(path))

    def export_comfy_ui_dialog(self) -> None:
        self._export_dialog("comfy-ui", "Export as a ComfyUI workflow")

    def export_comfy_api_dialog(self) -> None:
        self._export_dialog("comfy-api", "Export as a ComfyUI API prompt")

    def _export_dialog(self, format_name: str, caption: str) -> None:
        stem = Path(self.file_path).stem if self.file_path else "workflow"
        suggested = str(Path(self._last_folder()) / f"{stem}_{format_name.split('-')[1]}.json")
        path, _ = QFileDialog.getSaveFileName(self, caption, suggested, COMFY_FILTER)
        if path:
            self.export_comfy(json_path(path), format_name)

    def export_comfy(self, path: str, format_name: str) -> bool:
        """Write the document as a ComfyUI UI-format workflow ("comfy-ui") or API prompt ("comfy-api")."""
        from engine.graph.comfy_export import export_text

        text = export_text(self.scene.workflow, self.registry.get, format_name)
        try:
            Path(path).write_text(text, encoding="utf-8")
        except OSError as error:
            self.show_message(f"cannot export {path}: {error}")
            return False
        self.show_message(f"Exported {Path(path).name} for ComfyUI")
        return True

    def save_to(self, path: str) -> bool:
        try:
            self.scene.workflow.save(path)
        except OSError as error:
            self.show_message(f"cannot save {path}: {error}")
            return False
        self.file_path = str(Path(path).resolve())
        self.restored_unsaved = False
        self.scene.undo_stack.setClean()
        add_recent_file(self.app_settings, path)
        self._fill_recent_menu()
        self.update_title()
        self.show_message(f"Saved {Path(path).name}")
        return True

    def _last_folder(self) -> str:
        files = recent_files(self.app_settings)
        return str(Path(files[0]).parent) if files else str(Path.home())

    def _fill_recent_menu(self) -> None:
        self.recent_menu.clear()
        for path in recent_files(self.app_settings):
            action = self.recent_menu.addAction(path)
            action.setData(path)
            action.triggered.connect(self._open_recent)
        self.recent_menu.setEnabled(not self.recent_menu.isEmpty())

    @Slot()
    def _open_recent(self) -> None:
        action = self.sender()
        if isinstance(action, QAction):
            self.open_file(action.data())

    @Slot(list)
    def _files_dropped(self, paths: list) -> None:
        self.open_file(paths[0])

    def _open_default(self) -> None:
        default = resources_dir() / "workflows" / "default.json"
        if default.is_file():
            try:
                workflow, _ = load_workflow_file(default, self.registry.get)
            except WorkflowError as error:
                self.show_message(f"default workflow not loaded: {error}")
                return
            self.set_document(workflow, None)

    # -- autosave and recovery --

    @Slot()
    def autosave_now(self) -> None:
        try:
            self.recovery.write(self.scene.workflow, self.file_path)
        except OSError as error:
            self.show_message(f"autosave failed: {error}")

    def _offer_recovery(self, auto_restore: bool | None) -> bool:
        if not self.recovery.should_offer():
            return False
        accept = auto_restore
        if accept is None:
            accept = QMessageBox.question(
                self, "Restore unsaved work?",
                "Sluice did not close cleanly last time. Restore the workflow it was editing?"
            ) == QMessageBox.StandardButton.Yes
        if not accept:
            return False
        try:
            workflow, file_path = self.recovery.read()
        except WorkflowError as error:
            try:
                kept = f"; kept as {self.recovery.set_aside()}"
            except OSError as rename_error:
                kept = f"; it could not be set aside ({rename_error})"
            log.warning("recovery not restored: %s%s", error, kept)
            self.show_message(f"Recovery not restored: {error}{kept}")
            return False
        self.set_document(workflow, file_path)
        self.restored_unsaved = True
        self.update_title()
        self.show_message("Restored the autosaved workflow")
        return True

    # -- layout --

    def _restore_layout(self) -> None:
        geometry = self.app_settings.value("window/geometry")
        state = self.app_settings.value("window/state")
        if geometry is not None:
            self.restoreGeometry(geometry)
        if state is not None:
            self.restoreState(state)
        else:  # first start: give the docked memory panel room once the window has its size
            QTimer.singleShot(0, self._size_docks_for_first_start)

    @Slot()
    def _size_docks_for_first_start(self) -> None:
        self._size_docks(BOTTOM_DOCK_SHARE, self.height())

    def _save_layout(self) -> None:
        self.app_settings.setValue("window/geometry", self.saveGeometry())
        self.app_settings.setValue("window/state", self.saveState())

    @Slot()
    def shutdown(self) -> None:
        """Stop the engine thread, keep the layout, mark a clean exit (idempotent)."""
        if self._closing_done:
            return
        self._closing_done = True
        self._autosave_timer.stop()
        self._autosave_debounce.stop()
        self.runs.shutdown()
        self._save_layout()
        self.recovery.mark_clean_exit()

    def confirm_close_during_run(self) -> bool:
        """Whether to quit although a job runs or waits (tests replace this method)."""
        waiting = len(self.runs.worker.queue.pending())
        more = f" and {waiting} more wait{'s' if waiting == 1 else ''} in the queue" if waiting else ""
        answer = QMessageBox.question(
            self, "A job is running",
            f"A job is running{more}. Quit anyway? The running job is interrupted and the queue is dropped.",
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No, QMessageBox.StandardButton.No)
        return answer == QMessageBox.StandardButton.Yes

    def closeEvent(self, event: QCloseEvent) -> None:
        if not self._closing_done and self.runs.busy() and not self.confirm_close_during_run():
            event.ignore()
            return
        if not self._closing_done and not self.maybe_discard():
            event.ignore()
            return
        self.shutdown()
        event.accept()

    # -- editing --

    def copy_selection(self) -> None:
        text = selection_json(self.scene)
        if text is not None:
            QApplication.clipboard().setText(text)

    def paste(self) -> None:
        text = QApplication.clipboard().text()
        try:
            paste_json(self.scene, text, self.view.cursor_scene_pos())
        except WorkflowError as error:
            self.show_message(f"nothing to paste: {error}")

    def duplicate(self) -> None:
        text = selection_json(self.scene)
        if text is not None:
            ids = self.scene.selected_node_ids()
            corner = min((self.scene.workflow.nodes[n].pos for n in ids), default=(0.0, 0.0))
            paste_json(self.scene, text, QPointF(corner[0] + 30, corner[1] + 30))

    def toggle_mute(self) -> None:
        self.scene.toggle_mode("muted")

    def toggle_bypass(self) -> None:
        self.scene.toggle_mode("bypassed")

    def group_selection(self) -> None:
        self.scene.create_group()

    @Slot(str)
    def _edit_title(self, node_id: str) -> None:
        node = self.scene.workflow.nodes[node_id]
        title, ok = QInputDialog.getText(self, "Rename node", "Title:", text=node.title)
        if ok:
            self.scene.set_title(node_id, title)

    @Slot(str)
    def _edit_group_title(self, group_id: str) -> None:
        group = self.scene.group_by_id(group_id)
        title, ok = QInputDialog.getText(self, "Rename group", "Title:", text=group.title)
        if ok and title != group.title:
            self.scene.set_group_title(group_id, title)

    # -- node search --

    def recent_types(self) -> list[str]:
        value = self.app_settings.value("search/recent", [])
        return [str(v) for v in ([value] if isinstance(value, str) else (value or []))]

    def _remember_type(self, type_name: str) -> None:
        recent = [type_name] + [t for t in self.recent_types() if t != type_name]
        self.app_settings.setValue("search/recent", recent[:RECENT_LIMIT])

    def visible_node_types(self) -> list:
        """The node types the palette and the search offer (_for_testing ones only when asked for)."""
        show_testing = self.testing_nodes_action.isChecked()
        return [t for t in self.registry.types() if show_testing or not is_testing_node(t)]

    def open_search_at_cursor(self) -> None:
        self.scene.pending_port = None
        self.open_search(self.view.cursor_scene_pos())

    @Slot(QPointF)
    def open_search(self, scene_pos: QPointF) -> NodeSearch:
        port = self.scene.pending_port
        wanted = port.type_name if port is not None else None
        self.search = NodeSearch(self.visible_node_types(), self.recent_types(), self, wanted,
                                 needs_input=port.is_output if port is not None else True)
        self._search_pos = scene_pos
        self.search.chosen.connect(self._search_chosen)
        where = self.view.viewport().mapToGlobal(self.view.mapFromScene(scene_pos))
        self.search.open_at(where + QPoint(4, 4))
        return self.search

    @Slot(str)
    def _search_chosen(self, type_name: str) -> None:
        port, self.scene.pending_port = self.scene.pending_port, None
        if port is not None and port.scene() is self.scene:
            self.scene.add_node_connected(type_name, self._search_pos, port)
        else:
            self.scene.add_node(type_name, self._search_pos)
        self._remember_type(type_name)

    @Slot(str)
    def _palette_add(self, type_name: str) -> None:
        self.scene.add_node(type_name, self.view.mapToScene(self.view.viewport().rect().center()))
        self._remember_type(type_name)

    # -- running --

    def queue(self) -> str | None:
        return self.runs.queue_workflow()

    def interrupt(self) -> None:
        self.runs.interrupt()

    def show_shortcuts(self) -> None:
        ShortcutsDialog(self).exec()

    @Slot(bool)
    def _slow_dock_timers(self, busy: bool) -> None:
        """While a job runs, timers in the docks that redraw more often than every RUN_REDRAW_MS (the memory
        panel's) slow to it: on a small machine the GUI thread's painting is taken from the engine's compute
        (app/worker.py), and a panel redraw costs tens of milliseconds. Their intervals come back after."""
        for timer, interval in self._slowed_timers:
            if shiboken6.isValid(timer):
                timer.setInterval(interval)
        self._slowed_timers = []
        if busy:
            for dock in self._docks:
                for timer in dock.findChildren(QTimer):
                    if timer.isActive() and 0 < timer.interval() < RUN_REDRAW_MS:
                        self._slowed_timers.append((timer, timer.interval()))
                        timer.setInterval(RUN_REDRAW_MS)

    @Slot(str, str, str)
    def _node_failed(self, title: str, message: str, details: str) -> None:
        self.failure_box = self.show_error_box(f"{title} failed", f"{title} failed:\n{message}", details)

    # -- notes --

    def add_note_at_cursor(self) -> str:
        return self.scene.add_note(self.view.cursor_scene_pos())

    @Slot(str)
    def _edit_note(self, note_id: str) -> None:
        note = next((n for n in self.scene.notes() if str(n.get("id")) == note_id), None)
        if note is None:
            return
        text, ok = QInputDialog.getMultiLineText(self, "Edit note", "Text:", str(note.get("text", "")))
        if ok:
            self.scene.set_note_text(note_id, text)

    # -- preferences --

    def show_settings(self) -> SettingsDialog:
        dialog = SettingsDialog(self.settings, self.app_settings, self)
        dialog.accepted.connect(self._settings_changed)
        dialog.open()
        return dialog

    @Slot()
    def _settings_changed(self) -> None:
        self._apply_preferences()
        self.scene.update()  # model choices may list another folder now
        self.show_message(f"Settings saved; models from {self.settings.models_root}")
        self.runs.apply_queue_target()

    @Slot()
    def _queue_target_changed(self) -> None:
        self.memory_panel.set_remote_queue(self.runs.target.server)
        self.show_message(f"Jobs run on {self.runs.target.describe()}")

    def _apply_preferences(self) -> None:
        self.view.left_drag_selects = left_drag_selects(self.app_settings)
        minimap = self.app_settings.value(MINIMAP_KEY, True) not in (False, "false", "0")
        self.minimap_action.setChecked(minimap)
        self.view.set_minimap_visible(minimap)
        testing = self.app_settings.value(TESTING_NODES_KEY, False) in (True, "true", "1")
        self.testing_nodes_action.setChecked(testing)
        if testing != self.palette.tree.show_testing:
            self.palette.set_show_testing(testing)

    @Slot(bool)
    def set_minimap_visible(self, visible: bool) -> None:
        self.view.set_minimap_visible(visible)
        self.app_settings.setValue(MINIMAP_KEY, visible)

    @Slot(bool)
    def set_show_testing(self, show: bool) -> None:
        self.palette.set_show_testing(show)
        self.app_settings.setValue(TESTING_NODES_KEY, show)


def json_path(path: str) -> str:
    """`path` ending in .json: a name typed with another image or no extension gets .json instead of a second
    extension (Save As never writes "name.png.json")."""
    chosen = Path(path)
    if chosen.suffix.lower() == ".json":
        return path
    if chosen.suffix.lower() == ".png":
        return str(chosen.with_suffix(".json"))
    return path + ".json"


def install_excepthook(window: MainWindow) -> None:
    """GUI-thread exceptions go to the status bar and a dialog instead of ending the app."""

    def hook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        text = "".join(traceback.format_exception(kind, error, trace))
        print(text, file=sys.stderr)
        window.show_message(f"Internal error: {kind.__name__}: {error}")
        window.show_error_box("Internal error", f"{kind.__name__}: {error}", text)

    sys.excepthook = hook


def run_gui(settings: Settings) -> int:
    """Open the desktop app (creating the QApplication if none exists) and run it until it closes."""
    app = QApplication.instance() or QApplication(sys.argv)
    app.setApplicationName("Sluice")
    app.setOrganizationName("Sluice")
    theme.apply_dark_theme(app)
    collector = GuiThreadGarbageCollector(app)  # Qt objects in cycles must not die on the engine thread
    collector.start()
    window = MainWindow(settings)
    app.aboutToQuit.connect(window.shutdown)
    app.aboutToQuit.connect(collector.stop)
    install_excepthook(window)
    window.show()
    return int(app.exec())
