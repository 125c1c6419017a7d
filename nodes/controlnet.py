"""ControlNet nodes with ComfyUI's names, inputs (in ComfyUI's order), defaults and outputs: ControlNetLoader,
DiffControlNetLoader, ControlNetApply (ComfyUI's deprecated one) and ControlNetApplyAdvanced.

As in ComfyUI, T2I-Adapters load through ControlNetLoader (there is no T2IAdapterLoader), from the models
folder's controlnet/ or t2i_adapter/. The loaders end with `backend` and `params_backend` like the other
loaders (nodes/loaders.py): the control model is the memory runtime's module `controlnet`, planned by
auto-fit with the workflow's other models.

The apply nodes put a `Control` (engine/models/control.py) under "control" in a copy of each conditioning
entry's options, chained onto the entry's earlier control. ControlNetApplyAdvanced gives positive and
negative entries that had the same earlier control one shared Control (so they run in one batched call) and
marks them `control_apply_to_uncond` False; ControlNetApply makes one Control per entry and marks it True,
so the sampler hands it to the negative side too. A strength of 0 returns the conditioning unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.graph.spec import NodeType, Output, RunContext, combo_input, float_input, link_input
from engine.memory.runtime import get_runtime
from engine.models.bundles import DiffusionModel, require
from engine.models.conditioning import ConditioningList, check_conditioning
from engine.models.control import MEMORY_MODULE, ControlModel
from engine.models.control_loader import load_control_model
from nodes.loaders import LOADERS, file_fingerprint, model_choices, model_path, node_targets, placement_inputs

FOLDER = "controlnet"


def _control_model(control_net: Any) -> ControlModel:
    return require(control_net, "CONTROL_NET", ControlModel)


def _hint(image: Any) -> torch.Tensor:
    if not isinstance(image, torch.Tensor) or image.ndim != 4:
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(f"image: expected an IMAGE batch of shape (B, H, W, C); got {shape}")
    return image


def _load(ctx: RunContext, node_type: type[NodeType], name: str, backend: str, params_backend: str,
          base: DiffusionModel | None = None) -> ControlModel:
    """The control model of file `name` where the node's placement (and auto-fit) puts it."""
    widgets = {"control_net_name": name, "backend": backend, "params_backend": params_backend}
    devices, homes = node_targets(ctx, node_type, widgets)
    return load_control_model(model_path(ctx.settings, FOLDER, name), None, devices[MEMORY_MODULE],
                              homes[MEMORY_MODULE], get_runtime(), base)


class ControlNetLoader(NodeType):
    display_name = "Load ControlNet Model"
    category = "loaders"
    description = ("Loads a ControlNet (SD1.x, SD2.x, SDXL; ldm or diffusers layout) or a T2I-Adapter from "
                   "controlnet/ (or t2i_adapter/).")
    memory_module = MEMORY_MODULE
    inputs = (combo_input("control_net_name", model_choices(FOLDER)), *placement_inputs())
    outputs = (Output("CONTROL_NET", "CONTROL_NET"),)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, FOLDER, widgets["control_net_name"]))

    @classmethod
    def memory_files(cls, settings: Any, widgets: dict[str, Any]) -> dict[str, list[Path]]:
        return {MEMORY_MODULE: [model_path(settings, FOLDER, widgets["control_net_name"])]}

    def run(self, ctx: RunContext, control_net_name: str, backend: str = "auto",
            params_backend: str = "auto") -> tuple:
        return (_load(ctx, type(self), control_net_name, backend, params_backend),)


class DiffControlNetLoader(ControlNetLoader):
    display_name = "Load ControlNet Model (diff)"
    description = ("Loads a ControlNet like Load ControlNet Model; a difference ControlNet (weights stored "
                   "relative to SD1.5) gets the connected model's UNet weights added.")
    inputs = (link_input("model", "MODEL"), *ControlNetLoader.inputs)

    def run(self, ctx: RunContext, model: Any, control_net_name: str, backend: str = "auto",
            params_backend: str = "auto") -> tuple:
        base = require(model, "MODEL", DiffusionModel)
        return (_load(ctx, type(self), control_net_name, backend, params_backend, base),)


class ControlNetApply(NodeType):
    display_name = "Apply ControlNet (OLD)"
    category = "conditioning/controlnet"
    description = ("Deprecated in ComfyUI (use Apply ControlNet): adds the control to every entry of one "
                   "conditioning; the sampler also applies it to the negative prompt.")
    inputs = (link_input("conditioning", "CONDITIONING"), link_input("control_net", "CONTROL_NET"),
              link_input("image", "IMAGE"), float_input("strength", 1.0, min=0.0, max=10.0, step=0.01))
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, conditioning: Any, control_net: Any, image: Any, strength: float) -> tuple:
        conditioning = check_conditioning(conditioning)
        if strength == 0:
            return (conditioning,)
        model, hint = _control_model(control_net), _hint(image)
        applied = []
        for context, options in conditioning:
            control = model.apply(hint, strength, previous=options.get("control"))
            applied.append([context, {**options, "control": control, "control_apply_to_uncond": True}])
        return (applied,)


class ControlNetApplyAdvanced(NodeType):
    display_name = "Apply ControlNet"
    category = "conditioning/controlnet"
    description = ("Adds the control (ControlNet or T2I-Adapter with its hint image) to the positive and "
                   "negative conditioning, between start_percent and end_percent of the sampling. The VAE "
                   "is for ControlNets that take latent hints (SD3, FLUX), which Sluice does not run.")
    inputs = (link_input("positive", "CONDITIONING"), link_input("negative", "CONDITIONING"),
              link_input("control_net", "CONTROL_NET"), link_input("image", "IMAGE"),
              float_input("strength", 1.0, min=0.0, max=10.0, step=0.01),
              float_input("start_percent", 0.0, min=0.0, max=1.0, step=0.001),
              float_input("end_percent", 1.0, min=0.0, max=1.0, step=0.001),
              link_input("vae", "VAE", optional=True))
    outputs = (Output("positive", "CONDITIONING"), Output("negative", "CONDITIONING"))

    def run(self, ctx: RunContext, positive: Any, negative: Any, control_net: Any, image: Any,
            strength: float, start_percent: float, end_percent: float, vae: Any = None) -> tuple:
        positive = check_conditioning(positive, "positive")
        negative = check_conditioning(negative, "negative")
        if strength == 0:
            return (positive, negative)
        model, hint = _control_model(control_net), _hint(image)
        controls: dict[int, Any] = {}  # id of the earlier control (0: none) -> the control chained onto it

        def with_control(conditioning: ConditioningList) -> ConditioningList:
            out = []
            for context, options in conditioning:
                previous = options.get("control")
                key = 0 if previous is None else id(previous)
                if key not in controls:
                    controls[key] = model.apply(hint, strength, (start_percent, end_percent), previous)
                out.append([context, {**options, "control": controls[key], "control_apply_to_uncond": False}])
            return out

        return (with_control(positive), with_control(negative))


NODE_TYPES = (ControlNetLoader, DiffControlNetLoader, ControlNetApply, ControlNetApplyAdvanced)
LOADERS.update({node_type.type_name: node_type for node_type in (ControlNetLoader, DiffControlNetLoader)})
