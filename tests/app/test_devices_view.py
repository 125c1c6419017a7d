import pytest
import torch
from PySide6.QtWidgets import QApplication

from app import theme
from app.canvas.scene import WorkflowScene
from app.devices_view import DevicesView, WorkflowMemoryBinder
from engine.devices import GIB, ComputeDevice
from engine.graph.document import NodeDoc
from engine.placement import MemorySettings, PlacementError, parse_max_vram, placement_for
from nodes.loaders import CLIPLoader, VAELoader

DEVICES = [
    ComputeDevice("cuda0", torch.device("cuda", 0), "gpu", "NVIDIA H200"),
    ComputeDevice("cpu", torch.device("cpu"), "cpu", "x86_64 CPU"),
]
MEMORY = {"cuda0": (140 * GIB, 120 * GIB), "cpu": (128 * GIB, 100 * GIB)}


@pytest.fixture
def view(qtbot):
    view = DevicesView(DEVICES, lambda device: MEMORY[device.name])
    qtbot.addWidget(view)
    return view


def edit(view, field, text):
    view.fields[field].setText(text)
    view.fields[field].editingFinished.emit()


def cell(view, device, column):
    row = [d.name for d in DEVICES].index(device)
    return view.table.item(row, column).text()


def test_editing_fields_emits_the_workflow_memory_settings(qtbot, view):
    with qtbot.waitSignal(view.memorySettingsChanged) as emitted:
        edit(view, "backend", "te=cpu")
    assert emitted.args[0] == MemorySettings(backend="te=cpu").to_dict()
    with qtbot.waitSignal(view.memorySettingsChanged) as emitted:
        view.switches["prefetch"].setChecked(False)
    assert emitted.args[0] == MemorySettings(backend="te=cpu", prefetch=False).to_dict()
    assert emitted.args[0]["prefetch"] == "off"
    with qtbot.waitSignal(view.memorySettingsChanged) as emitted:
        edit(view, "params_backend", "vae=disk")
    assert emitted.args[0]["params_backend"] == "vae=disk" and emitted.args[0]["auto_fit"] == "off"
    assert not view.switches["auto_fit"].isEnabled()  # a --params-backend string disables auto-fit
    assert MemorySettings.from_dict(emitted.args[0]) == view.settings


def test_a_bad_max_vram_string_shows_the_placement_error_and_emits_nothing(qtbot, view):
    with pytest.raises(PlacementError) as expected:
        parse_max_vram("6GB")
    with qtbot.assertNotEmitted(view.memorySettingsChanged):
        edit(view, "max_vram", "6GB")
    assert not view.error_label.isHidden()
    assert view.error_label.text() == str(expected.value)
    with qtbot.waitSignal(view.memorySettingsChanged):
        edit(view, "max_vram", "cuda0=6")
    assert view.error_label.isHidden()


def test_an_unknown_device_shows_the_resolution_error(qtbot, view):
    with pytest.raises(PlacementError) as expected:
        placement_for("vae", MemorySettings(backend="vae=cuda3"), DEVICES)
    with qtbot.assertNotEmitted(view.memorySettingsChanged):
        edit(view, "backend", "vae=cuda3")
    assert view.error_label.text() == str(expected.value)


def test_table_shows_memory_budgets_and_assigned_modules(view, screenshot):
    view.set_memory_settings({"backend": "te=cpu", "params_backend": "diffusion=cpu", "max_vram": "cuda0=6"})
    assert cell(view, "cuda0", 2) == "140.0" and cell(view, "cuda0", 3) == "120.0"
    assert cell(view, "cuda0", 4) == "6.0" and cell(view, "cpu", 4) == "none"
    assert cell(view, "cuda0", 5) == "diffusion (RAM), vae (on device), upscaler (on device)"
    assert cell(view, "cpu", 5) == "te (on device)"
    assert view.fields["backend"].text() == "te=cpu"
    edit(view, "max_vram", "6GB")
    theme.apply_dark_theme(QApplication.instance())
    view.resize(760, 420)
    screenshot(view, "devices_view.png")


def test_binder_applies_edits_to_the_workflow_undoably(qtbot, registry):
    registry.register_all((CLIPLoader, VAELoader), "nodes/loaders.py")
    scene = WorkflowScene(registry.get)
    scene.workflow.nodes["1"] = NodeDoc("1", "VAELoader")
    view = DevicesView(DEVICES, lambda device: MEMORY[device.name])
    qtbot.addWidget(view)
    WorkflowMemoryBinder(scene, view)
    assert view.modules == ("vae",)
    edit(view, "backend", "vae=cpu")
    assert scene.workflow.settings["memory"] == MemorySettings(backend="vae=cpu").to_dict()
    assert cell(view, "cpu", 5) == "vae (on device)"
    scene.undo_stack.undo()
    assert scene.workflow.settings["memory"] == {}
    assert view.fields["backend"].text() == "auto"
