"""Model loader nodes with ComfyUI's names, inputs (in ComfyUI's order) and outputs.

Model-choice widgets list the files of the models folder. Validation reads the choices without a context,
so they come from the settings given to `configure` (or, until then, from `load_settings()`: flags are not
seen there, the environment and the settings file are); running nodes use the executor's settings.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.graph.spec import NodeType, Output, RunContext, combo_input
from engine.models.bundles import MissingComponent
from engine.models.loader import (
    ADD_LOADER_HINT,
    COMPONENT_NAMES,
    load_checkpoint,
    load_diffusion_model,
    load_text_encoders,
    load_vae,
)
from engine.settings import Settings, SettingsError, load_settings

COMPUTE_DEVICE = "auto"  # the memory-runtime issue replaces this with per-node backend inputs
WEIGHT_DTYPES = ("default", "fp32", "fp16", "bf16")
CLIP_TYPES = {"stable_diffusion": None, "sd1": "sd1", "sd2": "sd2", "sdxl_refiner": "sdxl_refiner"}
DUAL_CLIP_TYPES = {"sdxl": "sdxl"}

_settings: Settings | None = None


def configure(settings: Settings | None) -> None:
    """The settings whose models folder the model-choice widgets list (None: read them when asked)."""
    global _settings
    _settings = settings


def current_settings(settings: Settings | None = None) -> Settings:
    """`settings` when given, else the configured ones, else `load_settings()`."""
    return settings or _settings or load_settings()


def model_choices(kind: str) -> Callable[[], list[str]]:
    """The callable choice list of a model widget: the files of `kind` in the models folder."""
    def choices() -> list[str]:
        try:
            return current_settings().list_models(kind)
        except SettingsError:  # an unreadable settings file: no choices; running the node reports it
            return []

    return choices


def model_path(settings: Settings | None, kind: str, name: str) -> Path:
    return current_settings(settings).resolve_model(kind, name)


def file_fingerprint(*paths: Path) -> tuple:
    """What changes when a model file is replaced: its modification time and size."""
    return tuple((str(p), os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in paths)


def _missing(name: str, component: str, kind: str) -> MissingComponent:
    return MissingComponent(kind, f"checkpoint {name!r} has no {COMPONENT_NAMES[component]}; "
                                  f"{ADD_LOADER_HINT[component]} and connect its {kind} output")


class CheckpointLoaderSimple(NodeType):
    display_name = "Load Checkpoint"
    category = "loaders"
    description = "Loads a single-file SD1.x / SD2.x / SDXL checkpoint: diffusion model, text encoder, VAE."
    memory_module = "diffusion"
    inputs = (combo_input("ckpt_name", model_choices("checkpoints")),)
    outputs = (Output("MODEL", "MODEL"), Output("CLIP", "CLIP"), Output("VAE", "VAE"))

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, "checkpoints", widgets["ckpt_name"]))

    def run(self, ctx: RunContext, ckpt_name: str) -> tuple:
        path = model_path(ctx.settings, "checkpoints", ckpt_name)
        model, clip, vae = load_checkpoint(path, device=COMPUTE_DEVICE)
        return (model or _missing(ckpt_name, "diffusion", "MODEL"), clip or _missing(ckpt_name, "te", "CLIP"),
                vae or _missing(ckpt_name, "vae", "VAE"))


class UNETLoader(NodeType):
    display_name = "Load Diffusion Model"
    category = "advanced/loaders"
    description = "Loads a diffusion model (UNet) file from diffusion_models/ (or unet/)."
    memory_module = "diffusion"
    inputs = (combo_input("unet_name", model_choices("diffusion_models")),
              combo_input("weight_dtype", WEIGHT_DTYPES, "default"))
    outputs = (Output("MODEL", "MODEL"),)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, "diffusion_models", widgets["unet_name"]))

    def run(self, ctx: RunContext, unet_name: str, weight_dtype: str) -> tuple:
        path = model_path(ctx.settings, "diffusion_models", unet_name)
        return (load_diffusion_model(path, weight_dtype, device=COMPUTE_DEVICE),)


class CLIPLoader(NodeType):
    display_name = "Load CLIP"
    category = "advanced/loaders"
    description = ("Loads a text encoder file from text_encoders/ (or clip/); stable_diffusion tells SD1, "
                   "SD2 and the SDXL refiner apart by the encoder in the file.")
    memory_module = "te"
    inputs = (combo_input("clip_name", model_choices("text_encoders")),
              combo_input("type", tuple(CLIP_TYPES), "stable_diffusion"))
    outputs = (Output("CLIP", "CLIP"),)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, "text_encoders", widgets["clip_name"]))

    def run(self, ctx: RunContext, clip_name: str, type: str) -> tuple:
        path = model_path(ctx.settings, "text_encoders", clip_name)
        return (load_text_encoders([path], CLIP_TYPES[type], device=COMPUTE_DEVICE),)


class DualCLIPLoader(NodeType):
    display_name = "DualCLIPLoader"
    category = "advanced/loaders"
    description = "Loads SDXL's two text encoders (CLIP-L and OpenCLIP-bigG) from two files."
    memory_module = "te"
    inputs = (combo_input("clip_name1", model_choices("text_encoders")),
              combo_input("clip_name2", model_choices("text_encoders")),
              combo_input("type", tuple(DUAL_CLIP_TYPES), "sdxl"))
    outputs = (Output("CLIP", "CLIP"),)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(*(model_path(settings, "text_encoders", widgets[name])
                                  for name in ("clip_name1", "clip_name2")))

    def run(self, ctx: RunContext, clip_name1: str, clip_name2: str, type: str) -> tuple:
        paths = [model_path(ctx.settings, "text_encoders", name) for name in (clip_name1, clip_name2)]
        return (load_text_encoders(paths, DUAL_CLIP_TYPES[type], device=COMPUTE_DEVICE),)


class VAELoader(NodeType):
    display_name = "Load VAE"
    category = "loaders"
    description = "Loads a VAE file from vae/."
    memory_module = "vae"
    inputs = (combo_input("vae_name", model_choices("vae")),)
    outputs = (Output("VAE", "VAE"),)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, "vae", widgets["vae_name"]))

    def run(self, ctx: RunContext, vae_name: str) -> tuple:
        return (load_vae(model_path(ctx.settings, "vae", vae_name), device=COMPUTE_DEVICE),)


NODE_TYPES = (CheckpointLoaderSimple, UNETLoader, CLIPLoader, DualCLIPLoader, VAELoader)
