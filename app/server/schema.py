"""GET /object_info: every Sluice node type described in ComfyUI's schema, so ComfyUI clients build their
widgets and prompts from it.

Per node: {"input": {"required": {name: [type, options]}, "optional": {...}}, "input_order": {section:
[names]}, "output": [types], "output_is_list": [...], "output_name": [...], "name", "display_name",
"description", "python_module", "category", "output_node", and "output_tooltips" when outputs say what they
are}. An input's type is its link type ("MODEL"), a widget kind ("INT", "FLOAT", "STRING", "BOOLEAN"; a
SEED is an INT with `control_after_generate`), or for a choice the list of choices itself; options carry
default, min, max, step, multiline and the description as tooltip. Inputs are required in declaration order
(ComfyUI's order, which Sluice's node types keep), except optional links and Sluice's own placement widgets
(`backend`, `params_backend`), which ComfyUI's types lack and which are therefore optional. LoadImage and
LoadImageMask take a file name in the input folder; as in ComfyUI their `image` is a choice of the files
there with `image_upload`, the flag that gives them an upload button.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.server.files import image_names
from engine.graph.comfy_widgets import SLUICE_ONLY_WIDGETS
from engine.graph.spec import BOOLEAN, COMBO, FLOAT, INT, SEED, SEED_MAX, STRING, Input, NodeType
from engine.images import IMAGE_EXTENSIONS
from engine.settings import Settings
from nodes.image import input_dir
from nodes.registry import NodeRegistry

UPLOAD_INPUTS = {"LoadImage": "image", "LoadImageMask": "image"}  # node type -> its file-name input
LARGE_CHOICE_LIST = 20  # ComfyUI leaves longer lists out of a validation error's input_config


def is_upload_input(node_type: type[NodeType], spec: Input) -> bool:
    return UPLOAD_INPUTS.get(node_type.type_name) == spec.name


def input_config(node_type: type[NodeType], spec: Input, settings: Settings) -> list[Any]:
    """One input as ComfyUI writes it: [type] or [type, options]; a choice's type is its list of values."""
    options: dict[str, Any] = {}
    if is_upload_input(node_type, spec):
        kind: Any = image_names(input_dir(settings), IMAGE_EXTENSIONS)
        options["image_upload"] = True
    elif spec.kind == COMBO:
        try:
            kind = spec.current_choices()
        except Exception:  # a computed list (model files) that cannot be read now: no choices
            kind = []
        if spec.default is not None:
            options["default"] = spec.default
    elif spec.kind in (INT, SEED):
        kind = INT
        options["default"] = spec.default
        if spec.kind == SEED:
            options.update(min=0, max=SEED_MAX, control_after_generate=True)
        else:
            options.update({key: int(value) for key, value in (("min", spec.min), ("max", spec.max))
                            if value is not None})
            if spec.step not in (None, 1):
                options["step"] = int(spec.step)
    elif spec.kind == FLOAT:
        kind = FLOAT
        options["default"] = spec.default
        limits = (("min", spec.min), ("max", spec.max), ("step", spec.step))
        options.update({key: value for key, value in limits if value is not None})
    elif spec.kind == STRING:
        kind = STRING
        options["default"] = spec.default
        if spec.multiline:
            options["multiline"] = True
    elif spec.kind == BOOLEAN:
        kind = BOOLEAN
        options["default"] = spec.default
    else:
        kind = spec.kind
    if spec.description:
        options["tooltip"] = spec.description
    return [kind, options] if options else [kind]


def input_section(spec: Input) -> str:
    """ComfyUI's section of an input: optional links and Sluice-only widgets are optional."""
    if (not spec.is_widget and spec.optional) or (spec.is_widget and spec.name in SLUICE_ONLY_WIDGETS):
        return "optional"
    return "required"


def python_module(source: str | None) -> str:
    """ComfyUI's python_module: "nodes" for built-in types, "custom_nodes.NAME" for a plugin's."""
    if source is None or source.startswith("nodes."):
        return "nodes"
    return f"custom_nodes.{Path(source).stem}"


def node_info(node_type: type[NodeType], settings: Settings, source: str | None = None) -> dict[str, Any]:
    """The /object_info entry of one node type."""
    sections: dict[str, dict[str, Any]] = {}
    for spec in node_type.inputs:
        sections.setdefault(input_section(spec), {})[spec.name] = input_config(node_type, spec, settings)
    inputs = {section: sections[section] for section in ("required", "optional") if section in sections}
    info: dict[str, Any] = {
        "input": inputs,
        "input_order": {section: list(names) for section, names in inputs.items()},
        "output": [output.type for output in node_type.outputs],
        "output_is_list": [False] * len(node_type.outputs),
        "output_name": [output.name for output in node_type.outputs],
        "name": node_type.type_name,
        "display_name": node_type.display_name,
        "description": node_type.description,
        "python_module": python_module(source),
        "category": node_type.category,
        "output_node": bool(node_type.output_node),
    }
    if any(output.description for output in node_type.outputs):
        info["output_tooltips"] = [output.description for output in node_type.outputs]
    return info


def object_info(registry: NodeRegistry, settings: Settings) -> dict[str, Any]:
    """Every registered node type by name, in the registry's (alphabetical) order."""
    return {node_type.type_name: node_info(node_type, settings, registry.source_of(node_type.type_name))
            for node_type in registry.types()}
