"""Device badges of model-bearing nodes: where the model computes and where its weights rest.

`badge_for` is Qt-free (colours are hex strings) so the canvas paints it and tests read it. A node's own
`backend` / `params_backend` widget values, when set, are module-specific entries appended to the
workflow's strings (reference/000: a module entry wins over the default), so the badge shows exactly what
`engine.placement.placement_for` resolves for the node's memory module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.devices import ComputeDevice, DeviceError
from engine.placement import MemorySettings, PlacementError, placement_for

DEVICE_COLORS = ("#4caf50", "#ff9800", "#29b6f6", "#ec407a", "#ab47bc", "#ffee58")  # cuda0, cuda1, ...
CPU_COLOR = "#8d94a0"
MPS_COLOR = "#ab47bc"
ERROR_COLOR = "#ff4d4d"
INHERIT = ("", "workflow")  # node widget values that keep the workflow's assignment


@dataclass(frozen=True)
class Badge:
    text: str  # short label painted on the node, e.g. "cuda0 · RAM"
    color: str  # hex colour of the compute device (ERROR_COLOR when the assignment is invalid)
    tooltip: str  # the full placement, or the error message
    error: str | None = None  # the PlacementError / DeviceError message, None when valid


def device_color(name: str) -> str:
    """A stable colour per device: cpu grey, mps purple, cudaN the N-th of DEVICE_COLORS."""
    if name == "cpu":
        return CPU_COLOR
    if name == "mps":
        return MPS_COLOR
    digits = "".join(c for c in name if c.isdigit())
    return DEVICE_COLORS[int(digits) % len(DEVICE_COLORS)] if digits else DEVICE_COLORS[0]


def memory_settings(workflow_memory: Mapping[str, Any] | MemorySettings | None) -> MemorySettings:
    """MemorySettings from a workflow's settings["memory"] dict (or settings already parsed)."""
    if isinstance(workflow_memory, MemorySettings):
        return workflow_memory
    return MemorySettings.from_dict(workflow_memory or {})


def _with_node_entry(text: str | None, module: str, value: Any) -> str | None:
    """`text` with the node's value appended as a `module=value` entry (a full assignment as is)."""
    if value is None or str(value).strip().lower() in INHERIT:
        return text
    value = str(value).strip()
    entry = value if "=" in value else f"{module}={value}"
    return f"{text},{entry}" if text and text.strip() else entry


def _rest_label(params: str, compute: Sequence[str]) -> str:
    """GPU, RAM, disk or a device name: where the weights rest between uses."""
    if params == "disk":
        return "disk"
    if params == "cpu":
        return "RAM"
    if params == "device":
        return "RAM" if compute[0] == "cpu" else "GPU"
    return params


def badge_for(
    node_type: Any,
    widgets: Mapping[str, Any],
    workflow_memory_settings: Mapping[str, Any] | MemorySettings | None,
    devices: Sequence[ComputeDevice] | None = None,
) -> Badge | None:
    """The badge of a node of `node_type` (a NodeType class, or a module name), None if it holds no model."""
    module = node_type if isinstance(node_type, str) else getattr(node_type, "memory_module", None)
    if not module:
        return None
    try:
        settings = memory_settings(workflow_memory_settings)
        settings = replace(
            settings,
            backend=_with_node_entry(settings.backend, module, widgets.get("backend")) or "auto",
            params_backend=_with_node_entry(settings.params_backend, module, widgets.get("params_backend")),
        )
        placement = placement_for(module, settings, devices)
    except (PlacementError, DeviceError) as error:
        return Badge("placement error", ERROR_COLOR, f"{module}: {error}", str(error))
    compute = "&".join(placement.compute)
    rest = _rest_label(placement.params, placement.compute)
    split = f" ({placement.split_mode} split)" if len(placement.compute) > 1 else ""
    tooltip = (
        f"{placement.module}: computes on {compute}{split}; weights rest on {rest}"
        f" (params: {placement.params}); flash attention {placement.flash_attn}, "
        f"direct convolution {placement.conv_direct}"
        + ("; auto-fit may keep weights in RAM when they do not fit" if settings.auto_fit else "")
    )
    return Badge(f"{compute} · {rest}", device_color(placement.compute[0]), tooltip)
