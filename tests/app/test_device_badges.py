import pytest
import torch

from app.device_badges import CPU_COLOR, ERROR_COLOR, badge_for, device_color
from engine.devices import ComputeDevice
from engine.placement import MemorySettings, PlacementError, placement_for
from nodes.loaders import CheckpointLoaderSimple, CLIPLoader, VAELoader

DEVICES = [
    ComputeDevice("cuda0", torch.device("cuda", 0), "gpu", "NVIDIA H200"),
    ComputeDevice("cuda1", torch.device("cuda", 1), "gpu", "NVIDIA H200"),
    ComputeDevice("cpu", torch.device("cpu"), "cpu", "x86_64 CPU"),
]


@pytest.mark.parametrize(
    ("memory", "node_type", "text"),
    [
        ({}, CheckpointLoaderSimple, "cuda0 · GPU"),  # params on the compute device
        ({"params_backend": "te=cpu"}, CLIPLoader, "cuda0 · RAM"),
        ({"params_backend": "vae=disk"}, VAELoader, "cuda0 · disk"),
        ({"params_backend": "cuda1"}, VAELoader, "cuda0 · cuda1"),  # weights rest on another GPU
        ({"backend": "vae=cpu"}, VAELoader, "cpu · RAM"),
        ({"backend": "diffusion=cuda0&cuda1"}, CheckpointLoaderSimple, "cuda0&cuda1 · GPU"),
    ],
)
def test_badge_shows_compute_device_and_where_weights_rest(memory, node_type, text):
    badge = badge_for(node_type, {}, memory, DEVICES)
    placement = placement_for(node_type.memory_module, MemorySettings.from_dict(memory), DEVICES)
    assert badge.text == text and badge.error is None
    assert badge.color == device_color(placement.compute[0])
    assert f"params: {placement.params}" in badge.tooltip


def test_device_colours_are_distinct_per_device():
    colours = [device_color(d.name) for d in DEVICES]
    assert len(set(colours)) == 3 and colours[2] == CPU_COLOR


def test_node_widgets_override_the_workflow_assignment_for_their_module():
    memory = {"backend": "cuda0", "params_backend": "cpu"}
    assert badge_for(VAELoader, {"backend": "cuda1", "params_backend": "disk"}, memory, DEVICES).text == (
        "cuda1 · disk")
    assert badge_for(VAELoader, {"backend": "workflow"}, memory, DEVICES).text == "cuda0 · RAM"
    assert badge_for(CLIPLoader, {"backend": ""}, memory, DEVICES).text == "cuda0 · RAM"


def test_an_invalid_assignment_gives_an_error_badge_with_the_placement_message():
    with pytest.raises(PlacementError) as expected:
        placement_for("vae", MemorySettings(backend="vae=cuda7"), DEVICES)
    badge = badge_for(VAELoader, {}, {"backend": "vae=cuda7"}, DEVICES)
    assert badge.error == str(expected.value) and badge.color == ERROR_COLOR
    assert badge.text == "placement error" and str(expected.value) in badge.tooltip
    disk_compute = badge_for(VAELoader, {"backend": "disk"}, {}, DEVICES)
    assert "not a compute backend" in disk_compute.error
    unknown_setting = badge_for(VAELoader, {}, {"max_vrams": "6"}, DEVICES)
    assert "unknown memory setting(s) max_vrams" in unknown_setting.error


def test_nodes_without_a_model_have_no_badge():
    class PlainNode:
        memory_module = None

    assert badge_for(PlainNode, {}, {}, DEVICES) is None


def test_a_module_name_stands_for_its_node_type():
    assert badge_for("upscaler", {"backend": "cpu"}, {"backend": "cuda1"}, DEVICES).text == "cpu · RAM"
    assert badge_for("esrgan", {}, {"backend": "upscaler=cuda1"}, DEVICES).text == "cuda1 · GPU"
