"""Checks of what a run would refuse only later, made at validation so a bad job fails before it samples:
non-finite numbers anywhere in widget values and settings, memory settings naming a device this machine does
not have, and an output folder the job's saving nodes cannot write.

Widget inputs the node type declares are checked by their spec (spec.Input.check_value, which refuses
non-finite FLOATs); the walk here covers the rest: values nested in lists or objects, widgets the type does
not declare, and the workflow's settings. A node type writes into the output folder when it has a
`filename_prefix` input (SaveImage, SaveLatent, CheckpointSave, VAESave and plugins that follow ComfyUI).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from engine.graph.document import Workflow, id_sort_key
from engine.graph.errors import ValidationError
from engine.graph.spec import NodeType

OUTPUT_PREFIX_INPUT = "filename_prefix"


def first_non_finite(value: Any) -> tuple[str, float] | None:
    """A non-finite float (NaN, +-inf) in `value` with where it sits ("" for the value itself, "[2].key"
    inside it), or None when there is none. Walks with an explicit stack: no recursion, however deep."""
    stack: list[tuple[Any, Any]] = [(value, None)]  # (item, (parent's trail, step) or None)
    while stack:
        item, trail = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            steps = []
            while trail is not None:
                trail, step = trail
                steps.append(step)
            return "".join(reversed(steps)), item
        if isinstance(item, dict):
            stack.extend((inner, (trail, f".{key}")) for key, inner in item.items())
        elif isinstance(item, (list, tuple)):
            stack.extend((inner, (trail, f"[{index}]")) for index, inner in enumerate(item))
    return None


def check_non_finite(workflow: Workflow,
                     reported: set[tuple[str | None, str | None]]) -> list[ValidationError]:
    """A bad_value for each widget value (of a non-muted node) holding a non-finite number that its spec did
    not already report (`reported`: (node id, input name) pairs), and a bad_setting for the settings."""
    errors: list[ValidationError] = []
    for node_id in sorted(workflow.nodes, key=id_sort_key):
        node = workflow.nodes[node_id]
        if node.mode == "muted":
            continue
        for name, value in node.widgets.items():
            found = first_non_finite(value)
            if found is not None and (node_id, name) not in reported:
                errors.append(ValidationError("bad_value", f"{name}{found[0]} holds the non-finite number "
                                              f"{found[1]!r}; accepted: finite numbers", node_id, name,
                                              node.type))
    for key, value in workflow.settings.items():
        found = first_non_finite(value)
        if found is not None:
            errors.append(ValidationError("bad_setting", f"settings.{key}{found[0]} holds the non-finite "
                                          f"number {found[1]!r}; accepted: finite numbers"))
    return errors


def check_memory_devices(workflow: Workflow) -> list[ValidationError]:
    """A bad_setting when settings["memory"] is not valid here: an unknown key or value, or a device this
    machine does not have (`cuda7` on a machine with one GPU, `tpu`) in backend, params_backend or max_vram;
    the message is engine/placement's, naming the value and the devices available."""
    memory = workflow.settings.get("memory")
    if not memory:
        return []
    from engine.devices import DeviceError, list_devices, resolve_device
    from engine.placement import (
        DEFAULT,
        MODULES,
        MemorySettings,
        PlacementError,
        parse_max_vram,
        placement_for,
    )

    if not isinstance(memory, dict):
        return [ValidationError("bad_setting", f"settings.memory must be an object of memory settings "
                                               f"such as {{\"max_vram\": \"6\"}}, got {memory!r:.80}")]
    devices = list_devices()
    try:
        settings = MemorySettings.from_dict(memory)
        for module in MODULES:
            placement_for(module, settings, devices)
        for name in parse_max_vram(settings.max_vram):
            if name != DEFAULT:
                try:
                    resolve_device(name, devices)
                except DeviceError as error:
                    raise PlacementError(f"--max-vram {settings.max_vram!r}: {error}") from None
    except (PlacementError, TypeError) as error:
        return [ValidationError("bad_setting", f"settings.memory: {error}")]
    return []


def check_output_folder(workflow: Workflow, classes: dict[str, type[NodeType]],
                        output_dir: Path | None) -> list[ValidationError]:
    """A bad_setting naming the output folder when a normal node that saves files (one with a
    filename_prefix input) could not write into `output_dir` (settings.output_dir_problem); [] without one."""
    if output_dir is None:
        return []
    from engine.settings import output_dir_problem

    savers = [node_id for node_id, cls in classes.items() if workflow.nodes[node_id].mode == "normal"
              and cls.input_named(OUTPUT_PREFIX_INPUT) is not None]
    if not savers:
        return []
    problem = output_dir_problem(Path(output_dir))
    if problem is None:
        return []
    first = min(savers, key=id_sort_key)
    return [ValidationError("bad_setting", problem, first, OUTPUT_PREFIX_INPUT, workflow.nodes[first].type)]
