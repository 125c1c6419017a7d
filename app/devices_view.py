"""The Devices view: each device's total, free and budgeted memory and the modules assigned to it, and the
workflow-level memory settings (reference/000 strings and the runtime switches).

Edits are validated with `engine.placement.MemorySettings`; a valid edit emits `memorySettingsChanged`
with the new `workflow.settings["memory"]` dict, a bad string shows the PlacementError message and emits
nothing. `WorkflowMemoryBinder` applies the emitted dict to a scene's workflow as an undoable command.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from PySide6.QtCore import QObject, Qt, Signal, Slot
from PySide6.QtGui import QColor, QUndoCommand
from PySide6.QtWidgets import (
    QCheckBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.device_badges import ERROR_COLOR, device_color, memory_settings
from engine.devices import GIB, ComputeDevice, DeviceError, list_devices, memory_info
from engine.placement import MemorySettings, PlacementError, max_vram_for, placement_for

DEFAULT_MODULES = ("te", "diffusion", "vae", "upscaler")
COLUMNS = ("device", "description", "total GiB", "free GiB", "budget GiB", "modules")
TEXT_FIELDS = {  # MemorySettings attribute -> (label, placeholder)
    "backend": ("--backend", "auto, or te=cpu,diffusion=cuda0"),
    "params_backend": ("--params-backend", "empty: auto-fit; cpu, disk, or vae=disk,..."),
    "max_vram": ("--max-vram", "GiB per GPU, e.g. 6 or cuda0=6,cpu=16"),
    "flash_attn": ("--flash-attn", "on, off or auto, e.g. auto,te=off"),
}
SWITCHES = {"auto_fit": "auto-fit placement", "prefetch": "prefetch the next segment",
            "segmented": "segmented compute"}
PARAMS_LABELS = {"device": "on device", "cpu": "RAM", "disk": "disk"}
MemoryInfoFn = Callable[[ComputeDevice], tuple[int, int]]


def _gib(nbytes: float | None) -> str:
    return "—" if nbytes is None else f"{nbytes / GIB:.1f}"


class DevicesView(QWidget):
    memorySettingsChanged = Signal(dict)  # the workflow's new settings["memory"]

    def __init__(
        self,
        devices: Sequence[ComputeDevice] | None = None,
        memory_info_fn: MemoryInfoFn = memory_info,
        modules: Sequence[str] = DEFAULT_MODULES,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.devices = list(list_devices() if devices is None else devices)
        self.memory_info_fn = memory_info_fn
        self.modules = tuple(modules)
        self.settings = MemorySettings()
        layout = QVBoxLayout(self)
        self.table = QTableWidget(len(self.devices), len(COLUMNS), self)
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        layout.addWidget(self.table, 1)
        form = QFormLayout()
        self.fields: dict[str, QLineEdit] = {}
        for name, (label, placeholder) in TEXT_FIELDS.items():
            edit = QLineEdit(self)
            edit.setPlaceholderText(placeholder)
            edit.editingFinished.connect(self.apply_edits)
            form.addRow(label, edit)
            self.fields[name] = edit
        self.switches: dict[str, QCheckBox] = {}
        for name, label in SWITCHES.items():
            box = QCheckBox(label, self)
            box.toggled.connect(self.apply_edits)
            form.addRow("", box)
            self.switches[name] = box
        layout.addLayout(form)
        self.error_label = QLabel(self)
        self.error_label.setWordWrap(True)
        self.error_label.setStyleSheet(f"color: {ERROR_COLOR};")
        self.error_label.setVisible(False)
        layout.addWidget(self.error_label)
        self._loading = False
        self.set_memory_settings({})

    # -- showing --

    def set_memory_settings(self, data: Mapping[str, Any] | MemorySettings) -> None:
        """Show a workflow's settings["memory"] (an unreadable one is shown as an error, defaults kept)."""
        try:
            self.settings = memory_settings(data)
            self.show_error(None)
        except PlacementError as error:
            self.settings = MemorySettings()
            self.show_error(str(error))
        self._loading = True
        for name, edit in self.fields.items():
            edit.setText(getattr(self.settings, name) or "")
        for name, box in self.switches.items():
            box.setChecked(bool(getattr(self.settings, name)))
        self.switches["auto_fit"].setEnabled(self.settings.params_backend is None)
        self._loading = False
        self.refresh_table()

    def set_modules(self, modules: Sequence[str]) -> None:
        """The modules the workflow loads (shown in the device table's modules column)."""
        self.modules = tuple(modules)
        self.refresh_table()

    def show_error(self, message: str | None) -> None:
        self.error_label.setText(message or "")
        self.error_label.setVisible(bool(message))

    def module_rows(self) -> dict[str, list[str]]:
        """Device name -> "module (weights: where)" for each module computing there."""
        rows: dict[str, list[str]] = {d.name: [] for d in self.devices}
        for module in self.modules:
            try:
                placement = placement_for(module, self.settings, self.devices)
            except (PlacementError, DeviceError) as error:
                self.show_error(str(error))
                continue
            where = PARAMS_LABELS.get(placement.params, placement.params)
            for name in placement.compute:
                rows.setdefault(name, []).append(f"{module} ({where})")
        return rows

    def refresh_table(self) -> None:
        modules = self.module_rows()
        for row, device in enumerate(self.devices):
            total, free = self.memory_info_fn(device)
            try:
                budget_gib = max_vram_for(device, self.settings.max_vram, self.devices)
            except PlacementError as error:
                self.show_error(str(error))
                budget_gib = None
            if budget_gib is None:
                budget = "none"
            elif budget_gib > 0:
                budget = f"{budget_gib:.1f}"
            else:
                budget = f"free - {-budget_gib:.1f}" if budget_gib < 0 else "free now"
            cells = (device.name, device.description, _gib(total), _gib(free), budget,
                     ", ".join(modules.get(device.name, [])) or "—")
            for column, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if column == 0:
                    item.setForeground(QColor(device_color(device.name)))
                if column in (2, 3, 4):
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(row, column, item)
        self.table.resizeColumnsToContents()

    # -- editing --

    def edited_settings(self) -> MemorySettings:
        """The settings the fields describe; raises PlacementError naming a bad string."""
        texts = {name: edit.text().strip() for name, edit in self.fields.items()}
        return replace(
            self.settings,
            backend=texts["backend"] or "auto",
            params_backend=texts["params_backend"] or None,
            max_vram=texts["max_vram"],
            flash_attn=texts["flash_attn"] or "auto",
            **{name: box.isChecked() for name, box in self.switches.items()},
        )

    @Slot()
    def apply_edits(self) -> None:
        """Validate the fields; emit the new settings dict when valid and changed, else show the error."""
        if self._loading:
            return
        try:
            settings = self.edited_settings()
            for device in self.devices:
                max_vram_for(device, settings.max_vram, self.devices)
            for module in self.modules:
                placement_for(module, settings, self.devices)
        except (PlacementError, DeviceError) as error:
            self.show_error(str(error))
            return
        self.show_error(None)
        changed = settings.to_dict() != self.settings.to_dict()
        self.settings = settings
        self.switches["auto_fit"].setEnabled(settings.params_backend is None)
        self.refresh_table()
        if changed:
            self.memorySettingsChanged.emit(settings.to_dict())


class SetMemorySettingsCommand(QUndoCommand):
    """Replace the workflow's settings["memory"] (undoable)."""

    def __init__(self, binder: WorkflowMemoryBinder, new: dict[str, str]) -> None:
        super().__init__("Change memory settings")
        self.binder = binder
        self.old = dict(binder.scene.workflow.settings.get("memory", {}))
        self.new = dict(new)

    def redo(self) -> None:
        self.binder.apply(self.new)

    def undo(self) -> None:
        self.binder.apply(self.old)


class WorkflowMemoryBinder(QObject):
    """Keeps a DevicesView and a WorkflowScene's workflow.settings["memory"] in step, edits undoable."""

    def __init__(self, scene: Any, view: DevicesView) -> None:
        super().__init__(view)
        self.scene = scene
        self.view = view
        view.memorySettingsChanged.connect(self.on_edited)
        scene.document_changed.connect(self.on_document_changed)
        self.on_document_changed()

    @Slot(dict)
    def on_edited(self, memory: dict) -> None:
        self.scene.undo_stack.push(SetMemorySettingsCommand(self, memory))

    def apply(self, memory: dict[str, str]) -> None:
        self.scene.workflow.settings["memory"] = dict(memory)
        self.scene.document_changed.emit()

    @Slot()
    def on_document_changed(self) -> None:
        workflow = self.scene.workflow
        node_modules = set()
        for node in workflow.nodes.values():
            node_type = self.scene.lookup(node.type)
            if getattr(node_type, "memory_module", None):
                node_modules.add(node_type.memory_module)
        extra = sorted(node_modules - set(DEFAULT_MODULES))
        ordered = [m for m in DEFAULT_MODULES if m in node_modules] + extra
        self.view.modules = tuple(ordered) or DEFAULT_MODULES  # no model yet: show where each would go
        self.view.set_memory_settings(workflow.settings.get("memory", {}))
