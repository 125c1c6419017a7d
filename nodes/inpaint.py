"""Inpainting nodes with ComfyUI's names, inputs, defaults and outputs: VAEEncodeForInpaint and
InpaintModelConditioning.

Both resize the mask bilinearly to the image, crop image and mask centrally to whole latent cells, and grey
out (0.5) the pixels the rounded mask covers before encoding. VAEEncodeForInpaint encodes only that image and
gives the LATENT a noise mask grown by `grow_mask_by` pixels (a box filter of that size over the rounded
mask, clamped to 0..1, rounded), for any model. InpaintModelConditioning is for inpainting models (9-channel
UNets): it encodes the whole image as the LATENT (with the mask, unrounded, as noise mask when
`noise_mask`), and puts the greyed image's latent and the mask into both conditionings as
concat_latent_image and concat_mask, which the sampler feeds to such a UNet (nodes/sampling.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from engine.graph.spec import NodeType, Output, RunContext, bool_input, int_input, link_input
from engine.models.bundles import VAEModel, require
from nodes.masks import as_masks

GREY = 0.5  # the value of masked pixels before encoding


def masked_pixels(pixels: torch.Tensor, mask: Any, cell: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(greyed pixels, mask (B, 1, H', W')): the MASK resized bilinearly to the IMAGE [B, H, W, C], both cut
    centrally to multiples of `cell` pixels, and the pixels under the rounded mask set to GREY."""
    if not isinstance(pixels, torch.Tensor) or pixels.ndim != 4:
        shown = tuple(pixels.shape) if isinstance(pixels, torch.Tensor) else type(pixels).__name__
        raise ValueError(f"pixels: expected an IMAGE of shape (B, H, W, C); got {shown}")
    height, width = (pixels.shape[1] // cell) * cell, (pixels.shape[2] // cell) * cell
    if not height or not width:
        raise ValueError(f"an image of {pixels.shape[2]}x{pixels.shape[1]} pixels is too small to encode; "
                         f"accepted: at least {cell}x{cell}")
    mask = F.interpolate(as_masks(mask)[:, None].float(), size=pixels.shape[1:3], mode="bilinear")
    top, left = (pixels.shape[1] % cell) // 2, (pixels.shape[2] % cell) // 2
    pixels = pixels[:, top:top + height, left:left + width, :].clone()
    mask = mask[:, :, top:top + height, left:left + width]
    keep = (1.0 - mask.round()).squeeze(1)  # (B, H', W')
    pixels[..., :3] = (pixels[..., :3] - GREY) * keep[..., None] + GREY
    return pixels, mask


def grow_mask(mask: torch.Tensor, grow_by: int) -> torch.Tensor:
    """The rounded (B, 1, H, W) mask dilated by a grow_by x grow_by box (ComfyUI's grow_mask_by)."""
    if grow_by == 0:
        return mask.round()
    padding = math.ceil((grow_by - 1) / 2)
    kernel = torch.ones(1, 1, grow_by, grow_by, dtype=mask.dtype)
    grown = torch.clamp(F.conv2d(mask.round(), kernel, padding=padding), 0, 1)  # even sizes: one more row
    return grown[:, :, :mask.shape[2], :mask.shape[3]].round()


class VAEEncodeForInpaint(NodeType):
    display_name = "VAE Encode (for Inpainting)"
    category = "latent/inpaint"
    description = ("Encodes the image with the masked part greyed out, and sets the mask, grown by a few "
                   "pixels, as the latent's noise mask: sampling then repaints only the masked part.")
    inputs = (link_input("pixels", "IMAGE"),
              link_input("vae", "VAE"),
              link_input("mask", "MASK"),
              int_input("grow_mask_by", 6, min=0, max=64))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, pixels: torch.Tensor, vae: Any, mask: Any, grow_mask_by: int) -> tuple:
        vae = require(vae, "VAE", VAEModel)
        greyed, cut_mask = masked_pixels(pixels, mask, vae.downscale)
        return ({"samples": vae.encode(greyed), "noise_mask": grow_mask(cut_mask, grow_mask_by)},)


class InpaintModelConditioning(NodeType):
    display_name = "InpaintModelConditioning"
    category = "conditioning/inpaint"
    description = ("For inpainting models: puts the masked image's latent and the mask into both "
                   "conditionings, and encodes the whole image as the latent, with the mask as its noise "
                   "mask when noise_mask is on.")
    inputs = (link_input("positive", "CONDITIONING"),
              link_input("negative", "CONDITIONING"),
              link_input("vae", "VAE"),
              link_input("pixels", "IMAGE"),
              link_input("mask", "MASK"),
              bool_input("noise_mask", True,
                         description="a noise mask on the latent: sampling happens only within the mask"))
    outputs = (Output("positive", "CONDITIONING"), Output("negative", "CONDITIONING"),
               Output("latent", "LATENT"))

    def run(self, ctx: RunContext, positive: Any, negative: Any, vae: Any, pixels: torch.Tensor, mask: Any,
            noise_mask: bool) -> tuple:
        vae = require(vae, "VAE", VAEModel)
        greyed, cut_mask = masked_pixels(pixels, mask, vae.downscale)
        concat_latent = vae.encode(greyed)
        latent = {"samples": vae.encode(pixels)}
        if noise_mask:
            latent["noise_mask"] = cut_mask
        values = {"concat_latent_image": concat_latent, "concat_mask": cut_mask}
        conditionings = ([[context, {**extras, **values}] for context, extras in conditioning]
                         for conditioning in (positive, negative))
        return (*conditionings, latent)


NODE_TYPES = (VAEEncodeForInpaint, InpaintModelConditioning)
