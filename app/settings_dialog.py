"""The settings dialog: the models and output folders, the default memory settings and where the queue runs
(this machine or a server: app/queue_target.py), kept in the settings file (engine/settings.py, the file
`sluice run` reads too), and how the canvas behaves (the app's own QSettings)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.queue_target import QueueTarget, queue_target, set_queue_target
from engine.settings import MEMORY_KEY, Settings, default_settings_file, save_settings

LEFT_DRAG_KEY = "canvas/left_drag"  # QSettings: "pan" (ComfyUI's habit) or "select"
LEFT_DRAG_CHOICES = {"pan": "pans the canvas (Ctrl+drag selects)", "select": "selects (Ctrl+drag pans)"}
# The memory settings the dialog offers: key of settings["memory"], the GUI's words, the flag, what "" means.
MEMORY_FIELDS = (
    ("backend", "Where it computes", "--backend", "auto"),
    ("params_backend", "Where weights rest", "--params-backend", "auto (fit automatically)"),
    ("max_vram", "VRAM budget (GiB)", "--max-vram", "no budget: the free memory"),
    ("vae_tiling", "VAE tiling", "--vae-tiling", "auto"),
)
WEIGHT_HOMES = {"": "auto (fit automatically)", "device": "on the device (GPU)", "cpu": "pinned RAM",
                "disk": "disk (read per use)"}
TILING_MODES = ("", "on", "off")
QUEUE_PLACES = {"local": "this machine", "server": "a server (sluice serve or ComfyUI)"}


def left_drag_selects(app_settings: QSettings) -> bool:
    return app_settings.value(LEFT_DRAG_KEY, "pan") == "select"


def device_names() -> list[str]:
    """The compute devices that exist here (cpu, cuda0, ...)."""
    from engine.devices import list_devices

    return [device.name for device in list_devices()]


def memory_problem(memory: dict[str, Any]) -> str | None:
    """What is wrong with default memory settings, or None."""
    from engine.placement import MemorySettings, PlacementError

    try:
        MemorySettings.from_dict(memory)
    except (PlacementError, ValueError) as error:
        return str(error)
    return None


def server_url_problem(text: str | None) -> str | None:
    """What is wrong with the URL of the queue's server, or None."""
    from app.server.remote import server_url

    accepted = "accepted: http://HOST:PORT, https://HOST:PORT[/prefix] or HOST:PORT"
    if not text:
        return f"a queue on a server needs the server's URL; {accepted}"
    try:
        parts = urlsplit(server_url(text))
        parts.port  # noqa: B018 (raises ValueError for a port out of range)
    except ValueError:
        return f"the server URL {text!r} is not a URL; {accepted}"
    if not parts.hostname:
        return f"the server URL {text!r} names no host; {accepted}"
    return None


class SettingsDialog(QDialog):
    """OK writes the settings file (and changes `settings` in place, which the registry, the loaders and the
    engine worker share) and the canvas preferences."""

    def __init__(self, settings: Settings, app_settings: QSettings, parent: QWidget | None = None,
                 settings_file: Path | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.setMinimumWidth(560)
        self.settings = settings
        self.app_settings = app_settings
        self.settings_file = settings_file or default_settings_file()
        layout = QVBoxLayout(self)

        folders = QGroupBox("Folders")
        folder_form = QFormLayout(folders)
        self.models_edit = self._folder_row(folder_form, "Models folder", settings.models_root,
                                            "ComfyUI's layout: checkpoints/, diffusion_models/, vae/, "
                                            "loras/, ... (--models, SLUICE_MODELS)")
        self.output_edit = self._folder_row(folder_form, "Output folder", settings.output_dir,
                                            "where Save Image writes (--output, SLUICE_OUTPUT)")
        layout.addWidget(folders)

        memory = QGroupBox("Memory defaults (a workflow's own settings and command-line flags come first)")
        memory_form = QFormLayout(memory)
        current = settings.memory_defaults()
        self.memory_editors: dict[str, QWidget] = {}
        for key, label, flag, empty in MEMORY_FIELDS:
            editor = self._memory_editor(key, str(current.get(key, "")), empty)
            editor.setToolTip(f"{flag} on the command line; empty: {empty}")
            caption = QLabel(label)
            caption.setToolTip(editor.toolTip())
            memory_form.addRow(caption, editor)
            self.memory_editors[key] = editor
        self.memory_on_server_note = QLabel("These apply to jobs run on this machine. Jobs queued on a "
                                            "server run under the server's own settings (its --max-vram "
                                            "and placement flags).")
        self.memory_on_server_note.setWordWrap(True)
        memory_form.addRow(self.memory_on_server_note)
        layout.addWidget(memory)

        queue = QGroupBox("Queue")
        queue_form = QFormLayout(queue)
        target = queue_target(settings)
        self.queue_place = QComboBox()
        for value, text in QUEUE_PLACES.items():
            self.queue_place.addItem(text, value)
        self.queue_place.setCurrentIndex(1 if target.server else 0)
        queue_form.addRow("Jobs run on", self.queue_place)
        self.server_edit = QLineEdit(target.server or "")
        self.server_edit.setPlaceholderText("http://127.0.0.1:8188")
        self.server_edit.setToolTip("the URL of a running `sluice serve` (or ComfyUI); the server's models "
                                    "and memory settings apply, and its images are fetched into the output "
                                    "folder above")
        queue_form.addRow("Server URL", self.server_edit)
        self.token_edit = QLineEdit(target.token or "")
        self.token_edit.setEchoMode(QLineEdit.EchoMode.Password)
        self.token_edit.setPlaceholderText("none (or SLUICE_AUTH_TOKEN)")
        self.token_edit.setToolTip("the server's --auth-token, if it has one")
        queue_form.addRow("Auth token", self.token_edit)
        self.queue_place.currentIndexChanged.connect(self._show_queue_place)
        self._show_queue_place()
        layout.addWidget(queue)

        canvas = QGroupBox("Canvas")
        canvas_form = QFormLayout(canvas)
        self.left_drag = QComboBox()
        for value, text in LEFT_DRAG_CHOICES.items():
            self.left_drag.addItem(text, value)
        self.left_drag.setCurrentIndex(1 if left_drag_selects(app_settings) else 0)
        canvas_form.addRow("Left-drag on empty canvas", self.left_drag)
        layout.addWidget(canvas)

        self.problem = QLabel()
        self.problem.setObjectName("errors")
        self.problem.setWordWrap(True)
        self.problem.hide()
        layout.addWidget(self.problem)
        note = QLabel(f"Saved in {self.settings_file}")
        note.setEnabled(False)
        note.setWordWrap(True)
        layout.addWidget(note)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok
                                   | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)

    def _folder_row(self, form: QFormLayout, label: str, path: Path, tip: str) -> QLineEdit:
        edit = QLineEdit(str(path))
        edit.setToolTip(tip)
        browse = QPushButton("Browse...")
        browse.clicked.connect(lambda: self._browse(edit, label))
        row = QHBoxLayout()
        row.addWidget(edit, 1)
        row.addWidget(browse)
        form.addRow(label, row)
        return edit

    def _browse(self, edit: QLineEdit, label: str) -> None:
        folder = QFileDialog.getExistingDirectory(self, label, edit.text())
        if folder:
            edit.setText(folder)

    def _memory_editor(self, key: str, value: str, empty: str) -> QWidget:
        if key == "max_vram":
            edit = QLineEdit(value)
            edit.setPlaceholderText(empty)
            return edit
        combo = QComboBox()
        if key == "backend":
            combo.setEditable(True)  # also module assignments such as te=cpu,diffusion=cuda0
            combo.addItems(["auto", *device_names()])
            combo.setCurrentText(value or "auto")
        elif key == "params_backend":
            for home, text in WEIGHT_HOMES.items():
                combo.addItem(text, home)
            combo.setCurrentIndex(max(0, combo.findData(value)))
        else:
            for mode in TILING_MODES:
                combo.addItem(mode or "auto", mode)
            combo.setCurrentIndex(max(0, combo.findData(value)))
        return combo

    def _show_queue_place(self) -> None:
        on_server = self.queue_place.currentData() == "server"
        self.server_edit.setEnabled(on_server)
        self.token_edit.setEnabled(on_server)
        self.memory_on_server_note.setVisible(on_server)

    def queue_value(self) -> QueueTarget:
        """Where the queue runs, as entered."""
        if self.queue_place.currentData() != "server":
            return QueueTarget()
        return QueueTarget(self.server_edit.text().strip() or None, self.token_edit.text().strip() or None)

    def memory_values(self) -> dict[str, str]:
        """The default memory settings as entered (entries left at their default are not written)."""
        values: dict[str, str] = {}
        for key, editor in self.memory_editors.items():
            if isinstance(editor, QLineEdit):
                value = editor.text().strip()
            elif editor.isEditable():
                value = editor.currentText().strip()
                value = "" if value == "auto" else value
            else:
                value = str(editor.currentData() or "")
            if value:
                values[key] = value
        return values

    def accept(self) -> None:
        memory = self.memory_values()
        problem = memory_problem(memory)
        models, output = self.models_edit.text().strip(), self.output_edit.text().strip()
        if problem is None and not (models and output):
            problem = "the models and output folders must be given"
        target = self.queue_value()
        if problem is None and self.queue_place.currentData() == "server":
            problem = server_url_problem(target.server)
        if problem is not None:
            self.problem.setText(problem)
            self.problem.show()
            return
        self.settings.models_root = Path(models).expanduser()
        self.settings.output_dir = Path(output).expanduser()
        if memory:
            self.settings.extra[MEMORY_KEY] = memory
        else:
            self.settings.extra.pop(MEMORY_KEY, None)
        set_queue_target(self.settings, target)
        try:
            save_settings(self.settings, self.settings_file)
        except OSError as error:
            self.problem.setText(f"cannot write {self.settings_file}: {error}")
            self.problem.show()
            return
        self.app_settings.setValue(LEFT_DRAG_KEY, self.left_drag.currentData())
        super().accept()

