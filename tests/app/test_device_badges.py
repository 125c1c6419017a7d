import pytest
import torch
from PySide6.QtCore import QEvent, QPointF, QRectF
from PySide6.QtGui import QColor, QImage, QPainter
from PySide6.QtWidgets import QGraphicsSceneHoverEvent

from app.canvas.node_item import TITLE_HEIGHT, _badge_font
from app.canvas.scene import WorkflowScene
from app.device_badges import CPU_COLOR, ERROR_COLOR, badge_for, device_color, node_badge
from app.inspector import Inspector
from app.session import load_workflow_file
from app.workflow_placement import PlacementCache
from engine.devices import ComputeDevice
from engine.memory.runtime import MemoryRuntime
from engine.placement import MemorySettings, PlacementError, device_choices, placement_for
from engine.settings import Settings, resources_dir
from nodes.loaders import CheckpointLoaderSimple, CLIPLoader, VAELoader
from nodes.registry import default_registry

DEVICES = [
    ComputeDevice("cuda0", torch.device("cuda", 0), "gpu", "NVIDIA H200"),
    ComputeDevice("cuda1", torch.device("cuda", 1), "gpu", "NVIDIA H200"),
    ComputeDevice("cpu", torch.device("cpu"), "cpu", "x86_64 CPU"),
]


@pytest.mark.parametrize(
    ("memory", "node_type", "text"),
    [
        ({}, CheckpointLoaderSimple, "cuda0 · auto"),  # auto-fit decides from the files
        ({"auto_fit": "off"}, CheckpointLoaderSimple, "cuda0 · GPU"),  # params on the compute device
        ({"params_backend": "te=cpu"}, CLIPLoader, "cuda0 · RAM"),
        ({"params_backend": "vae=disk"}, VAELoader, "cuda0 · disk"),
        ({"params_backend": "cuda1"}, VAELoader, "cuda0 · cuda1"),  # weights rest on another GPU
        ({"backend": "vae=cpu", "auto_fit": "off"}, VAELoader, "cpu · RAM"),
        ({"backend": "diffusion=cuda0&cuda1", "auto_fit": "off"}, CheckpointLoaderSimple,
         "cuda0&cuda1 · GPU"),
    ],
)
def test_badge_shows_compute_device_and_where_weights_rest(memory, node_type, text):
    badge = badge_for(node_type, {}, memory, DEVICES)
    placement = placement_for(node_type.memory_module, MemorySettings.from_dict(memory), DEVICES)
    assert badge.text == text and badge.error is None
    assert badge.color == device_color(placement.compute[0])
    assert "(where it computes: backend, where weights rest: params_backend)" in badge.tooltip


@pytest.mark.parametrize(
    ("memory", "widgets"),
    [
        ({}, {}),
        ({"params_backend": "disk"}, {}),
        ({"params_backend": "disk"}, {"params_backend": "device"}),
        ({"backend": "cuda1"}, {"backend": "cpu", "params_backend": "cpu"}),  # cpu RAM on a CPU: the device
        ({"backend": "vae=cuda1", "auto_fit": "off"}, {"params_backend": "auto"}),
        ({}, {"backend": "CUDA1", "params_backend": "cpu"}),
    ],
)
def test_the_badge_reads_the_placement_the_run_resolves(memory, widgets):
    runtime = MemoryRuntime(devices=DEVICES)  # the executor's path: the loader node's resolve_placement
    resolved = runtime.resolve_placement("vae", memory, widgets.get("backend", "auto"),
                                         widgets.get("params_backend", "auto"))
    badge = badge_for(VAELoader, widgets, memory, DEVICES)
    on_device = "RAM" if resolved.compute == "cpu" else "GPU"
    rest = {None: "auto", "disk": "disk", "cpu": "RAM", "device": on_device}[resolved.params]
    assert badge.text == f"{resolved.compute} · {rest}"


def test_device_colours_are_distinct_per_device():
    colours = [device_color(d.name) for d in DEVICES]
    assert len(set(colours)) == 3 and colours[2] == CPU_COLOR


def test_node_widgets_override_the_workflow_assignment_for_their_module():
    memory = {"backend": "cuda0", "params_backend": "cpu"}
    assert badge_for(VAELoader, {"backend": "cuda1", "params_backend": "disk"}, memory, DEVICES).text == (
        "cuda1 · disk")
    assert badge_for(VAELoader, {"backend": "auto"}, memory, DEVICES).text == "cuda0 · RAM"
    assert badge_for(CLIPLoader, {"backend": ""}, memory, DEVICES).text == "cuda0 · RAM"
    assert badge_for(VAELoader, {"params_backend": "device"}, memory, DEVICES).text == "cuda0 · GPU"


def test_an_invalid_assignment_gives_an_error_badge_in_the_guis_words():
    with pytest.raises(PlacementError) as expected:
        placement_for("vae", MemorySettings(backend="vae=cuda7"), DEVICES)
    badge = badge_for(VAELoader, {}, {"backend": "vae=cuda7"}, DEVICES)
    assert badge.color == ERROR_COLOR and badge.text == "⚠ cannot place"
    assert badge.error == str(expected.value).replace("--backend", "where it computes")
    assert badge.error in badge.tooltip
    assert "no such" not in badge.error and "unknown device 'cuda7'" in badge.error
    assert "unknown device 'tpu'" in badge_for(VAELoader, {"backend": "tpu"}, {}, DEVICES).error
    unknown_setting = badge_for(VAELoader, {}, {"max_vrams": "6"}, DEVICES)
    assert "unknown memory setting(s) max_vrams" in unknown_setting.error


def test_nodes_without_a_model_have_no_badge():
    class PlainNode:
        memory_module = None

    assert badge_for(PlainNode, {}, {}, DEVICES) is None


def test_a_module_name_stands_for_its_node_type():
    assert badge_for("upscaler", {"backend": "cpu"}, {"backend": "cuda1", "auto_fit": "off"},
                     DEVICES).text == "cpu · RAM"
    assert badge_for("esrgan", {}, {"backend": "upscaler=cuda1", "auto_fit": "off"}, DEVICES).text == (
        "cuda1 · GPU")


def test_the_badge_stays_legible_when_zoomed_out():
    image = QImage(10, 10, QImage.Format.Format_ARGB32)
    for zoom in (0.59, 0.8, 1.0, 2.0):
        painter = QPainter(image)
        painter.scale(zoom, zoom)
        screen_pixels = _badge_font(painter).pixelSize() * zoom
        painter.end()
        assert screen_pixels >= 10.5  # the old badge: 7.5 pt, about 6 px at the first fit's zoom of 0.59


@pytest.fixture
def embedded_scene(qtbot, tmp_path):
    """The default workflow on the embedded model, on this machine's devices."""
    settings = Settings(models_root=resources_dir() / "models", output_dir=tmp_path, plugins_dir=None)
    registry = default_registry(settings)
    workflow, _ = load_workflow_file(resources_dir() / "workflows" / "default.json", registry.get)
    scene = WorkflowScene(registry.get)
    scene.load_workflow(workflow)
    return scene


def test_a_placement_that_cannot_work_is_flagged_as_soon_as_it_is_set(embedded_scene):
    scene, cache = embedded_scene, PlacementCache()
    scene.workflow.settings["memory"] = {"max_vram": "cpu=0.02"}  # 20.5 MiB: the UNet (26 MiB) must stream
    assert node_badge(scene.workflow, scene.lookup, "1", cache).text == "cpu · RAM"  # auto-fit streams it
    scene.set_widget("1", "params_backend", "device")  # resting where it computes cannot fit: flagged
    badge = node_badge(scene.workflow, scene.lookup, "1", cache)
    assert badge.color == ERROR_COLOR and badge.text == "⚠ over budget"
    assert "do not fit the VRAM budget of cpu (20.5 MiB)" in badge.error and "--" not in badge.error
    scene.undo_stack.undo()
    assert node_badge(scene.workflow, scene.lookup, "1", cache).error is None


def test_inspector_device_box_lists_devices_and_weight_homes_and_edits_undoably(qtbot, embedded_scene):
    scene = embedded_scene
    inspector = Inspector(scene)
    qtbot.addWidget(inspector)
    scene.node_items["2"].setSelected(True)
    compute, rest = inspector.editors["backend"], inspector.editors["params_backend"]
    assert [compute.itemData(i) for i in range(compute.count())] == list(device_choices())
    assert [rest.itemText(i) for i in range(rest.count())] == [
        "auto (auto-fit chooses)", "GPU (where it computes)", "pinned RAM", "disk (re-read each use)"]
    assert "--params-backend" in rest.toolTip() and "--backend" in compute.toolTip()
    assert "te computes on cpu; weights rest: RAM (auto-fit: fits in RAM" in inspector.placement_label.text()
    rest.setCurrentIndex(3)
    rest.activated.emit(3)
    assert scene.workflow.nodes["2"].widgets["params_backend"] == "disk"
    assert "weights rest: disk" in inspector.placement_label.text()
    scene.workflow.settings["memory"] = {"max_vram": "cpu=0.001"}  # smaller than the token embedding
    scene.document_changed.emit()
    assert "smaller than the largest weight of te" in inspector.placement_label.text()
    assert "#ff4d4d" in inspector.placement_label.styleSheet()  # in red
    scene.undo_stack.undo()
    assert scene.workflow.nodes["2"].widgets.get("params_backend", "auto") == "auto"
    assert rest.currentData() == "auto"


def test_an_upscaler_loader_also_picks_its_device_from_the_list(qtbot, embedded_scene):
    scene = embedded_scene
    scene.add_node("UpscaleModelLoader", (0, 900))
    node_id = max(scene.workflow.nodes, key=int)
    inspector = Inspector(scene)
    qtbot.addWidget(inspector)
    scene.clearSelection()
    scene.node_items[node_id].setSelected(True)
    compute = inspector.editors["backend"]
    assert [compute.itemData(i) for i in range(compute.count())] == list(device_choices())
    assert "params_backend" not in inspector.editors
    compute.setCurrentIndex(compute.findData("cpu"))
    compute.activated.emit(compute.currentIndex())
    assert scene.workflow.nodes[node_id].widgets["backend"] == "cpu"


def test_the_node_on_the_canvas_is_flagged_with_the_reason_as_soon_as_the_inspector_sets_it(
        qtbot, make_default_window):
    """In the window, before any Queue: the Inspector's choice that cannot work paints the node's badge red
    and puts the reason in the node's tooltip; undo takes both back."""
    window = make_default_window(models_root=resources_dir() / "models", size=(1600, 1000))
    scene = window.scene
    scene.workflow.settings["memory"] = {"max_vram": "cpu=0.02"}  # the UNet (26 MiB) must stream on the CPU
    scene.document_changed.emit()
    item = scene.node_items["1"]
    window.view.centerOn(item)
    qtbot.wait(50)

    def red_pixels() -> int:  # in the node's title bar, where the badge is painted
        title = item.mapRectToScene(QRectF(0, 0, item.width, TITLE_HEIGHT))
        title = window.view.mapFromScene(title).boundingRect()
        image = window.view.viewport().grab(title).toImage()
        colors = (QColor(image.pixel(x, y)) for y in range(image.height()) for x in range(image.width()))
        return sum(1 for c in colors if c.red() > 200 and c.green() < 120 and c.blue() < 120)

    assert item.badge().error is None
    before = red_pixels()  # a port or wire may be red already
    scene.clearSelection()
    item.setSelected(True)
    rest = window.inspector.editors["params_backend"]
    rest.setCurrentIndex(rest.findData("device"))
    rest.activated.emit(rest.currentIndex())
    assert scene.workflow.nodes["1"].widgets["params_backend"] == "device"
    qtbot.waitUntil(lambda: red_pixels() > before + 20, timeout=2000)  # painted without a Queue
    badge = item.badge()
    assert badge.text == "⚠ over budget" and "20.5 MiB" in badge.error and "--" not in badge.error
    hover = QGraphicsSceneHoverEvent(QEvent.Type.GraphicsSceneHoverMove)
    hover.setPos(QPointF(10, 5))  # on the title: its tooltip shows
    item.hoverMoveEvent(hover)
    assert badge.tooltip in item.toolTip()
    assert not window.runs.statuses  # nothing was queued
    scene.undo_stack.undo()
    qtbot.waitUntil(lambda: red_pixels() == before, timeout=2000)
    assert item.badge().error is None
