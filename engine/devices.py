"""Compute devices: discovery, name resolution and memory reports (reference/000, "Backend names").

Names are `cpu`, `cuda0`, `cuda1`, ..., `mps`. Resolution is case-insensitive and accepts an exact name or
a unique prefix (`cu` means `cuda0` on a one-GPU machine); `cuda:1` is accepted as `cuda1`. The special
values `auto`, `default` and the empty name select the default device (GPU, then integrated GPU, then
CPU); `gpu` selects the first GPU, falling back to the first integrated GPU.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from dataclasses import dataclass

import psutil
import torch

GIB = 1024**3
DEFAULT_NAMES = ("auto", "default", "")
KINDS = ("gpu", "igpu", "cpu")  # also the default preference order


class DeviceError(ValueError):
    """A device name that names no device, or names several."""


@dataclass(frozen=True)
class ComputeDevice:
    name: str  # "cpu", "cuda0", "cuda1", "mps"
    torch_device: torch.device  # what tensors are created on
    kind: str  # "gpu" (discrete), "igpu" (integrated / unified memory) or "cpu"
    description: str  # e.g. "NVIDIA H200", "Apple MPS (unified memory)", "x86_64 CPU"


def list_devices() -> list[ComputeDevice]:
    """The devices torch can use: CUDA devices as cudaN, then mps if available, then cpu (always last)."""
    devices = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            devices.append(
                ComputeDevice(
                    f"cuda{index}", torch.device("cuda", index), "gpu", torch.cuda.get_device_name(index)
                )
            )
    if torch.backends.mps.is_available():
        devices.append(ComputeDevice("mps", torch.device("mps"), "igpu", "Apple MPS (unified memory)"))
    processor = platform.processor() or platform.machine() or "unknown"
    devices.append(ComputeDevice("cpu", torch.device("cpu"), "cpu", f"{processor} CPU"))
    return devices


def device_name(device: torch.device | str) -> str:
    """The Sluice name of a torch device: cuda:1 -> cuda1, cuda -> cuda<current>, cpu -> cpu, mps -> mps."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda{index}"
    return device.type


def _normalise(name: str) -> str:
    return name.strip().lower().replace(":", "")


def resolve_device(name: str, devices: Sequence[ComputeDevice] | None = None) -> ComputeDevice:
    """The device called `name`: exact or unique-prefix match, case-insensitive, or auto/default/gpu."""
    devices = list_devices() if devices is None else list(devices)
    available = ", ".join(d.name for d in devices) or "none"
    wanted = _normalise(name)
    if wanted in DEFAULT_NAMES:
        for kind in KINDS:
            for device in devices:
                if device.kind == kind:
                    return device
        raise DeviceError(f"no compute device available for {name!r}")
    if wanted == "gpu":
        for kind in ("gpu", "igpu"):
            for device in devices:
                if device.kind == kind:
                    return device
        raise DeviceError(f"no GPU device for 'gpu'; available devices: {available}")
    for device in devices:
        if device.name == wanted:
            return device
    candidates = [d for d in devices if d.name.startswith(wanted)]
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        names = ", ".join(d.name for d in candidates)
        raise DeviceError(f"ambiguous device name {name!r}: it is a prefix of {names}; give one of them")
    raise DeviceError(f"unknown device {name!r}; available devices: {available} (or auto, default, gpu)")


def memory_info(device: ComputeDevice | torch.device | str) -> tuple[int, int]:
    """(total_bytes, free_bytes) of `device`: the CUDA driver's report for GPUs, system RAM otherwise."""
    torch_device = device.torch_device if isinstance(device, ComputeDevice) else torch.device(device)
    if torch_device.type == "cuda":
        free, total = torch.cuda.mem_get_info(torch_device)
        return int(total), int(free)
    if torch_device.type == "mps":
        total = int(torch.mps.recommended_max_memory())
        return total, max(0, total - int(torch.mps.driver_allocated_memory()))
    ram = psutil.virtual_memory()
    return int(ram.total), int(ram.available)


def format_devices(devices: Sequence[ComputeDevice] | None = None) -> str:
    """The table `sluice devices` prints: name, kind, description, total and free memory in GiB."""
    devices = list_devices() if devices is None else list(devices)
    rows = [("name", "kind", "description", "total GiB", "free GiB")]
    for device in devices:
        total, free = memory_info(device)
        rows.append((device.name, device.kind, device.description, f"{total / GIB:.1f}", f"{free / GIB:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(width) if i < 3 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
