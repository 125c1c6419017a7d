"""Latent nodes with ComfyUI's names and input order: EmptyLatentImage, VAEDecode, VAEEncode.

LATENT is {"samples": [B, 4, h, w]} in the VAE's raw latent space, as in ComfyUI.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.graph.spec import NodeType, Output, RunContext, int_input, link_input
from engine.models.bundles import VAEModel, require

MAX_RESOLUTION = 16384
LATENT_CHANNELS = 4


def latent_samples(latent: Any) -> torch.Tensor:
    """The [B, C, h, w] tensor of a LATENT dict, with a clear error for anything else."""
    if not isinstance(latent, dict) or not isinstance(latent.get("samples"), torch.Tensor):
        raise ValueError(f"expected a LATENT ({{'samples': tensor}}), got {type(latent).__name__}")
    samples = latent["samples"]
    if samples.ndim != 4:
        raise ValueError(f"LATENT samples must be (batch, channels, height, width); "
                         f"got {tuple(samples.shape)}")
    return samples


class EmptyLatentImage(NodeType):
    display_name = "Empty Latent Image"
    category = "latent"
    description = "A batch of empty (zero) latents for an image of width x height pixels."
    inputs = (int_input("width", 512, min=16, max=MAX_RESOLUTION, step=8),
              int_input("height", 512, min=16, max=MAX_RESOLUTION, step=8),
              int_input("batch_size", 1, min=1, max=4096))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, width: int, height: int, batch_size: int) -> tuple:
        return ({"samples": torch.zeros(batch_size, LATENT_CHANNELS, height // 8, width // 8)},)


class VAEDecode(NodeType):
    display_name = "VAE Decode"
    category = "latent"
    description = "Decodes latents into images with the VAE."
    inputs = (link_input("samples", "LATENT"), link_input("vae", "VAE"))
    outputs = (Output("IMAGE", "IMAGE"),)

    def run(self, ctx: RunContext, samples: Any, vae: Any) -> tuple:
        return (require(vae, "VAE", VAEModel).decode(latent_samples(samples)),)


class VAEEncode(NodeType):
    display_name = "VAE Encode"
    category = "latent"
    description = "Encodes images into latents with the VAE (cropped to multiples of 8 pixels)."
    inputs = (link_input("pixels", "IMAGE"), link_input("vae", "VAE"))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, pixels: torch.Tensor, vae: Any) -> tuple:
        return ({"samples": require(vae, "VAE", VAEModel).encode(pixels)},)


NODE_TYPES = (EmptyLatentImage, VAEDecode, VAEEncode)
