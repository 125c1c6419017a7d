import pytest
import torch
from PySide6.QtCore import QPointF, Qt
from PySide6.QtGui import QColor, QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import QApplication

from app import memory_panel, theme
from app.canvas.scene import WorkflowScene
from app.device_badges import ERROR_COLOR
from app.devices_view import MODULE_COLORS, OTHER_COLOR, DevicesView, WorkflowMemoryBinder
from app.gui_words import gui_message
from app.memory_model import MemoryModel
from app.memory_panel import WORKSPACE_COLOR
from app.session import load_workflow_file
from app.workflow_placement import PlacementCache
from engine.devices import GIB, ComputeDevice
from engine.graph.document import NodeDoc
from engine.placement import MODULES, MemorySettings, PlacementError, parse_max_vram, placement_for
from engine.settings import Settings, resources_dir
from engine.telemetry import Event
from nodes.loaders import CLIPLoader, VAELoader
from nodes.registry import default_registry

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


@pytest.fixture
def default_scene(tmp_path):
    """The default workflow (the embedded model's files are read for sizes) with its checkpoint on the CPU
    and a budget for the (pretend) GPU, so that planning never asks torch about it."""
    settings = Settings(models_root=resources_dir() / "models", output_dir=tmp_path, plugins_dir=None)
    registry = default_registry(settings)
    workflow, _ = load_workflow_file(resources_dir() / "workflows" / "default.json", registry.get)
    workflow.settings["memory"] = {"max_vram": "cuda0=6"}
    workflow.nodes["1"].widgets["backend"] = "cpu"
    scene = WorkflowScene(registry.get)
    scene.load_workflow(workflow)
    return scene


def edit(view, field, text):
    view.fields[field].setText(text)
    view.fields[field].editingFinished.emit()


def chips(view, device):
    return {(chip.slot.node_id, chip.slot.module): chip for chip in view.card(device).chips}


def drop(card, chip):
    """A chip dragged onto a card, as Qt delivers it: drag enter, then drop."""
    mime = chip.mime_data()
    point = QPointF(card.rect().center())
    enter = QDragEnterEvent(point.toPoint(), Qt.DropAction.MoveAction, mime, Qt.MouseButton.LeftButton,
                            Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(card, enter)
    assert enter.isAccepted()
    QApplication.sendEvent(card, QDropEvent(point, Qt.DropAction.MoveAction, mime, Qt.MouseButton.LeftButton,
                                            Qt.KeyboardModifier.NoModifier))


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


def test_a_bad_budget_string_shows_the_error_in_the_guis_words_and_emits_nothing(qtbot, view):
    with pytest.raises(PlacementError) as expected:
        parse_max_vram("6GB")
    with qtbot.assertNotEmitted(view.memorySettingsChanged):
        edit(view, "max_vram", "6GB")
    assert not view.error_label.isHidden()
    assert view.error_label.text() == gui_message(str(expected.value))
    assert "--max-vram" not in view.error_label.text() and "VRAM budget" in view.error_label.text()
    with qtbot.waitSignal(view.memorySettingsChanged):
        edit(view, "max_vram", "cuda0=6")
    assert view.error_label.isHidden()


def test_an_unknown_device_shows_the_resolution_error(qtbot, view):
    with pytest.raises(PlacementError) as expected:
        placement_for("vae", MemorySettings(backend="vae=cuda3"), DEVICES)
    with qtbot.assertNotEmitted(view.memorySettingsChanged):
        edit(view, "backend", "vae=cuda3")
    assert view.error_label.text() == gui_message(str(expected.value))
    assert "unknown device 'cuda3'" in view.error_label.text()


def test_labels_are_the_guis_words_with_the_flag_in_the_tooltip(view):
    form = view.fields["max_vram"].parentWidget().layout()
    labels = {form.labelForField(edit).text(): name for name, edit in view.fields.items()}
    assert labels == {"where it computes": "backend", "where weights rest": "params_backend",
                      "VRAM budget (GiB)": "max_vram", "flash attention": "flash_attn"}
    assert "--max-vram" in view.fields["max_vram"].toolTip()
    assert "--params-backend" in view.fields["params_backend"].toolTip()


def test_small_budgets_print_in_full(view):
    view.set_memory_settings({"max_vram": "cpu=0.02,cuda0=6"})
    assert "VRAM budget: 0.02 GiB" in view.card("cpu").memory_label.text()
    assert "VRAM budget: 6 GiB" in view.card("cuda0").memory_label.text()
    view.set_memory_settings({"max_vram": "-2"})
    assert "VRAM budget: free - 2 GiB" in view.card("cuda0").memory_label.text()
    assert "VRAM budget: none" in view.card("cpu").memory_label.text()


def test_cards_honour_the_nodes_own_settings_and_show_the_vae(qtbot, default_scene):
    view = DevicesView(DEVICES, lambda device: MEMORY[device.name])
    qtbot.addWidget(view)
    WorkflowMemoryBinder(default_scene, view, PlacementCache(devices=DEVICES))
    default_scene.set_widget("1", "params_backend", "disk")
    cpu, gpu = chips(view, "cpu"), chips(view, "cuda0")
    assert set(cpu) == {("1", "diffusion"), ("1", "vae")}  # the checkpoint's own backend: cpu
    assert set(gpu) == {("2", "te")}  # auto: the workflow's default device
    assert "rests: disk" in cpu[("1", "vae")].text() and "MiB" in cpu[("1", "vae")].text()
    assert "rests: GPU" in gpu[("2", "te")].text()  # auto-fit: it fits on the GPU


def test_dragging_a_model_onto_a_device_sets_the_nodes_device_undoably(qtbot, default_scene, screenshot):
    view = DevicesView(DEVICES, lambda device: MEMORY[device.name])
    qtbot.addWidget(view)
    cache = PlacementCache(devices=DEVICES)
    WorkflowMemoryBinder(default_scene, view, cache)
    workflow, stack = default_scene.workflow, default_scene.undo_stack
    drop(view.card("cpu"), chips(view, "cuda0")[("2", "te")])  # a node with one model: its backend
    assert workflow.nodes["2"].widgets["backend"] == "cpu"
    assert ("2", "te") in chips(view, "cpu") and not chips(view, "cuda0")
    assert stack.undoText() == "Compute te of Load CLIP on cpu"

    drop(view.card("cuda0"), chips(view, "cpu")[("1", "vae")])  # one model of a checkpoint
    assert workflow.nodes["1"].widgets["backend"] == "auto"
    assert MemorySettings.from_dict(workflow.settings["memory"]).backend == "auto,vae=cuda0,diffusion=cpu"
    slots = {s.module: s.compute for s in cache.get(workflow, default_scene.lookup).for_node("1")}
    assert slots == {"diffusion": ("cpu",), "vae": ("cuda0",)}
    assert set(chips(view, "cuda0")) == {("1", "vae")}
    theme.apply_dark_theme(QApplication.instance())
    view.resize(1100, 330)
    view.show()
    qtbot.waitExposed(view)
    screenshot(view, "devices_view_after_drag.png")

    stack.undo()  # one step puts the checkpoint back on the CPU as a whole
    assert workflow.nodes["1"].widgets["backend"] == "cpu"
    assert workflow.settings["memory"] == {"max_vram": "cuda0=6"}
    stack.undo()
    assert workflow.nodes["2"].widgets.get("backend", "auto") == "auto"
    assert ("2", "te") in chips(view, "cuda0")


def test_dropping_on_auto_gives_the_model_back_to_the_workflows_choice(qtbot, default_scene):
    view = DevicesView(DEVICES, lambda device: MEMORY[device.name])
    qtbot.addWidget(view)
    WorkflowMemoryBinder(default_scene, view, PlacementCache(devices=DEVICES))
    drop(view.card("auto"), chips(view, "cpu")[("1", "diffusion")])
    assert default_scene.workflow.nodes["1"].widgets["backend"] == "auto"
    assert MemorySettings.from_dict(default_scene.workflow.settings["memory"]).backend == "auto,vae=cpu"
    assert set(chips(view, "cuda0")) == {("1", "diffusion"), ("2", "te")}  # auto: the first GPU
    assert set(chips(view, "cpu")) == {("1", "vae")}  # the checkpoint's other model stays where it was


def test_binder_applies_edits_to_the_workflow_undoably(qtbot, registry):
    registry.register_all((CLIPLoader, VAELoader), "nodes/loaders.py")
    scene = WorkflowScene(registry.get)
    scene.workflow.nodes["1"] = NodeDoc("1", "VAELoader")
    view = DevicesView(DEVICES, lambda device: MEMORY[device.name])
    qtbot.addWidget(view)
    WorkflowMemoryBinder(scene, view, PlacementCache(devices=DEVICES))
    edit(view, "backend", "vae=cpu")
    assert scene.workflow.settings["memory"] == MemorySettings(backend="vae=cpu").to_dict()
    assert [c.slot.module for c in view.card("cpu").chips] == ["vae"]
    scene.undo_stack.undo()
    assert scene.workflow.settings["memory"] == {}
    assert view.fields["backend"].text() == "auto"
    assert [c.slot.module for c in view.card("cuda0").chips] == ["vae"]


def test_every_kind_of_model_the_engine_places_has_a_colour_of_its_own():
    assert set(MODULE_COLORS) == set(MODULES)
    reserved = {OTHER_COLOR, ERROR_COLOR, WORKSPACE_COLOR}  # "another model", "cannot work", workspace
    colours = [QColor(c).name() for c in MODULE_COLORS.values()]
    assert len(set(colours)) == len(colours) and not set(colours) & {QColor(c).name() for c in reserved}
    assert memory_panel.MODULE_COLORS is MODULE_COLORS  # the memory view stacks them in the same colours
    model = MemoryModel()
    for when, module in enumerate(("controlnet", "zeta", "te#2", "diffusion", "te", "clip_vision")):
        model.handle(Event("ledger", when, {"device": "cpu", "module": module, "allocation": "weights",
                                            "key": module, "delta": 10, "tracked": 10 * (when + 1)}))
    stacked = list(model.snapshot()["devices"]["cpu"]["series"]["weights"])
    assert stacked == ["te", "clip_vision", "diffusion", "controlnet", "zeta"]  # bottom to top
