"""engine.placement.resolve_node_placement: the one resolution of a loader node's placement (CLI flags > the
node's own backend / params_backend > the workflow's settings["memory"] > defaults)."""

import pytest
import torch

from engine.devices import ComputeDevice, DeviceError
from engine.graph.spec import COMBO
from engine.memory.runtime import MemoryRuntime
from engine.placement import NODE_PARAMS, PlacementError, device_choices, resolve_node_placement
from nodes.loaders import placement_inputs

DEVICES = [
    ComputeDevice("cuda0", torch.device("cuda", 0), "gpu", "NVIDIA H200"),
    ComputeDevice("cuda1", torch.device("cuda", 1), "gpu", "NVIDIA H200"),
    ComputeDevice("cpu", torch.device("cpu"), "cpu", "x86_64 CPU"),
]


@pytest.mark.parametrize(
    ("module", "workflow", "backend", "params", "overrides", "compute", "home"),
    [
        ("vae", {}, "auto", "auto", {}, ("cuda0",), None),  # auto-fit decides
        ("vae", {"auto_fit": "off"}, "auto", "auto", {}, ("cuda0",), "device"),
        ("vae", {"backend": "cuda1", "params_backend": "disk"}, "auto", "auto", {}, ("cuda1",), "disk"),
        ("vae", {"backend": "cuda1", "params_backend": "disk"}, "cpu", "device", {}, ("cpu",), "device"),
        ("vae", {}, "cpu", "cpu", {}, ("cpu",), "device"),  # RAM on a CPU is where it computes
        ("vae", {}, "cuda0", "cpu", {}, ("cuda0",), "cpu"),
        ("vae", {}, "CUDA1", "auto", {"params_backend": "disk"}, ("cuda1",), "disk"),  # a flag over the node
        ("vae", {}, "cpu", "auto", {"backend": "vae=cuda1"}, ("cuda1",), None),  # the CLI over the node
        ("te", {"backend": "te=cuda0&cuda1"}, "auto", "auto", {}, ("cuda0", "cuda1"), None),  # a layer split
    ],
)
def test_precedence_cli_over_node_over_workflow_over_defaults(module, workflow, backend, params, overrides,
                                                              compute, home):
    placed = resolve_node_placement(module, workflow, backend, params, overrides, DEVICES)
    assert placed.compute == compute and placed.params == home
    runtime = MemoryRuntime(devices=DEVICES)  # what the executor's loaders call
    runtime.overrides = dict(overrides)
    resolved = runtime.resolve_placement(module, workflow, backend, params)
    assert (resolved.devices, resolved.params) == (placed.compute, placed.params)


def test_bad_node_values_name_what_is_accepted():
    with pytest.raises(PlacementError, match="params_backend 'ram'; accepted: auto, device, cpu, disk"):
        resolve_node_placement("vae", {}, "auto", "ram", devices=DEVICES)
    with pytest.raises(DeviceError, match="unknown device 'tpu0'; available devices: cuda0, cuda1, cpu"):
        resolve_node_placement("vae", {}, "tpu0", "auto", devices=DEVICES)


def test_a_loaders_backend_is_a_list_of_the_devices_that_exist():
    backend, params = placement_inputs()
    assert backend.kind == COMBO and backend.current_choices() == list(device_choices())
    assert device_choices(DEVICES) == ("auto", "cuda0", "cuda1", "cpu")
    assert params.current_choices() == list(NODE_PARAMS)
    assert backend.check_value("CPU") is None and backend.check_value("auto") is None  # names that resolve
    assert "unknown device 'tpu3'" in backend.check_value("tpu3")
