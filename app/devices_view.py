"""The Devices view: a card per device (what it is, its memory and VRAM budget, a bar of the weights planned
to stay on it) holding a chip per model of the workflow that computes there, and the workflow's memory
settings in the GUI's words (the command-line flag in each tooltip).

Every chip comes from the shared placement picture (app/workflow_placement.py), so the view says what the node
badges, the Inspector and the run say, per-node settings and the VAE included. Dragging a chip onto another
card (or onto "auto") assigns the model there: `moduleAssigned(node_id, module, device)`, which
`WorkflowMemoryBinder` turns into an undoable edit of the node's `backend` (see `assign_module`).

Edits of the settings are validated with `engine.placement.MemorySettings`; a valid edit emits
`memorySettingsChanged` with the new `workflow.settings["memory"]` dict, a bad string shows the error in the
GUI's words and emits nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from PySide6.QtCore import QMimeData, QObject, QPoint, QRectF, Qt, Signal, Slot
from PySide6.QtGui import QColor, QDrag, QPainter, QUndoCommand
from PySide6.QtWidgets import (
    QApplication,
    QCheckBox,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from app.canvas.commands import SetEntryCommand
from app.device_badges import ERROR_COLOR, device_color, memory_settings, rest_label
from app.gui_words import BUDGET, BUDGET_TIP, COMPUTES, RESTS, gui_message, home_words
from app.workflow_placement import ModuleSlot, PlacementCache, WorkflowPlacement, format_size, placements
from engine.devices import ComputeDevice, DeviceError, list_devices, memory_info
from engine.placement import (
    DEFAULT_KEYS,
    MemorySettings,
    PlacementError,
    canonical_module,
    max_vram_for,
    placement_for,
)

MODULE_MIME = "application/x-sluice-module"  # a dragged chip: {"node_id": ..., "module": ...}
AUTO = "auto"
MODULE_COLORS = {  # every kind of model the engine places (engine.placement.MODULES); the memory view's too
    "te": "#f5a623",
    "diffusion": "#4c8bf5",
    "vae": "#43a047",
    "upscaler": "#ab47bc",
    "controlnet": "#ec407a",
    "clip_vision": "#8d6e63",
    "photomaker": "#26a69a",
    "detector": "#c0ca33",
}
OTHER_COLOR = "#78909c"
CARD_BACKGROUND = "#202328"
TEXT_FIELDS = {  # MemorySettings attribute -> (label, tooltip, placeholder)
    "backend": (COMPUTES, "Where each model computes, for the whole workflow (a node's own choice wins). "
                          "Command line: --backend.", "auto, or te=cpu,diffusion=cuda0"),
    "params_backend": (RESTS, "Where weights rest, for the whole workflow (empty: auto-fit decides). "
                              "Command line: --params-backend.", "empty: auto-fit; cpu, disk, or vae=disk"),
    "max_vram": (BUDGET + " (GiB)", BUDGET_TIP, "GiB per GPU, e.g. 6, or cuda0=6,cpu=0.5"),
    "flash_attn": ("flash attention", "on, off or auto, per model e.g. auto,te=off. Command line: "
                                      "--flash-attn.", "on, off or auto"),
}
SWITCHES = {  # MemorySettings attribute -> (label, tooltip)
    "auto_fit": ("auto-fit where weights rest", "Choose from the file sizes where each model's weights rest "
                                                "(--auto-fit)."),
    "prefetch": ("copy the next part while computing", "Prefetch the next segment (not "
                                                       "--disable-prefetch)."),
    "segmented": ("run large models in parts", "Segmented compute: a model larger than its budget runs "
                                               "in segments (not --disable-segmented-compute)."),
}
MemoryInfoFn = Callable[[ComputeDevice], tuple[int, int]]


def budget_text(gib: float | None) -> str:
    """A `--max-vram` value for one device in words: 0.02 GiB (not 0.0), free now, free - 2 GiB, none."""
    if gib is None:
        return "none (free memory)"
    if gib > 0:
        return f"{gib:.3g} GiB"
    return f"free - {-gib:.3g} GiB" if gib < 0 else "free now"


class ModuleChip(QLabel):
    """One model of the workflow on its device's card; drag it onto another card to move it there."""

    def __init__(self, slot: ModuleSlot, placement: WorkflowPlacement, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.slot = slot
        self._press: QPoint | None = None
        color = ERROR_COLOR if slot.problem else MODULE_COLORS.get(slot.module, OTHER_COLOR)
        size = format_size(slot.weight_bytes) if slot.weight_bytes is not None else "size unknown"
        if not slot.compute:
            detail = "cannot be placed"
        else:
            copies = placement.copy_per_call(slot)
            detail = f"{size} · rests: {rest_label(slot.home, slot.compute)}"
            if copies:
                detail += f" · copies ≥{format_size(copies)} a step" if slot.module == "diffusion" else (
                    f" · copies ≥{format_size(copies)} a run")
        self.setText(f"<b>{slot.module}</b> <span style='color:#aab2bf'>{slot.node_title} "
                     f"#{slot.node_id}</span><br><span style='color:#c8ced8'>{detail}</span>")
        tip = [slot.problem + "\n"] if slot.problem else []
        if slot.compute:
            why = f" (auto-fit: {slot.reason})" if slot.params is None and slot.reason else ""
            tip.append(f"{slot.module} of {slot.node_title} computes on {'&'.join(slot.compute)}; weights "
                       f"rest: {home_words(slot.home, slot.compute[0])}{why}.")
        self.setToolTip("\n".join([*tip, "Drag onto another device to compute it there."]))
        self.setStyleSheet(f"QLabel {{ background: #2b2f36; border: 1px solid {color}; border-left: 5px "
                           f"solid {color}; border-radius: 4px; padding: 3px 6px; color: #e8ebf0; }}")
        self.setCursor(Qt.CursorShape.OpenHandCursor)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def mime_data(self) -> QMimeData:
        data = QMimeData()
        data.setData(MODULE_MIME, json.dumps({"node_id": self.slot.node_id,
                                              "module": self.slot.module}).encode())
        return data

    def mousePressEvent(self, event: Any) -> None:
        if event.button() == Qt.MouseButton.LeftButton:
            self._press = event.position().toPoint()
        super().mousePressEvent(event)

    def mouseMoveEvent(self, event: Any) -> None:
        if self._press is None or not event.buttons() & Qt.MouseButton.LeftButton:
            return
        if (event.position().toPoint() - self._press).manhattanLength() < QApplication.startDragDistance():
            return
        self._press = None
        drag = QDrag(self)
        drag.setMimeData(self.mime_data())
        drag.setPixmap(self.grab())
        drag.exec(Qt.DropAction.MoveAction)


class BudgetBar(QWidget):
    """The weights planned to stay on a device, stacked by model, against its VRAM budget (if it has one)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.budget: int | None = None
        self.parts: list[tuple[str, int, bool]] = []  # (module, bytes, resident)
        self.setFixedHeight(16)

    def set_parts(self, budget: int | None, parts: list[tuple[str, int, bool]]) -> None:
        self.budget, self.parts = budget, parts
        self.update()

    def paintEvent(self, event: Any) -> None:
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor("#15171a"))
        resident = sum(n for _, n, kept in self.parts if kept)
        scale = max(self.budget or 0, resident, 1)
        x = 0.0
        for module, nbytes, kept in self.parts:
            if not kept or nbytes <= 0:
                continue
            width = max(3.0, self.width() * nbytes / scale)  # a few MiB beside a GPU's GiB still shows
            painter.fillRect(QRectF(x, 2, width, self.height() - 4),
                             QColor(MODULE_COLORS.get(module, OTHER_COLOR)))
            x += width
        if self.budget:
            painter.setPen(QColor("#ffd54f"))
            right = self.width() * self.budget / scale - 1
            painter.drawLine(int(right), 0, int(right), self.height())


class DeviceCard(QFrame):
    """One device: its name, memory and budget, the planned bar, and the chips of the models computing there;
    a chip dropped here is assigned to this device."""

    def __init__(self, view: DevicesView, name: str, device: ComputeDevice | None) -> None:
        super().__init__(view)
        self.view = view
        self.name = name
        self.device = device
        self.setAcceptDrops(True)
        self.setObjectName(f"card_{name}")
        self.setMinimumWidth(230 if device is not None else 140)
        self._style(False)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 8)
        layout.setSpacing(4)
        color = device_color(name) if device is not None else "#aab2bf"
        what = device.description if device is not None else "follow the workflow's choice"
        self.title = QLabel(f"<span style='color:{color}; font-size: 11pt'><b>{name}</b></span> "
                            f"<span style='color:#aab2bf'>{what}</span>")
        self.title.setWordWrap(True)
        self.memory_label = QLabel()
        self.memory_label.setWordWrap(True)
        self.memory_label.setStyleSheet("color: #c8ced8;")
        self.bar = BudgetBar(self)
        self.bar.setVisible(device is not None)
        self.chips_box = QVBoxLayout()
        self.chips_box.setSpacing(4)
        self.empty_label = QLabel("drop a model here" if device is not None else
                                  "drop a model here to let it follow the workflow")
        self.empty_label.setStyleSheet("color: #6f7784; font-style: italic;")
        self.empty_label.setWordWrap(True)
        for widget in (self.title, self.memory_label, self.bar):
            layout.addWidget(widget)
        layout.addLayout(self.chips_box)
        layout.addWidget(self.empty_label)
        layout.addStretch(1)
        self.chips: list[ModuleChip] = []

    def _style(self, hovered: bool) -> None:
        border = "2px dashed #ffd54f" if hovered else "2px solid #3a3f47"  # dashed: a chip would drop here
        self.setStyleSheet(f"DeviceCard {{ background: {CARD_BACKGROUND}; border: {border}; "
                           f"border-radius: 6px; }}")

    def set_slots(self, slots: Sequence[ModuleSlot], placement: WorkflowPlacement) -> None:
        for chip in self.chips:
            self.chips_box.removeWidget(chip)
            chip.hide()  # at once: deleteLater waits for the event loop
            chip.deleteLater()
        self.chips = [ModuleChip(slot, placement, self) for slot in slots]
        for chip in self.chips:
            self.chips_box.addWidget(chip)
        self.empty_label.setVisible(not self.chips)
        if self.device is not None:
            self.bar.set_parts(placement.budgets.get(self.name),
                               [(s.module, s.weight_bytes or 0, s.resident) for s in slots])

    def set_memory_text(self, text: str) -> None:
        self.memory_label.setText(text)
        self.memory_label.setVisible(bool(text))

    @staticmethod
    def dragged(event: Any) -> dict[str, str] | None:
        if not event.mimeData().hasFormat(MODULE_MIME):
            return None
        try:
            data = json.loads(bytes(event.mimeData().data(MODULE_MIME)).decode())
        except ValueError:
            return None
        return data if isinstance(data, dict) and {"node_id", "module"} <= set(data) else None

    def dragEnterEvent(self, event: Any) -> None:
        if self.dragged(event) is not None:
            event.acceptProposedAction()
            self._style(True)

    def dragLeaveEvent(self, event: Any) -> None:
        self._style(False)

    def dropEvent(self, event: Any) -> None:
        self._style(False)
        data = self.dragged(event)
        if data is None:
            return
        event.acceptProposedAction()
        self.view.moduleAssigned.emit(str(data["node_id"]), str(data["module"]), self.name)


class DevicesView(QWidget):
    memorySettingsChanged = Signal(dict)  # the workflow's new settings["memory"]
    moduleAssigned = Signal(str, str, str)  # node id, module, device name or "auto": a chip was dropped

    def __init__(
        self,
        devices: Sequence[ComputeDevice] | None = None,
        memory_info_fn: MemoryInfoFn = memory_info,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.devices = list(list_devices() if devices is None else devices)
        self.memory_info_fn = memory_info_fn
        self.settings = MemorySettings()
        self.placement: WorkflowPlacement | None = None
        layout = QHBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        left = QVBoxLayout()
        hint = QLabel("Drag a model onto a device to compute it there (Ctrl+Z undoes it).")
        hint.setStyleSheet("color: #aab2bf;")
        left.addWidget(hint)
        cards_row = QHBoxLayout()
        self.cards: dict[str, DeviceCard] = {}
        for name, device in [*((d.name, d) for d in self.devices), (AUTO, None)]:
            card = DeviceCard(self, name, device)
            self.cards[name] = card
            cards_row.addWidget(card, 1 if device is not None else 0)
        left.addLayout(cards_row, 1)
        self.error_label = QLabel(self)
        self.error_label.setWordWrap(True)
        self.error_label.setStyleSheet(f"color: {ERROR_COLOR};")
        self.error_label.setVisible(False)
        self.error_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        left.addWidget(self.error_label)
        layout.addLayout(left, 3)
        form = QFormLayout()
        self.fields: dict[str, QLineEdit] = {}
        for name, (label, tip, placeholder) in TEXT_FIELDS.items():
            edit = QLineEdit(self)
            edit.setPlaceholderText(placeholder)
            edit.setToolTip(tip)
            edit.editingFinished.connect(self.apply_edits)
            caption = QLabel(label)
            caption.setToolTip(tip)
            form.addRow(caption, edit)
            self.fields[name] = edit
        self.switches: dict[str, QCheckBox] = {}
        for name, (label, tip) in SWITCHES.items():
            box = QCheckBox(label, self)
            box.setToolTip(tip)
            box.toggled.connect(self.apply_edits)
            form.addRow("", box)
            self.switches[name] = box
        settings_box = QWidget(self)
        settings_box.setLayout(form)
        settings_box.setMaximumWidth(420)
        layout.addWidget(settings_box, 2)
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
        self.refresh_cards()

    def set_placement(self, placement: WorkflowPlacement) -> None:
        """Show where the workflow's models go (each on its main compute device's card)."""
        self.placement = placement
        self.refresh_cards()

    def show_error(self, message: str | None) -> None:
        self.error_label.setText(gui_message(message or ""))
        self.error_label.setVisible(bool(message))

    def budget_gib(self, device: ComputeDevice) -> float | None:
        try:
            return max_vram_for(device, self.settings.max_vram, self.devices)
        except PlacementError as error:
            self.show_error(str(error))
            return None

    def refresh_cards(self) -> None:
        placement = self.placement
        for name, card in self.cards.items():
            if card.device is not None:
                total, free = self.memory_info_fn(card.device)
                planned = placement.resident_bytes(name) if placement is not None else 0
                card.set_memory_text(
                    f"total {format_size(total)} · free {format_size(free)}\n{BUDGET}: "
                    f"{budget_text(self.budget_gib(card.device))}"
                    + (f" · planned to stay: {format_size(planned)}" if planned else ""))
            slots = [] if placement is None else (
                placement.on_device(name) if card.device is not None else [s for s in placement.slots
                                                                           if not s.compute])
            card.set_slots(slots, placement or WorkflowPlacement((), (), {}, None))
        problems = [s.problem for s in (placement.slots if placement is not None else ()) if s.problem]
        if placement is not None and placement.error:
            problems.insert(0, placement.error)
        if problems and self.error_label.isHidden():
            self.show_error("\n".join(dict.fromkeys(problems)))

    def card(self, name: str) -> DeviceCard:
        return self.cards[name]

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
            for module in ("diffusion", "te", "vae", "upscaler"):
                placement_for(module, settings, self.devices)
        except (PlacementError, DeviceError) as error:
            self.show_error(str(error))
            return
        self.show_error(None)
        changed = settings.to_dict() != self.settings.to_dict()
        self.settings = settings
        self.switches["auto_fit"].setEnabled(settings.params_backend is None)
        self.refresh_cards()
        if changed:
            self.memorySettingsChanged.emit(settings.to_dict())


class SetMemorySettingsCommand(QUndoCommand):
    """Replace the workflow's settings["memory"] (undoable)."""

    def __init__(self, binder: WorkflowMemoryBinder, new: dict[str, str], text: str = "") -> None:
        super().__init__(text or "Change memory settings")
        self.binder = binder
        self.old = dict(binder.scene.workflow.settings.get("memory", {}))
        self.new = dict(new)

    def redo(self) -> None:
        self.binder.apply(self.new)

    def undo(self) -> None:
        self.binder.apply(self.old)


def _set_entries(backend: str, entries: Mapping[str, str | None]) -> str:
    """A `--backend` string with each of `entries`' modules set to `module=device` (None: its entries go)."""
    kept = []
    for item in (backend or "").split(","):
        key, equals, _ = item.strip().partition("=")
        if not item.strip() or (equals and key.strip().lower() not in DEFAULT_KEYS
                                and canonical_module(key) in entries):
            continue
        kept.append(item.strip())
    kept += [f"{module}={device}" for module, device in entries.items() if device is not None]
    return ",".join(kept) or AUTO


class WorkflowMemoryBinder(QObject):
    """Keeps a DevicesView and a WorkflowScene's workflow in step: settings edits and dropped chips become
    undoable edits, and every document change shows the placement again."""

    def __init__(self, scene: Any, view: DevicesView, cache: PlacementCache | None = None) -> None:
        super().__init__(view)
        self.scene = scene
        self.view = view
        self.cache = cache if cache is not None else (
            placements if [d.name for d in view.devices] == [d.name for d in list_devices()]
            else PlacementCache(devices=view.devices))
        view.memorySettingsChanged.connect(self.on_edited)
        view.moduleAssigned.connect(self.assign_module)
        scene.document_changed.connect(self.on_document_changed)
        self.on_document_changed()

    @Slot(dict)
    def on_edited(self, memory: dict) -> None:
        self.scene.undo_stack.push(SetMemorySettingsCommand(self, memory))

    def apply(self, memory: dict[str, str]) -> None:
        self.scene.workflow.settings["memory"] = dict(memory)
        self.scene.document_changed.emit()
        self.scene.update()  # node badges read the settings

    @Slot(str, str, str)
    def assign_module(self, node_id: str, module: str, device: str) -> None:
        """Compute `module` of node `node_id` on `device` ("auto": the workflow's choice), as one undo step.

        A node that loads one model (or whose models all move) gets `device` as its `backend`. For one model
        of a node that loads several (a checkpoint's VAE), the workflow's `backend` string gets a
        `module=device` entry; a node that named a device of its own keeps its other models there through
        entries of theirs, and its own `backend` goes back to auto (an entry cannot win over the node's)."""
        node = self.scene.workflow.nodes.get(node_id)
        if node is None:
            return
        slots = self.cache.get(self.scene.workflow, self.scene.lookup).for_node(node_id)
        modules = [s.module for s in slots]
        current = str(node.widgets.get("backend", AUTO))
        stack = self.scene.undo_stack
        title = f"Compute {module} of {slots[0].node_title if slots else node.type} on {device}"
        if len(set(modules) - {module}) == 0:
            if current != device:
                stack.push(_titled(SetEntryCommand(self.scene, node_id, "widgets", "backend", device), title))
            return
        memory = dict(self.scene.workflow.settings.get("memory", {}))
        entries: dict[str, str | None] = {module: None if device == AUTO else device}
        if current.strip().lower() not in ("", AUTO):
            entries.update({m: current for m in modules if m != module})
        memory["backend"] = _set_entries(MemorySettings.from_dict(memory).backend, entries)
        stack.beginMacro(title)
        stack.push(SetMemorySettingsCommand(self, memory, title))
        if current.strip().lower() not in ("", AUTO):
            stack.push(SetEntryCommand(self.scene, node_id, "widgets", "backend", AUTO))
        stack.endMacro()

    @Slot()
    def on_document_changed(self) -> None:
        workflow = self.scene.workflow
        self.view.set_memory_settings(workflow.settings.get("memory", {}))
        self.view.set_placement(self.cache.get(workflow, self.scene.lookup))


def _titled(command: QUndoCommand, text: str) -> QUndoCommand:
    command.setText(text)
    return command

