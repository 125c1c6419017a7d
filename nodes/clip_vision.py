"""CLIP vision and unCLIP nodes with ComfyUI's names, inputs (in ComfyUI's order), defaults and outputs:
CLIPVisionLoader, CLIPVisionEncode, unCLIPConditioning and unCLIPCheckpointLoader.

The loaders end with `backend` and `params_backend` like the other loaders (nodes/loaders.py): the tower is
the memory runtime's module `clip_vision`, planned by auto-fit with the workflow's other models.
unCLIPConditioning appends its image embedding to each entry's "unclip_conditioning" list; the sampler turns
it into the UNet's vector condition (SD2.1 unCLIP) or the SDXL pooled feature (revision),
engine/models/unclip.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.graph.spec import NodeType, Output, RunContext, combo_input, float_input, link_input
from engine.memory.runtime import get_runtime
from engine.models.bundles import MissingComponent, require
from engine.models.clip_vision import CROP_MODES, MEMORY_MODULE, CLIPVision, CLIPVisionOutput
from engine.models.clip_vision_loader import load_clip_vision
from engine.models.conditioning import check_conditioning
from engine.models.loader import load_checkpoint
from engine.models.unclip import check_unclip_entries
from nodes.loaders import (
    LOADERS,
    CheckpointLoaderSimple,
    _missing,
    file_fingerprint,
    model_choices,
    model_path,
    node_targets,
    node_weight_types,
    placement_inputs,
)

FOLDER = "clip_vision"


class CLIPVisionLoader(NodeType):
    display_name = "Load CLIP Vision"
    category = "loaders"
    description = ("Loads a CLIP vision model (ViT-L/14, ViT-H/14, ViT-bigG/14; transformers or open_clip "
                   "layout) from clip_vision/, for unCLIP and revision.")
    memory_module = MEMORY_MODULE
    inputs = (combo_input("clip_name", model_choices(FOLDER)), *placement_inputs())
    outputs = (Output("CLIP_VISION", "CLIP_VISION"),)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, FOLDER, widgets["clip_name"]))

    @classmethod
    def memory_files(cls, settings: Any, widgets: dict[str, Any]) -> dict[str, list[Path]]:
        return {MEMORY_MODULE: [model_path(settings, FOLDER, widgets["clip_name"])]}

    def run(self, ctx: RunContext, clip_name: str, backend: str = "auto", params_backend: str = "auto",
            ) -> tuple:
        widgets = {"clip_name": clip_name, "backend": backend, "params_backend": params_backend}
        devices, homes = node_targets(ctx, type(self), widgets)
        return (load_clip_vision(model_path(ctx.settings, FOLDER, clip_name), None, devices[MEMORY_MODULE],
                                 homes[MEMORY_MODULE], get_runtime()),)


class CLIPVisionEncode(NodeType):
    display_name = "CLIP Vision Encode"
    category = "conditioning"
    description = ("Encodes images with a CLIP vision model: resized to its input size, centre-cropped "
                   "(center) or squashed (none).")
    inputs = (link_input("clip_vision", "CLIP_VISION"), link_input("image", "IMAGE"),
              combo_input("crop", CROP_MODES, "center"))
    outputs = (Output("CLIP_VISION_OUTPUT", "CLIP_VISION_OUTPUT"),)

    def run(self, ctx: RunContext, clip_vision: Any, image: Any, crop: str = "center") -> tuple:
        vision = require(clip_vision, "CLIP_VISION", CLIPVision)
        return (vision.encode_image(image, crop=crop == "center"),)


class unCLIPConditioning(NodeType):  # noqa: N801 (ComfyUI's node name)
    display_name = "unCLIPConditioning"
    category = "conditioning"
    description = ("Adds a CLIP vision image embedding to the conditioning, for SD2.1 unCLIP models and SDXL "
                   "(revision); noise_augmentation noises the embedding before the model sees it.")
    inputs = (link_input("conditioning", "CONDITIONING"),
              link_input("clip_vision_output", "CLIP_VISION_OUTPUT"),
              float_input("strength", 1.0, min=-10.0, max=10.0, step=0.01),
              float_input("noise_augmentation", 0.0, min=0.0, max=1.0, step=0.01))
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, conditioning: Any, clip_vision_output: Any, strength: float,
            noise_augmentation: float) -> tuple:
        conditioning = check_conditioning(conditioning)
        if not isinstance(clip_vision_output, CLIPVisionOutput):
            raise ValueError(f"clip_vision_output: expected a CLIP_VISION_OUTPUT (from CLIPVisionEncode), "
                             f"got {type(clip_vision_output).__name__}")
        if strength == 0:
            return (conditioning,)
        added = {"clip_vision_output": clip_vision_output, "strength": float(strength),
                 "noise_augmentation": float(noise_augmentation)}
        out = []
        for context, options in conditioning:
            earlier = check_unclip_entries(options.get("unclip_conditioning", []))
            out.append([context, {**options, "unclip_conditioning": [*earlier, added]}])
        return (out,)


class unCLIPCheckpointLoader(CheckpointLoaderSimple):  # noqa: N801 (ComfyUI's node name)
    display_name = "unCLIPCheckpointLoader"
    description = ("Loads an SD2.1 unCLIP checkpoint: diffusion model, text encoder, VAE and the CLIP vision "
                   "model it embeds images with.")
    outputs = (*CheckpointLoaderSimple.outputs, Output("CLIP_VISION", "CLIP_VISION"))

    @classmethod
    def memory_files(cls, settings: Any, widgets: dict[str, Any]) -> dict[str, list[Path]]:
        path = model_path(settings, "checkpoints", widgets["ckpt_name"])
        return {"diffusion": [path], "te": [path], "vae": [path], MEMORY_MODULE: [path]}

    def run(self, ctx: RunContext, ckpt_name: str, backend: str = "auto",
            params_backend: str = "auto") -> tuple:
        path = model_path(ctx.settings, "checkpoints", ckpt_name)
        widgets = {"ckpt_name": ckpt_name, "backend": backend, "params_backend": params_backend}
        devices, homes = node_targets(ctx, type(self), widgets)
        types = {m: t for m, t in node_weight_types(ctx, type(self), widgets).items() if t is not None}
        sd_modules = ("diffusion", "te", "vae")
        model, clip, vae = load_checkpoint(path, device={m: devices[m] for m in sd_modules},
                                           params={m: homes[m] for m in sd_modules}, runtime=get_runtime(),
                                           types=types)
        try:
            vision: Any = load_clip_vision(path, None, devices[MEMORY_MODULE], homes[MEMORY_MODULE],
                                           get_runtime())
        except ValueError as error:
            vision = MissingComponent("CLIP_VISION", f"checkpoint {ckpt_name!r} has no CLIP vision model "
                                                     f"({error}); add a CLIPVisionLoader and connect its "
                                                     f"CLIP_VISION output")
        return (model or _missing(ckpt_name, "diffusion", "MODEL"), clip or _missing(ckpt_name, "te", "CLIP"),
                vae or _missing(ckpt_name, "vae", "VAE"), vision)


NODE_TYPES = (CLIPVisionLoader, CLIPVisionEncode, unCLIPConditioning, unCLIPCheckpointLoader)
LOADERS.update({node_type.type_name: node_type for node_type in (CLIPVisionLoader, unCLIPCheckpointLoader)})
