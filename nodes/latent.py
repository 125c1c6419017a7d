"""Latent nodes with ComfyUI's names and input order: EmptyLatentImage, EmptySD3LatentImage, VAEDecode,
VAEEncode and their tiled variants.

LATENT is {"samples": [B, C, h, w]} in the VAE's raw latent space, as in ComfyUI (C = 4 for SD1/SD2/SDXL,
16 for SD3 and FLUX; each empty-latent node says its C). VAEDecode and VAEEncode
tile as the memory settings' vae_tiling says (on, off, auto: reference/004's relative tile size 5 with 25 %
overlap), and any decode or encode that runs out of memory retries in half-size tiles. The Tiled nodes take
ComfyUI's absolute tile size and overlap in pixels (the temporal inputs are for video VAEs and unused).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engine.graph.spec import NodeType, Output, RunContext, int_input, link_input
from engine.memory.runtime import get_runtime
from engine.memory.vae_tiling import TilingConfig
from engine.models.bundles import VAEModel, require
from engine.models.vae import AttnBlock, Downsample, ResnetBlock, Upsample

MAX_RESOLUTION = 16384
SD_LATENT_CHANNELS = 4
SD3_LATENT_CHANNELS = 16  # SD3 and FLUX


def latent_samples(latent: Any) -> torch.Tensor:
    """The [B, C, h, w] tensor of a LATENT dict, with a clear error for anything else."""
    if not isinstance(latent, dict) or not isinstance(latent.get("samples"), torch.Tensor):
        raise ValueError(f"expected a LATENT ({{'samples': tensor}}), got {type(latent).__name__}")
    samples = latent["samples"]
    if samples.ndim != 4:
        raise ValueError(f"LATENT samples must be (batch, channels, height, width); "
                         f"got {tuple(samples.shape)}")
    return samples


def empty_latent(batch_size: int, channels: int, width: int, height: int) -> dict[str, torch.Tensor]:
    """A LATENT of zeros for width x height pixels: (batch_size, channels, height // 8, width // 8)."""
    return {"samples": torch.zeros(batch_size, channels, height // 8, width // 8)}


INTERRUPT_POINTS = (ResnetBlock, AttnBlock, Upsample, Downsample)  # the VAE blocks a job may stop before


@contextmanager
def interruptible(vae: VAEModel, check_interrupt: Callable[[], None]) -> Iterator[VAEModel]:
    """While inside, every block of `vae`'s autoencoder (resnet, attention, up/downsample; each tile's too)
    calls `check_interrupt` before it runs, so an interrupted job leaves a decode within one block (about a
    second at 1024x1024 on a CPU) instead of finishing it (tens of seconds)."""
    handles = [module.register_forward_pre_hook(lambda module, args: check_interrupt())
               for module in vae.autoencoder.modules() if isinstance(module, INTERRUPT_POINTS)]
    try:
        yield vae
    finally:
        for handle in handles:
            handle.remove()


class EmptyLatentImage(NodeType):
    display_name = "Empty Latent Image"
    category = "latent"
    description = "A batch of empty (zero) latents for an image of width x height pixels."
    inputs = (int_input("width", 512, min=16, max=MAX_RESOLUTION, step=8),
              int_input("height", 512, min=16, max=MAX_RESOLUTION, step=8),
              int_input("batch_size", 1, min=1, max=4096))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, width: int, height: int, batch_size: int) -> tuple:
        return (empty_latent(batch_size, SD_LATENT_CHANNELS, width, height),)


class EmptySD3LatentImage(NodeType):
    category = "latent/sd3"
    description = "A batch of empty (zero) 16-channel latents, for SD3 and FLUX, of width x height pixels."
    inputs = (int_input("width", 1024, min=16, max=MAX_RESOLUTION, step=16),
              int_input("height", 1024, min=16, max=MAX_RESOLUTION, step=16),
              int_input("batch_size", 1, min=1, max=4096))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, width: int, height: int, batch_size: int) -> tuple:
        return (empty_latent(batch_size, SD3_LATENT_CHANNELS, width, height),)


class VAEDecode(NodeType):
    display_name = "VAE Decode"
    category = "latent"
    description = "Decodes latents into images with the VAE."
    inputs = (link_input("samples", "LATENT"), link_input("vae", "VAE"))
    outputs = (Output("IMAGE", "IMAGE"),)

    def run(self, ctx: RunContext, samples: Any, vae: Any) -> tuple:
        with interruptible(require(vae, "VAE", VAEModel), ctx.check_interrupt) as model:
            return (model.decode(latent_samples(samples), settings_tiling()),)


class VAEEncode(NodeType):
    display_name = "VAE Encode"
    category = "latent"
    description = "Encodes images into latents with the VAE (cropped to multiples of 8 pixels)."
    inputs = (link_input("pixels", "IMAGE"), link_input("vae", "VAE"))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, pixels: torch.Tensor, vae: Any) -> tuple:
        with interruptible(require(vae, "VAE", VAEModel), ctx.check_interrupt) as model:
            return ({"samples": model.encode(pixels, settings_tiling())},)


def settings_tiling() -> TilingConfig:
    """The tiling mode of the memory settings (workflow file, then `--vae-tiling`)."""
    return TilingConfig(get_runtime().settings.vae_tiling)


def tiled_inputs() -> tuple:
    return (int_input("tile_size", 512, min=64, max=4096, step=32, description="tile side in pixels"),
            int_input("overlap", 64, min=0, max=4096, step=32, description="pixels shared by neighbours"),
            int_input("temporal_size", 64, min=8, max=4096, step=4, description="video VAEs only (unused)"),
            int_input("temporal_overlap", 8, min=4, max=4096, step=4, description="video VAEs only (unused)"))


def absolute_tiling(vae: VAEModel, tile_size: int, overlap: int) -> TilingConfig:
    """ComfyUI's pixel tile size and overlap as a TilingConfig in latent cells."""
    if overlap * 2 > tile_size:
        raise ValueError(f"overlap {overlap} is more than half the tile size {tile_size}; "
                         f"accepted: 0 to {tile_size // 2} pixels")
    return TilingConfig("on", tile_size=max(1, tile_size // vae.downscale), overlap=overlap / tile_size)


class VAEDecodeTiled(NodeType):
    display_name = "VAE Decode (Tiled)"
    category = "_for_testing"
    description = "Decodes latents in overlapping tiles, feather-blended: a lower memory peak, more time."
    inputs = (link_input("samples", "LATENT"), link_input("vae", "VAE"), *tiled_inputs())
    outputs = (Output("IMAGE", "IMAGE"),)

    def run(self, ctx: RunContext, samples: Any, vae: Any, tile_size: int, overlap: int,
            temporal_size: int = 64, temporal_overlap: int = 8) -> tuple:
        vae = require(vae, "VAE", VAEModel)
        with interruptible(vae, ctx.check_interrupt):
            return (vae.decode(latent_samples(samples), absolute_tiling(vae, tile_size, overlap)),)


class VAEEncodeTiled(NodeType):
    display_name = "VAE Encode (Tiled)"
    category = "_for_testing"
    description = "Encodes images in overlapping tiles, feather-blended: a lower memory peak, more time."
    inputs = (link_input("pixels", "IMAGE"), link_input("vae", "VAE"), *tiled_inputs())
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, pixels: torch.Tensor, vae: Any, tile_size: int, overlap: int,
            temporal_size: int = 64, temporal_overlap: int = 8) -> tuple:
        vae = require(vae, "VAE", VAEModel)
        with interruptible(vae, ctx.check_interrupt):
            return ({"samples": vae.encode(pixels, absolute_tiling(vae, tile_size, overlap))},)


NODE_TYPES = (EmptyLatentImage, EmptySD3LatentImage, VAEDecode, VAEEncode, VAEDecodeTiled, VAEEncodeTiled)
