"""The main window: the canvas in the middle, docks around it (palette, inspector, queue, gallery, and
slots for other panels through `add_dock`), files with autosave and crash recovery, and `run_gui`."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

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
from app.inspector import Inspector
from app.memory_panel import TraceReplayWindow, install_memory_views
from app.panels import GalleryList, PalettePanel, QueuePanel
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
from app.shortcuts import ShortcutsDialog
from engine.graph.document import Workflow
from engine.graph.errors import WorkflowError
from engine.settings import Settings, resources_dir
from nodes.registry import NodeRegistry, default_registry

log = logging.getLogger(__name__)

AUTOSAVE_SECONDS = 30
AUTOSAVE_DEBOUNCE_MS = 1500
WORKFLOW_FILTER = "Workflows (*.json);;Images with a workflow (*.png);;All files (*)"
TRACE_FILTER = "Memory traces (*.jsonl);;All files (*)"


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
        self.resizeDocks(self._docks[:1], [230], Qt.Orientation.Horizontal)
        self.resizeDocks(self._docks[1:2], [300], Qt.Orientation.Horizontal)
        self.resizeDocks(self._docks[1:4], [420, 160, 260], Qt.Orientation.Vertical)

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
        file_menu.addSeparator()
        file_menu.addAction(self.quit_action)
        edit_menu = menus.addMenu("&Edit")
        for action in (self.undo_action, self.redo_action, None, self.copy_action, self.paste_action,
                       self.duplicate_action, self.delete_action, None, self.search_action, self.mute_action,
                       self.bypass_action, self.collapse_action, self.group_action):
            edit_menu.addSeparator() if action is None else edit_menu.addAction(action)
        self.view_menu = menus.addMenu("&View")
        self.view_menu.addAction(self.fit_action)
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
        QTimer.singleShot(0, self.view.fit_to_content)

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
        path, _ = QFileDialog.getSaveFileName(self, "Save workflow", self._last_folder(), WORKFLOW_FILTER)
        if not path:
            return False
        if not path.lower().endswith(".json"):
            path += ".json"
        return self.save_to(path)

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
        memory_dock = self.findChild(QDockWidget, "dock_memory")
        if memory_dock is not None:
            self.resizeDocks([memory_dock], [max(220, self.height() // 3)], Qt.Orientation.Vertical)

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

    def closeEvent(self, event: QCloseEvent) -> None:
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

    def open_search_at_cursor(self) -> None:
        self.scene.pending_port = None
        self.open_search(self.view.cursor_scene_pos())

    @Slot(QPointF)
    def open_search(self, scene_pos: QPointF) -> NodeSearch:
        port = self.scene.pending_port
        wanted = port.type_name if port is not None else None
        self.search = NodeSearch(self.registry.types(), self.recent_types(), self, wanted,
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
    window = MainWindow(settings)
    app.aboutToQuit.connect(window.shutdown)
    install_excepthook(window)
    window.show()
    return int(app.exec())
