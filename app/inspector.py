"""The inspector dock: the selected node's title, mode, widgets with proper editors (descriptions as
tooltips), its validation and run messages, and for a model-bearing node a Device box: where it computes
(a list of the devices that exist) and where its weights rest (auto, GPU, pinned RAM, disk), with the
placement the run will use (app/workflow_placement.py) and, when it cannot work, why."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Slot
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.canvas.scene import WorkflowScene
from app.canvas.widgets_paint import parse_value
from app.device_badges import ERROR_COLOR, slot_sentence
from app.gui_words import COMPUTES, COMPUTES_TIP, RESTS, RESTS_TIP, WEIGHT_HOMES, gui_message
from app.workflow_placement import placements
from engine.graph.document import MODES
from engine.graph.spec import BOOLEAN, COMBO, FLOAT, INT, SEED, SEED_CONTROLS, STRING, Input
from engine.placement import device_choices

INT32 = 2**31 - 1
DEVICE_INPUTS = {"backend": (COMPUTES, COMPUTES_TIP), "params_backend": (RESTS, RESTS_TIP)}


class Inspector(QScrollArea):
    def __init__(self, scene: WorkflowScene, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.scene = scene
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.node_id: str | None = None
        self.messages: dict[str, list[str]] = {}  # node id -> validation / run messages
        self.editors: dict[str, QWidget] = {}
        self.placement_label: QLabel | None = None  # the Device box's placement line (model nodes only)
        self._updating = False
        self._show_empty()
        scene.selectionChanged.connect(self.follow_selection)
        scene.document_changed.connect(self.refresh_values)

    def _show_empty(self) -> None:
        label = QLabel("Select a node to edit it here.")
        label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        label.setEnabled(False)
        self.setWidget(label)
        self.editors = {}

    def set_messages(self, messages: dict[str, list[str]]) -> None:
        self.messages = messages
        self.rebuild()

    @Slot()
    def follow_selection(self) -> None:
        try:
            ids = self.scene.selected_node_ids()
        except RuntimeError:  # the scene is being destroyed
            return
        node_id = ids[0] if len(ids) == 1 else None
        if node_id != self.node_id:
            self.node_id = node_id
            self.rebuild()

    def rebuild(self) -> None:
        node = self.scene.workflow.nodes.get(self.node_id) if self.node_id else None
        if node is None:
            self.node_id = None
            self._show_empty()
            return
        node_type = self.scene.lookup(node.type)
        page = QWidget()
        column = QVBoxLayout(page)
        header = QLabel(f"<b>{node_type.display_name if node_type else node.type}</b> "
                        f"<span style='color:#8d94a0'>{node.type} · id {node.id}</span>")
        header.setWordWrap(True)
        column.addWidget(header)
        if node_type is not None and node_type.description:
            description = QLabel(node_type.description)
            description.setWordWrap(True)
            description.setEnabled(False)
            column.addWidget(description)
        form = QFormLayout()
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)  # a narrow dock puts labels above
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        self.editors = {}
        self.placement_label = None
        title = QLineEdit(node.title)
        title.setPlaceholderText(node_type.display_name if node_type else node.type)
        title.editingFinished.connect(self._title_edited)
        self.editors["__title__"] = title
        form.addRow("Title", title)
        mode = QComboBox()
        mode.addItems(list(MODES))
        mode.setCurrentText(node.mode)
        mode.currentTextChanged.connect(self._mode_changed)
        self.editors["__mode__"] = mode
        form.addRow("Mode", mode)
        if node_type is not None:
            linked = set(self.scene.workflow.links_into(node.id))
            device_specs = [s for s in node_type.widget_inputs()
                            if node_type.memory_module and s.name in DEVICE_INPUTS]
            if device_specs:
                column.addWidget(self._device_box(node, node_type, device_specs, linked))
            for spec in node_type.widget_inputs():
                if spec in device_specs:
                    continue
                editor = self._editor_for(spec, node.widgets.get(spec.name,
                                                                 node_type.default_widget_values()[spec.name]))
                editor.setToolTip(spec.description or spec.name)
                editor.setEnabled(spec.name not in linked)
                self.editors[spec.name] = editor
                label = QLabel(spec.name)
                label.setToolTip(spec.description or spec.name)
                form.addRow(label, editor)
                if spec.kind == SEED:
                    control = QComboBox()
                    control.addItems(list(SEED_CONTROLS))
                    control.setCurrentText(node.seed_controls.get(spec.name, "fixed"))
                    control.currentTextChanged.connect(
                        lambda text, name=spec.name: self._seed_control(name, text))
                    self.editors[f"{spec.name}.control"] = control
                    form.addRow("control after generate", control)
        column.addLayout(form)
        for message in self.messages.get(node.id, []):
            label = QLabel(gui_message(message))
            label.setObjectName("errors")
            label.setWordWrap(True)
            label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            column.addWidget(label)
        column.addStretch(1)
        self.setWidget(page)

    def _device_box(self, node: Any, node_type: Any, specs: list[Input], linked: set[str]) -> QGroupBox:
        """Where it computes and where its weights rest, as lists, above the placement the run will use."""
        box = QGroupBox("Device")
        layout = QVBoxLayout(box)
        self.placement_label = QLabel()
        self.placement_label.setObjectName("placement")
        self.placement_label.setWordWrap(True)
        self.placement_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        form = QFormLayout()
        defaults = node_type.default_widget_values()
        for spec in specs:
            label_text, tip = DEVICE_INPUTS[spec.name]
            editor = QComboBox()
            editor.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            editor.setMinimumContentsLength(6)  # a narrow Inspector clips no text beside it
            value = str(node.widgets.get(spec.name, defaults[spec.name]))
            choices = spec.current_choices() or (list(device_choices()) if spec.name == "backend" else [])
            for choice in choices:  # an upscaler's backend is free text: it gets the list too
                editor.addItem(WEIGHT_HOMES.get(choice, choice) if spec.name == "params_backend" else choice,
                               choice)
            if editor.findData(value) < 0:  # a name that resolves (CPU, cuda:0) or one that does not
                editor.addItem(value, value)
            editor.setCurrentIndex(editor.findData(value))
            editor.activated.connect(lambda index, e=editor, name=spec.name: self._device_chosen(name, e))
            editor.setToolTip(tip)
            editor.setEnabled(spec.name not in linked)
            label = QLabel(label_text)
            label.setToolTip(tip)
            form.addRow(label, editor)
            self.editors[spec.name] = editor
        layout.addLayout(form)
        layout.addWidget(self.placement_label)
        self._show_placement()
        return box

    def _device_chosen(self, name: str, editor: QComboBox) -> None:
        if not self._updating and self.node_id is not None:
            self.scene.set_widget(self.node_id, name, editor.currentData())

    def _show_placement(self) -> None:
        """The placement the run will use, from the shared picture; in red, with why, if it cannot work."""
        if self.placement_label is None or self.node_id is None:
            return
        slots = placements.get(self.scene.workflow, self.scene.lookup).for_node(self.node_id)
        problems = [s.problem for s in slots if s.problem]
        self.placement_label.setText("\n".join(problems or [slot_sentence(s) for s in slots]))
        self.placement_label.setStyleSheet(f"color: {ERROR_COLOR};" if problems else "")

    def _editor_for(self, spec: Input, value: Any) -> QWidget:
        def commit(new_value: Any, name: str = spec.name) -> None:
            if not self._updating and self.node_id is not None:
                self.scene.set_widget(self.node_id, name, new_value)

        if spec.kind == BOOLEAN:
            editor = QCheckBox()
            editor.setChecked(bool(value))
            editor.toggled.connect(commit)
        elif spec.kind == COMBO:
            editor = QComboBox()
            editor.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            editor.setMinimumContentsLength(8)  # a long file name shows elided instead of widening the dock
            try:
                choices = spec.current_choices()
            except Exception as error:  # e.g. a models folder that cannot be listed
                choices = [str(value)]
                editor.setToolTip(f"cannot list the choices: {error}")
            if str(value) not in choices:  # e.g. an alias a file holds: shown as the file says
                choices = [str(value), *choices]
            editor.addItems(choices)
            editor.setCurrentText(str(value))
            editor.activated.connect(lambda index, e=editor: commit(e.currentText()))
        elif spec.kind == INT and (spec.min is not None and spec.max is not None
                                   and -INT32 <= spec.min and spec.max <= INT32):
            editor = QSpinBox()
            editor.setRange(int(spec.min), int(spec.max))
            editor.setSingleStep(int(spec.step or 1))
            editor.setValue(int(value))
            editor.editingFinished.connect(lambda e=editor: commit(e.value()))
        elif spec.kind == FLOAT:
            editor = QDoubleSpinBox()
            editor.setRange(spec.min if spec.min is not None else -1e12,
                            spec.max if spec.max is not None else 1e12)
            step = spec.step or 0.01
            editor.setDecimals(max(2, len(f"{step:.6f}".rstrip("0").split(".")[1])))
            editor.setSingleStep(step)
            editor.setValue(float(value))
            editor.editingFinished.connect(lambda e=editor: commit(e.value()))
        elif spec.kind == STRING and spec.multiline:
            editor = QPlainTextEdit(str(value))
            editor.setFixedHeight(90)
            editor.textChanged.connect(lambda e=editor: commit(e.toPlainText()))
        else:  # INT without 32-bit bounds, SEED, one-line STRING
            editor = QLineEdit(str(value))

            def commit_text(e: QLineEdit = editor, s: Input = spec) -> None:
                try:
                    parsed = parse_value(s, e.text())
                except ValueError as error:
                    self.scene.status_message.emit(str(error))
                    return
                problem = s.check_value(parsed)
                if problem is not None and s.kind in (INT, SEED):
                    self.scene.status_message.emit(problem)
                    return
                commit(parsed)

            editor.editingFinished.connect(commit_text)
        return editor

    @Slot()
    def refresh_values(self) -> None:
        """Show the document's values in the editors (after an undo, a canvas edit, a seed advance)."""
        node = self.scene.workflow.nodes.get(self.node_id) if self.node_id else None
        if node is None:
            if self.node_id is not None:
                self.node_id = None
                self._show_empty()
            return
        node_type = self.scene.lookup(node.type)
        self._updating = True
        try:
            for name, editor in self.editors.items():
                if editor.hasFocus():
                    continue
                if name == "__title__":
                    editor.setText(node.title)
                elif name == "__mode__":
                    editor.setCurrentText(node.mode)
                elif name.endswith(".control"):
                    editor.setCurrentText(node.seed_controls.get(name.removesuffix(".control"), "fixed"))
                elif node_type is not None:
                    self._show_value(editor, node.widgets.get(name, node_type.default_widget_values()[name]))
        finally:
            self._updating = False
        self._show_placement()

    @staticmethod
    def _show_value(editor: QWidget, value: Any) -> None:
        editor.blockSignals(True)
        if isinstance(editor, QCheckBox):
            editor.setChecked(bool(value))
        elif isinstance(editor, QComboBox):
            index = editor.findData(str(value))
            if index >= 0:  # a list whose items carry the value (the Device box's)
                editor.setCurrentIndex(index)
            else:
                editor.setCurrentText(str(value))
        elif isinstance(editor, (QSpinBox, QDoubleSpinBox)):
            editor.setValue(value)
        elif isinstance(editor, QPlainTextEdit):
            if editor.toPlainText() != str(value):
                editor.setPlainText(str(value))
        elif isinstance(editor, QLineEdit):
            editor.setText(str(value))
        editor.blockSignals(False)

    def _title_edited(self) -> None:
        if self.node_id is not None and not self._updating:
            self.scene.set_title(self.node_id, self.editors["__title__"].text())

    def _mode_changed(self, mode: str) -> None:
        if self.node_id is not None and not self._updating:
            self.scene.set_mode([self.node_id], mode)

    def _seed_control(self, name: str, control: str) -> None:
        if self.node_id is not None and not self._updating:
            if self.scene.workflow.nodes[self.node_id].seed_controls.get(name, "fixed") != control:
                self.scene.set_seed_control(self.node_id, name, control)
