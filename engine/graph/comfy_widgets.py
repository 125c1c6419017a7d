"""Node types whose ComfyUI widgets differ from Sluice's, and how their values translate both ways.

ComfyUI's CLIPLoader and DualCLIPLoader end with a `device` widget ("default" or "cpu") where Sluice's loaders
end with `backend` (a compute device name or "auto") and `params_backend` (nodes/loaders.py). On import,
ComfyUI's positional widgets_values are named by ComfyUI's widget list and `device` becomes `backend`
("default" -> "auto", "cpu" -> "cpu"). On export a UI workflow lists ComfyUI's widgets in ComfyUI's order
(`backend` written back as `device`: "cpu" stays, any other device becomes "default"), followed by Sluice's
own widgets ComfyUI lacks (`backend`, `params_backend`), which ComfyUI ignores and a Sluice import reads back;
an API prompt carries `device` beside `backend`, which wins on import.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from engine.graph.spec import NodeType

SLUICE_ONLY_WIDGETS = ("backend", "params_backend")  # placement inputs of Sluice's loaders; ComfyUI has none


@dataclass(frozen=True)
class Renamed:
    """A ComfyUI widget that stands for a Sluice widget of another name and other values."""

    comfy_name: str
    sluice_name: str
    to_sluice: dict[str, str]  # ComfyUI value -> Sluice value
    comfy_default: str  # written for a Sluice value ComfyUI has no counterpart of

    def to_comfy(self, value: Any) -> Any:
        return next((comfy for comfy, ours in self.to_sluice.items() if ours == value), self.comfy_default)


@dataclass(frozen=True)
class WidgetAdapter:
    comfy_widgets: tuple[str, ...]  # ComfyUI's widget inputs, in ComfyUI's order
    renamed: tuple[Renamed, ...]

    def sluice_extras(self, cls: type[NodeType]) -> list[str]:
        """Sluice's widget inputs that ComfyUI's list does not name, in Sluice's order."""
        return [spec.name for spec in cls.widget_inputs() if spec.name not in self.comfy_widgets]


DEVICE = Renamed("device", "backend", {"default": "auto", "cpu": "cpu"}, "default")
WIDGET_ADAPTERS = {
    "CLIPLoader": WidgetAdapter(("clip_name", "type", "device"), (DEVICE,)),
    "DualCLIPLoader": WidgetAdapter(("clip_name1", "clip_name2", "type", "device"), (DEVICE,)),
}


def named_ui_values(type_name: str, cls: type[NodeType], values: list[Any], where: str,
                    warnings: list[str]) -> list[Any] | dict[str, Any]:
    """A UI node's positional widgets_values by Sluice input name where the type needs translating, else as
    they are."""
    adapter = WIDGET_ADAPTERS.get(type_name)
    if adapter is None:
        return values
    named = dict(zip(adapter.comfy_widgets, values, strict=False))
    extras = dict(zip(adapter.sluice_extras(cls), values[len(adapter.comfy_widgets):], strict=False))
    return {**_to_sluice(adapter, named, where, warnings), **extras}


def sluice_api_inputs(type_name: str, given: dict[str, Any], where: str,
                      warnings: list[str]) -> dict[str, Any]:
    """An API node's widget inputs with ComfyUI-only names translated; a Sluice name given as well wins."""
    adapter = WIDGET_ADAPTERS.get(type_name)
    if adapter is None:
        return given
    ours = {name: value for name, value in given.items()
            if name not in {renamed.comfy_name for renamed in adapter.renamed}}
    return {**_to_sluice(adapter, given, where, warnings), **ours}


def _to_sluice(adapter: WidgetAdapter, named: dict[str, Any], where: str,
               warnings: list[str]) -> dict[str, Any]:
    out = dict(named)
    for renamed in adapter.renamed:
        if renamed.comfy_name not in out:
            continue
        value = out.pop(renamed.comfy_name)
        if isinstance(value, Hashable) and value in renamed.to_sluice:  # a list or object is not a value
            out[renamed.sluice_name] = renamed.to_sluice[value]
        else:
            accepted = ", ".join(repr(v) for v in renamed.to_sluice)
            warnings.append(f"{where}: {renamed.comfy_name} {value!r} is not one of ComfyUI's values "
                            f"({accepted}); {renamed.sluice_name} keeps its default")
    return out


def comfy_ui_values(type_name: str, cls: type[NodeType], widgets: dict[str, Any]) -> list[Any] | None:
    """The positional widgets_values ComfyUI reads for a node of a translated type (None for other types);
    `widgets` holds a value for each of the type's widget inputs."""
    adapter = WIDGET_ADAPTERS.get(type_name)
    if adapter is None:
        return None
    renamed = {r.comfy_name: r for r in adapter.renamed}
    values = [renamed[name].to_comfy(widgets.get(renamed[name].sluice_name)) if name in renamed
              else widgets.get(name) for name in adapter.comfy_widgets]
    return values + [widgets[name] for name in adapter.sluice_extras(cls)]


def comfy_api_extras(type_name: str, widgets: dict[str, Any]) -> dict[str, Any]:
    """The ComfyUI-only inputs an API prompt adds for a node of a translated type."""
    adapter = WIDGET_ADAPTERS.get(type_name)
    if adapter is None:
        return {}
    return {renamed.comfy_name: renamed.to_comfy(widgets[renamed.sluice_name])
            for renamed in adapter.renamed if renamed.sluice_name in widgets}
