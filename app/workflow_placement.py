"""Where every model of a workflow will compute and rest, before anything loads: the one picture that the
node badges, the Inspector, the Devices view and the memory view's plan all read (Qt-free).

Each module of each loader node is resolved by `engine.placement.resolve_node_placement`, the function the
runtime uses when the node runs; weights left to auto-fit take the choice of `sluice plan`'s planner
(`nodes.loaders.workflow_plan`, from file headers alone, on a private runtime so the running engine is not
reconfigured). A placement that cannot work is flagged with the reason, in the GUI's words: a device that
does not exist, a bad settings string, weights that must rest on a device whose VRAM budget they exceed (the
load would fail), or a budget smaller than the model's largest weight.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.gui_words import BUDGET, RESTS, gui_message
from engine.devices import GIB, ComputeDevice, DeviceError, list_devices
from engine.memory.autofit import AutoFitPlan
from engine.memory.ledger import resolve_budget
from engine.placement import MemorySettings, PlacementError, max_vram_for, resolve_node_placement

Lookup = Callable[[str], Any]
UNITS = (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024))


def format_size(nbytes: float) -> str:
    """Bytes with a binary unit and three significant digits: 0.02 GiB reads 20.5 MiB, not 0.0."""
    for name, size in UNITS:
        if abs(nbytes) >= size:
            value = nbytes / size
            return f"{value:.3g} {name}" if value < 100 else f"{value:.0f} {name}"
    return f"{nbytes:.0f} B"


@dataclass(frozen=True)
class ModuleSlot:
    """One module of one loader node: where it computes and rests, its size, and what is wrong with it."""

    node_id: str
    node_title: str  # the node's title as the canvas shows it
    module: str  # diffusion, te, vae, upscaler
    compute: tuple[str, ...]  # compute devices, the main one first; () when the placement is invalid
    params: str | None  # the resolved home (device, cpu, disk, a device name); None: auto-fit decides
    planned: str | None = None  # auto-fit's home when params is None (None: the file could not be read)
    reason: str = ""  # why auto-fit chose `planned`
    weight_bytes: int | None = None  # all weights at the compute dtype (None: the file could not be read)
    largest_bytes: int | None = None  # the largest single weight
    problem: str | None = None  # why this placement cannot work, in the GUI's words

    @property
    def home(self) -> str | None:
        """Where the weights will rest: the explicit choice, else auto-fit's."""
        return self.params if self.params is not None else self.planned

    @property
    def resident(self) -> bool:
        """Whether the weights stay where they compute (else they are copied in as the model runs)."""
        return self.home == "device"


@dataclass(frozen=True)
class WorkflowPlacement:
    slots: tuple[ModuleSlot, ...]
    devices: tuple[ComputeDevice, ...]
    budgets: dict[str, int | None]  # device -> managed budget bytes (None: no budget, live free memory)
    settings: MemorySettings | None  # the workflow's memory settings (None: they are not valid)
    error: str | None = None  # the workflow's memory settings cannot be read (GUI words)
    plan: AutoFitPlan | None = None
    copy_estimates: dict[tuple[str, str], int] = field(default_factory=dict)  # (node, module) -> bytes/call

    def for_node(self, node_id: str) -> list[ModuleSlot]:
        return [slot for slot in self.slots if slot.node_id == node_id]

    def on_device(self, device: str) -> list[ModuleSlot]:
        return [slot for slot in self.slots if slot.compute and slot.compute[0] == device]

    def resident_bytes(self, device: str) -> int:
        """Weights planned to stay on `device` (modules computing there whose weights rest there)."""
        return sum(s.weight_bytes or 0 for s in self.on_device(device) if s.resident)

    def copy_per_call(self, slot: ModuleSlot) -> int:
        """Bytes expected to be copied in each time `slot`'s module runs (each step for diffusion)."""
        return self.copy_estimates.get((slot.node_id, slot.module), 0)


def is_model_node(node_type: Any) -> bool:
    return bool(getattr(node_type, "memory_module", None))


def _title(node: Any, node_type: Any) -> str:
    return node.title or getattr(node_type, "display_name", "") or node.type


def _node_modules(node_type: Any, widgets: dict[str, Any], settings: Any) -> list[str]:
    """The modules a node loads: its files' components when it lists them, else its memory module."""
    files = getattr(node_type, "memory_files", None)
    if files is not None:
        try:
            return list(files(settings, widgets))
        except (OSError, ValueError):  # a model file that is not there: its main module still shows
            pass
    return [node_type.memory_module]


def _budgets(devices: Sequence[ComputeDevice], settings: MemorySettings) -> dict[str, int | None]:
    return {d.name: resolve_budget(max_vram_for(d, settings.max_vram, devices), d) for d in devices}


def _problem(slot: ModuleSlot, budgets: dict[str, int | None]) -> str | None:
    if not slot.compute or slot.weight_bytes is None:
        return None
    device = slot.compute[0]
    budget = budgets.get(device)
    if budget is None:
        return None
    if slot.largest_bytes and slot.largest_bytes > budget:
        return (f"the {BUDGET} of {device} ({format_size(budget)}) is smaller than the largest weight of "
                f"{slot.module} ({format_size(slot.largest_bytes)}); raise the {BUDGET}")
    if slot.resident and slot.params is not None and slot.weight_bytes > budget:
        advice = "auto" if device == "cpu" else "pinned RAM or auto"
        return (f"{slot.module}'s weights ({format_size(slot.weight_bytes)}) do not fit the {BUDGET} of "
                f"{device} ({format_size(budget)}) while they rest where it computes; choose {advice} for "
                f"'{RESTS}', or raise the {BUDGET}")
    return None


def _copy_estimates(slots: Sequence[ModuleSlot], budgets: dict[str, int | None],
                    ) -> dict[tuple[str, str], int]:
    """Per streamed module: its weights beyond the room its device's budget leaves beside the resident
    modules there (a lower bound: the workspace also takes room)."""
    estimates = {}
    for slot in slots:
        if slot.resident or not slot.compute or slot.weight_bytes is None:
            continue
        device = slot.compute[0]
        budget = budgets.get(device)
        if budget is None:
            continue
        others = sum(s.weight_bytes or 0 for s in slots
                     if s is not slot and s.resident and s.compute and s.compute[0] == device)
        estimates[(slot.node_id, slot.module)] = max(0, slot.weight_bytes - max(0, budget - others))
    return estimates


def _plan(workflow: Any, app_settings: Any, devices: Sequence[ComputeDevice]) -> AutoFitPlan | None:
    """`sluice plan`'s auto-fit plan of the workflow on a private runtime (the engine's is left alone)."""
    from engine.memory.runtime import MemoryRuntime
    from engine.telemetry import EventBus
    from nodes.loaders import workflow_plan

    try:
        return workflow_plan(workflow, app_settings, MemoryRuntime(devices=devices, bus=EventBus()))
    except (ValueError, OSError, RuntimeError, AssertionError):  # bad settings, or a device torch lacks
        return None


def resolve_workflow(workflow: Any, lookup: Lookup, devices: Sequence[ComputeDevice] | None = None,
                     app_settings: Any = None) -> WorkflowPlacement:
    """Every model-bearing node's modules placed as a run would place them, with auto-fit's plan."""
    devices = tuple(list_devices() if devices is None else devices)
    memory = workflow.settings.get("memory", {})
    try:
        settings = MemorySettings.from_dict(memory)
        budgets = _budgets(devices, settings)
    except PlacementError as error:
        return WorkflowPlacement((), devices, {d.name: None for d in devices}, None, gui_message(str(error)))
    plan = _plan(workflow, app_settings, devices)
    choices = {c.need.name: c for c in plan.choices} if plan is not None else {}
    slots = []
    for node_id, node in workflow.nodes.items():
        node_type = lookup(node.type)
        if not is_model_node(node_type) or node.mode != "normal":
            continue
        widgets = {**node_type.default_widget_values(), **node.widgets}
        planned_modules = [name.split("/", 1)[1] for name in choices if name.split("/", 1)[0] == node_id]
        for module in planned_modules or _node_modules(node_type, widgets, app_settings):
            base = {"node_id": node_id, "node_title": _title(node, node_type), "module": module}
            try:
                placed = resolve_node_placement(module, settings, str(widgets.get("backend", "auto")),
                                                str(widgets.get("params_backend", "auto")), devices=devices)
            except (PlacementError, DeviceError) as error:
                slots.append(ModuleSlot(**base, compute=(), params=None, problem=gui_message(str(error))))
                continue
            choice = choices.get(f"{node_id}/{module}")
            slot = ModuleSlot(
                **base, compute=placed.compute, params=placed.params,
                planned=choice.params if choice is not None and placed.params is None else None,
                reason=choice.reason if choice is not None else "",
                weight_bytes=choice.need.weight_bytes if choice is not None else None,
                largest_bytes=choice.need.largest_tensor_bytes if choice is not None else None)
            slots.append(_with_problem(slot, budgets))
    return WorkflowPlacement(tuple(slots), devices, budgets, settings, None, plan,
                             _copy_estimates(slots, budgets))


def _with_problem(slot: ModuleSlot, budgets: dict[str, int | None]) -> ModuleSlot:
    problem = _problem(slot, budgets)
    if problem is None:
        return slot
    return ModuleSlot(**{**slot.__dict__, "problem": problem})


def placement_key(workflow: Any, lookup: Lookup) -> str:
    """What the placement depends on: the memory settings and the model-bearing nodes' inputs."""
    nodes = []
    for node_id, node in workflow.nodes.items():
        node_type = lookup(node.type)
        if is_model_node(node_type):
            nodes.append((node_id, node.type, node.mode, node.title, node.widgets))
    return json.dumps([workflow.settings.get("memory", {}), nodes], sort_keys=True, default=str)


class PlacementCache:
    """The latest few resolutions by `placement_key` (resolving reads file headers: not on every paint)."""

    def __init__(self, size: int = 4, devices: Sequence[ComputeDevice] | None = None) -> None:
        self.size = size
        self.devices = tuple(devices) if devices is not None else None
        self._entries: dict[str, WorkflowPlacement] = {}

    def get(self, workflow: Any, lookup: Lookup, app_settings: Any = None) -> WorkflowPlacement:
        key = placement_key(workflow, lookup)
        if key not in self._entries:
            if self.devices is None:
                self.devices = tuple(list_devices())
            self._entries[key] = resolve_workflow(workflow, lookup, self.devices, app_settings)
            while len(self._entries) > self.size:
                self._entries.pop(next(iter(self._entries)))
        return self._entries[key]


placements = PlacementCache()  # the window's: badges, Inspector, Devices view and memory plan share it
