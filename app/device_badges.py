"""Device badges of model-bearing nodes: where the model computes and where its weights rest.

Qt-free (colours are hex strings) so the canvas paints it and tests read it. A badge is made from the
node's `ModuleSlot`s (app/workflow_placement.py), which `engine.placement.resolve_node_placement` resolves
exactly as the run will, with auto-fit's choice where the weights are left to it; a placement that cannot
work gives a red badge whose tooltip says why, in the GUI's words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.gui_words import COMPUTES, RESTS, gui_message, home_words
from app.workflow_placement import ModuleSlot, PlacementCache, format_size, placements
from engine.devices import ComputeDevice, DeviceError
from engine.placement import MemorySettings, PlacementError, resolve_node_placement

DEVICE_COLORS = ("#4caf50", "#ff9800", "#29b6f6", "#ec407a", "#ab47bc", "#ffee58")  # cuda0, cuda1, ...
CPU_COLOR = "#8d94a0"
MPS_COLOR = "#ab47bc"
ERROR_COLOR = "#ff4d4d"


@dataclass(frozen=True)
class Badge:
    text: str  # short label painted on the node, e.g. "cuda0 · RAM"
    color: str  # hex colour of the compute device (ERROR_COLOR when the placement cannot work)
    tooltip: str  # the full placement, or why it cannot work
    error: str | None = None  # why the placement cannot work (GUI words), None when it can


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


def rest_label(home: str | None, compute: Sequence[str]) -> str:
    """GPU, RAM, disk, a device name or auto: where the weights rest between uses, in a word."""
    if home is None:
        return "auto"
    if home == "disk":
        return "disk"
    if home == "cpu":
        return "RAM"
    if home == "device":
        return "RAM" if compute[0] == "cpu" else "GPU"
    return home


def slot_sentence(slot: ModuleSlot) -> str:
    """One module's placement in words, e.g. "diffusion computes on cpu; weights rest in pinned RAM
    (auto-fit: does not fit on cpu; fits in RAM), 26.2 MiB"."""
    if not slot.compute:
        return f"{slot.module}: {slot.problem}"
    compute = "&".join(slot.compute)
    rest = home_words(slot.home, slot.compute[0])
    chosen = f" (auto-fit: {slot.reason})" if slot.params is None and slot.reason else ""
    size = f", {format_size(slot.weight_bytes)}" if slot.weight_bytes is not None else ""
    return f"{slot.module} computes on {compute}; weights rest: {rest}{chosen}{size}"


def badge_for_slots(slots: Sequence[ModuleSlot], main_module: str) -> Badge | None:
    """The badge of a node whose modules are `slots`; it names the node's main module's placement."""
    if not slots:
        return None
    main = next((s for s in slots if s.module == main_module), slots[0])
    sentences = "\n".join(slot_sentence(s) for s in slots)
    flags = f"({COMPUTES}: backend, {RESTS}: params_backend)"
    broken = next((s for s in slots if s.problem), None)
    if broken is not None:
        short = "⚠ cannot place" if not broken.compute else "⚠ over budget"
        return Badge(short, ERROR_COLOR, f"{broken.problem}\n\n{sentences}", broken.problem)
    text = f"{'&'.join(main.compute)} · {rest_label(main.home, main.compute)}"
    return Badge(text, device_color(main.compute[0]), f"{sentences}\n{flags}")


def node_badge(workflow: Any, lookup: Any, node_id: str, cache: PlacementCache = placements) -> Badge | None:
    """The badge of node `node_id` of `workflow`, from the shared placement picture."""
    node = workflow.nodes.get(node_id)
    node_type = lookup(node.type) if node is not None else None
    module = getattr(node_type, "memory_module", None)
    if not module:
        return None
    return badge_for_slots(cache.get(workflow, lookup).for_node(node_id), module)


def badge_for(
    node_type: Any,
    widgets: Mapping[str, Any],
    workflow_memory_settings: Mapping[str, Any] | MemorySettings | None,
    devices: Sequence[ComputeDevice] | None = None,
) -> Badge | None:
    """The badge of a node of `node_type` (a NodeType class, or a module name) from its widgets alone (no
    file read, so weights left to auto-fit read "auto"); None if it holds no model."""
    module = node_type if isinstance(node_type, str) else getattr(node_type, "memory_module", None)
    if not module:
        return None
    try:
        placed = resolve_node_placement(module, memory_settings(workflow_memory_settings),
                                        str(widgets.get("backend", "auto")),
                                        str(widgets.get("params_backend", "auto")), devices=devices)
    except (PlacementError, DeviceError) as error:
        slot = ModuleSlot("", "", module, (), None, problem=gui_message(str(error)))
    else:
        slot = ModuleSlot("", "", placed.module, placed.compute, placed.params)
    return badge_for_slots([slot], slot.module)

