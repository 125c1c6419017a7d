import psutil
import pytest
import torch

from engine.devices import (
    ComputeDevice,
    DeviceError,
    format_devices,
    list_devices,
    memory_info,
    resolve_device,
)

CUDA0 = ComputeDevice("cuda0", torch.device("cuda", 0), "gpu", "fake GPU 0")
CUDA1 = ComputeDevice("cuda1", torch.device("cuda", 1), "gpu", "fake GPU 1")
MPS = ComputeDevice("mps", torch.device("mps"), "igpu", "fake unified GPU")
CPU = ComputeDevice("cpu", torch.device("cpu"), "cpu", "fake CPU")
TWO_GPUS = [CUDA0, CUDA1, CPU]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("cuda1", "cuda1"),
        ("CUDA1", "cuda1"),
        ("Cpu", "cpu"),
        ("cp", "cpu"),
        ("cuda:1", "cuda1"),
        (" cuda0 ", "cuda0"),
    ],
)
def test_exact_and_unique_prefix_names_resolve_case_insensitively(name, expected):
    assert resolve_device(name, TWO_GPUS).name == expected


def test_unique_prefix_of_the_only_gpu_resolves():
    assert resolve_device("cu", [CUDA0, CPU]).name == "cuda0"


def test_ambiguous_prefix_lists_the_candidates():
    with pytest.raises(DeviceError, match=r"ambiguous device name 'cu'.*cuda0, cuda1"):
        resolve_device("cu", TWO_GPUS)


def test_unknown_name_lists_available_devices():
    with pytest.raises(DeviceError, match=r"unknown device 'vulkan0'; available devices: cuda0, cuda1, cpu"):
        resolve_device("vulkan0", TWO_GPUS)


@pytest.mark.parametrize("name", ["auto", "default", "", "AUTO"])
def test_default_prefers_gpu_then_integrated_then_cpu(name):
    assert resolve_device(name, TWO_GPUS).name == "cuda0"
    assert resolve_device(name, [MPS, CPU]).name == "mps"
    assert resolve_device(name, [CPU]).name == "cpu"


def test_gpu_selects_first_gpu_falling_back_to_integrated():
    assert resolve_device("gpu", [CPU, CUDA1, CUDA0]).name == "cuda1"
    assert resolve_device("GPU", [MPS, CPU]).name == "mps"


def test_gpu_without_any_gpu_names_the_available_devices():
    with pytest.raises(DeviceError, match=r"no GPU device for 'gpu'; available devices: cpu"):
        resolve_device("gpu", [CPU])


def test_this_machine_lists_cpu_last():
    devices = list_devices()
    assert devices[-1].name == "cpu" and devices[-1].kind == "cpu"
    assert all(d.kind in ("gpu", "igpu", "cpu") for d in devices)
    assert resolve_device("auto", devices) in devices


def test_cpu_memory_info_is_system_ram():
    total, free = memory_info(resolve_device("cpu"))
    assert total == psutil.virtual_memory().total
    assert 0 < free <= total


def test_format_devices_has_one_row_per_device():
    text = format_devices([CPU])
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["name", "kind"]
    assert lines[1].startswith("cpu") and "fake CPU" in lines[1]
