"""Upscaling nodes with ComfyUI's names, input order and defaults: UpscaleModelLoader, ImageUpscaleWithModel,
ImageScale, ImageScaleBy, LatentUpscale, LatentUpscaleBy.

UpscaleModelLoader carries a `backend` input (appended after ComfyUI's inputs): the compute device of the
memory runtime's module `upscaler`.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.graph.spec import (
    NodeType,
    Output,
    RunContext,
    combo_input,
    float_input,
    int_input,
    link_input,
    string_input,
)
from engine.models.upscaler import MEMORY_MODULE, UpscaleModel, load_upscale_model
from engine.resize import CROP_MODES, IMAGE_METHODS, LATENT_METHODS, resize, target_size
from nodes.latent import MAX_RESOLUTION, latent_samples
from nodes.loaders import file_fingerprint, model_choices, model_path

MIN_LATENT_PIXELS = 64  # LatentUpscale's smallest side in pixels (ComfyUI)


def _images(image: Any) -> torch.Tensor:
    if not isinstance(image, torch.Tensor) or image.ndim != 4:
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(f"expected an IMAGE batch of shape (B, H, W, C); got {shape}")
    return image


def _resize_image(image: torch.Tensor, method: str, width: int, height: int, crop: str) -> torch.Tensor:
    samples = _images(image).movedim(-1, 1)  # (B, C, H, W)
    return resize(samples, width, height, method, crop).movedim(1, -1).contiguous()


class UpscaleModelLoader(NodeType):
    display_name = "Load Upscale Model"
    category = "loaders"
    description = ("Loads an upscaler (ESRGAN, Real-ESRGAN, SwinIR, HAT, DAT, OmniSR, SPAN, ...) from "
                   "upscale_models/; backend is its compute device (auto, cpu, cuda0, ...).")
    memory_module = MEMORY_MODULE
    inputs = (combo_input("model_name", model_choices("upscale_models")),
              string_input("backend", "auto"))
    outputs = (Output("UPSCALE_MODEL", "UPSCALE_MODEL"),)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, "upscale_models", widgets["model_name"]))

    def run(self, ctx: RunContext, model_name: str, backend: str = "auto") -> tuple:
        return (load_upscale_model(model_path(ctx.settings, "upscale_models", model_name), backend),)


class ImageUpscaleWithModel(NodeType):
    display_name = "Upscale Image (using Model)"
    category = "image/upscaling"
    description = ("Upscales images with an upscale model, in 512 px tiles overlapping by 32 px (halved "
                   "down to 128 px when a tile runs out of memory).")
    inputs = (link_input("upscale_model", "UPSCALE_MODEL"), link_input("image", "IMAGE"))
    outputs = (Output("IMAGE", "IMAGE"),)

    def run(self, ctx: RunContext, upscale_model: Any, image: torch.Tensor) -> tuple:
        if not isinstance(upscale_model, UpscaleModel):
            raise ValueError(f"expected an UPSCALE_MODEL input, got {type(upscale_model).__name__}")
        return (upscale_model.upscale(_images(image), check_interrupt=ctx.check_interrupt,
                                      on_progress=ctx.report_progress),)


class ImageScale(NodeType):
    display_name = "Upscale Image"
    category = "image/upscaling"
    description = "Resizes images to width x height (0 for one side keeps the aspect ratio)."
    inputs = (link_input("image", "IMAGE"),
              combo_input("upscale_method", IMAGE_METHODS, "nearest-exact"),
              int_input("width", 512, min=0, max=MAX_RESOLUTION),
              int_input("height", 512, min=0, max=MAX_RESOLUTION),
              combo_input("crop", CROP_MODES, "disabled"))
    outputs = (Output("IMAGE", "IMAGE"),)

    def run(self, ctx: RunContext, image: torch.Tensor, upscale_method: str, width: int, height: int,
            crop: str) -> tuple:
        if width == 0 and height == 0:
            return (_images(image),)
        width, height = target_size(width, height, image.shape[2], image.shape[1])
        return (_resize_image(image, upscale_method, width, height, crop),)


class ImageScaleBy(NodeType):
    display_name = "Upscale Image By"
    category = "image/upscaling"
    description = "Resizes images by a factor."
    inputs = (link_input("image", "IMAGE"),
              combo_input("upscale_method", IMAGE_METHODS, "nearest-exact"),
              float_input("scale_by", 1.0, min=0.01, max=8.0, step=0.01))
    outputs = (Output("IMAGE", "IMAGE"),)

    def run(self, ctx: RunContext, image: torch.Tensor, upscale_method: str, scale_by: float) -> tuple:
        height, width = _images(image).shape[1:3]
        size = max(1, round(width * scale_by)), max(1, round(height * scale_by))
        return (_resize_image(image, upscale_method, *size, "disabled"),)


class LatentUpscale(NodeType):
    display_name = "Upscale Latent"
    category = "latent"
    description = "Resizes latents to width x height pixels (0 for one side keeps the aspect ratio)."
    inputs = (link_input("samples", "LATENT"),
              combo_input("upscale_method", LATENT_METHODS, "nearest-exact"),
              int_input("width", 512, min=0, max=MAX_RESOLUTION, step=8),
              int_input("height", 512, min=0, max=MAX_RESOLUTION, step=8),
              combo_input("crop", CROP_MODES, "disabled"))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, samples: Any, upscale_method: str, width: int, height: int,
            crop: str) -> tuple:
        latent = latent_samples(samples)
        if width == 0 and height == 0:
            return (samples,)
        width, height = (max(MIN_LATENT_PIXELS, side) if side else 0 for side in (width, height))
        width, height = target_size(width, height, latent.shape[3], latent.shape[2])
        width, height = max(MIN_LATENT_PIXELS, width), max(MIN_LATENT_PIXELS, height)
        return ({**samples, "samples": resize(latent, width // 8, height // 8, upscale_method, crop)},)


class LatentUpscaleBy(NodeType):
    display_name = "Upscale Latent By"
    category = "latent"
    description = "Resizes latents by a factor."
    inputs = (link_input("samples", "LATENT"),
              combo_input("upscale_method", LATENT_METHODS, "nearest-exact"),
              float_input("scale_by", 1.5, min=0.01, max=8.0, step=0.01))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, samples: Any, upscale_method: str, scale_by: float) -> tuple:
        latent = latent_samples(samples)
        size = max(1, round(latent.shape[3] * scale_by)), max(1, round(latent.shape[2] * scale_by))
        return ({**samples, "samples": resize(latent, *size, upscale_method)},)


NODE_TYPES = (UpscaleModelLoader, ImageUpscaleWithModel, ImageScale, ImageScaleBy, LatentUpscale,
              LatentUpscaleBy)
