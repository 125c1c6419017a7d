"""Mask nodes with ComfyUI's names, input order, defaults and results: LoadImageMask, ImageToMask,
MaskToImage, SolidMask, InvertMask, MaskComposite, GrowMask, FeatherMask.

MASK is [B, H, W] float32 (a [H, W] mask from elsewhere is taken as a batch of one). `composite` is ComfyUI's
paste of a source onto a destination through an optional mask, shared by LatentCompositeMasked (in latent
cells, 8 pixels each) and ImageCompositeMasked (in pixels).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps, UnidentifiedImageError

from engine.graph.spec import (
    NodeType,
    Output,
    RunContext,
    bool_input,
    combo_input,
    float_input,
    int_input,
    link_input,
    string_input,
)
from nodes.image import image_path
from nodes.latent import MAX_RESOLUTION

IMAGE_CHANNELS = ("red", "green", "blue", "alpha")  # ImageToMask's choices, in channel order
MASK_FILE_CHANNELS = ("alpha", "red", "green", "blue")  # LoadImageMask's choices (ComfyUI's order)
MASK_OPERATIONS = ("multiply", "add", "subtract", "and", "or", "xor")


def as_masks(mask: Any, name: str = "mask") -> torch.Tensor:
    """A MASK as [B, H, W]: [H, W] gains a batch of one; anything else is an error naming its shape."""
    if not isinstance(mask, torch.Tensor) or mask.ndim not in (2, 3):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{name}: expected a MASK of shape (B, H, W) or (H, W); got {shape}")
    return mask.reshape(-1, mask.shape[-2], mask.shape[-1])


def repeat_to_batch(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """The first `batch` items, the batch repeated as often as needed (ComfyUI's repeat_to_batch_size)."""
    if tensor.shape[0] == batch:
        return tensor
    repeats = -(-batch // tensor.shape[0])
    return tensor.repeat(repeats, *[1] * (tensor.ndim - 1))[:batch]


def composite(destination: torch.Tensor, source: torch.Tensor, x: int, y: int, mask: torch.Tensor | None,
              multiplier: int, resize_source: bool) -> torch.Tensor:
    """`source` [B', C, h, w] pasted into a copy of `destination` [B, C, H, W] at pixel (x, y), where one
    cell is `multiplier` pixels. The source batch repeats to the destination's; the mask [B'', H'', W''] is
    resized bilinearly to the source and blends source (1) with destination (0); parts outside are cut off."""
    destination = destination.clone()
    if resize_source:
        source = F.interpolate(source, size=destination.shape[2:], mode="bilinear")
    source = repeat_to_batch(source, destination.shape[0])
    x = max(-source.shape[3] * multiplier, min(x, destination.shape[3] * multiplier))
    y = max(-source.shape[2] * multiplier, min(y, destination.shape[2] * multiplier))
    left, top = x // multiplier, y // multiplier
    if mask is None:
        mask = torch.ones_like(source)
    else:
        mask = as_masks(mask).to(source.dtype)[:, None]
        mask = F.interpolate(mask, size=source.shape[2:], mode="bilinear")
        mask = repeat_to_batch(mask, source.shape[0])  # (B, 1, h, w): one weight for every channel
    visible_width = destination.shape[3] - left + min(0, x)
    visible_height = destination.shape[2] - top + min(0, y)
    if visible_width <= 0 or visible_height <= 0:
        return destination
    mask = mask[:, :, :visible_height, :visible_width]
    region = destination[:, :, top:top + source.shape[2], left:left + source.shape[3]]
    pasted = mask * source[:, :, :visible_height, :visible_width] + (1 - mask) * region
    destination[:, :, top:top + source.shape[2], left:left + source.shape[3]] = pasted
    return destination


def load_mask_file(path: Any, channel: str) -> torch.Tensor:
    """One channel of an image file's first frame as a [1, H, W] MASK; alpha is inverted (1 = transparent)."""
    if channel not in MASK_FILE_CHANNELS:
        raise ValueError(f"channel {channel!r} is not one of {', '.join(MASK_FILE_CHANNELS)}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"image file not found: {path}")
    try:
        with Image.open(path) as opened:
            image = ImageOps.exif_transpose(opened)
            if image.getbands() != ("R", "G", "B", "A"):
                if image.mode == "I":  # 16-bit greyscale
                    image = image.point(lambda value: value * (1 / 255))
                image = image.convert("RGBA")
            values = np.asarray(image.getchannel(channel[0].upper()), dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"cannot read image {path}: {error}") from None
    mask = torch.from_numpy(values.copy())
    return (1.0 - mask if channel == "alpha" else mask)[None]


class LoadImageMask(NodeType):
    display_name = "Load Image (as Mask)"
    category = "mask"
    description = ("Loads one channel of an image (a name in the input folder, or an absolute path) as a "
                   "mask; alpha is inverted as in LoadImage (1 where transparent).")
    inputs = (string_input("image", ""), combo_input("channel", MASK_FILE_CHANNELS, "alpha"))
    outputs = (Output("MASK", "MASK"),)
    input_files = ("image",)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        path = image_path(settings, widgets["image"])
        return (str(path), os.stat(path).st_mtime_ns, os.stat(path).st_size)

    def run(self, ctx: RunContext, image: str, channel: str) -> tuple:
        return (load_mask_file(image_path(ctx.settings, image), channel),)


class ImageToMask(NodeType):
    display_name = "Convert Image to Mask"
    category = "mask"
    description = "One channel of every image as a mask (alpha only for images that have one)."
    inputs = (link_input("image", "IMAGE"), combo_input("channel", IMAGE_CHANNELS, "red"))
    outputs = (Output("MASK", "MASK"),)

    def run(self, ctx: RunContext, image: torch.Tensor, channel: str) -> tuple:
        if not isinstance(image, torch.Tensor) or image.ndim != 4:
            shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
            raise ValueError(f"expected an IMAGE batch of shape (B, H, W, C); got {shape}")
        index = IMAGE_CHANNELS.index(channel)
        if index >= image.shape[-1]:
            raise ValueError(f"channel {channel!r}: the image has {image.shape[-1]} channels (no alpha)")
        return (image[..., index],)


class MaskToImage(NodeType):
    display_name = "Convert Mask to Image"
    category = "mask"
    description = "Every mask as a grey image (the mask in all three channels)."
    inputs = (link_input("mask", "MASK"),)
    outputs = (Output("IMAGE", "IMAGE"),)

    def run(self, ctx: RunContext, mask: torch.Tensor) -> tuple:
        return (as_masks(mask)[..., None].expand(-1, -1, -1, 3).contiguous(),)


class SolidMask(NodeType):
    category = "mask"
    description = "A mask of width x height filled with one value."
    inputs = (float_input("value", 1.0, min=0.0, max=1.0, step=0.01),
              int_input("width", 512, min=1, max=MAX_RESOLUTION),
              int_input("height", 512, min=1, max=MAX_RESOLUTION))
    outputs = (Output("MASK", "MASK"),)

    def run(self, ctx: RunContext, value: float, width: int, height: int) -> tuple:
        return (torch.full((1, height, width), value, dtype=torch.float32),)


class InvertMask(NodeType):
    category = "mask"
    description = "1 - mask."
    inputs = (link_input("mask", "MASK"),)
    outputs = (Output("MASK", "MASK"),)

    def run(self, ctx: RunContext, mask: torch.Tensor) -> tuple:
        return (1.0 - as_masks(mask),)


class MaskComposite(NodeType):
    category = "mask"
    description = ("Combines source into destination at (x, y): multiply, add, subtract, or the logical "
                   "and/or/xor of the rounded masks; the result is clamped to 0..1 and keeps the "
                   "destination's size (the source is cut off at its edges).")
    inputs = (link_input("destination", "MASK"), link_input("source", "MASK"),
              int_input("x", 0, min=0, max=MAX_RESOLUTION),
              int_input("y", 0, min=0, max=MAX_RESOLUTION),
              combo_input("operation", MASK_OPERATIONS, "multiply"))
    outputs = (Output("MASK", "MASK"),)

    def run(self, ctx: RunContext, destination: torch.Tensor, source: torch.Tensor, x: int, y: int,
            operation: str) -> tuple:
        output = as_masks(destination, "destination").clone()
        source = as_masks(source, "source")
        if source.shape[0] not in (1, output.shape[0]):
            raise ValueError(f"source has {source.shape[0]} masks, destination {output.shape[0]}; the source "
                             f"needs 1 or the same number")
        right = min(x + source.shape[2], output.shape[2])
        bottom = min(y + source.shape[1], output.shape[1])
        if right <= x or bottom <= y:
            return (output.clamp(0.0, 1.0),)
        part = source[:, :bottom - y, :right - x]
        region = output[:, y:bottom, x:right]
        if operation == "multiply":
            result = region * part
        elif operation == "add":
            result = region + part
        elif operation == "subtract":
            result = region - part
        elif operation in ("and", "or", "xor"):
            logical = {"and": torch.logical_and, "or": torch.logical_or, "xor": torch.logical_xor}[operation]
            result = logical(region.round().bool(), part.round().bool()).float()
        else:
            raise ValueError(f"operation {operation!r} is not one of {', '.join(MASK_OPERATIONS)}")
        output[:, y:bottom, x:right] = result
        return (output.clamp(0.0, 1.0),)


def _grow_once(masks: torch.Tensor, grow: bool, tapered_corners: bool) -> torch.Tensor:
    """One step of grey dilation (grow) or erosion over a 3x3 neighbourhood, the corners left out when
    tapered; edges repeat outward (scipy.ndimage's default 'reflect' border, as ComfyUI uses)."""
    height, width = masks.shape[1:]
    padded = F.pad(masks[:, None], (1, 1, 1, 1), mode="replicate")[:, 0]  # (B, H + 2, W + 2)
    offsets = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if not (tapered_corners and dy and dx)]
    shifted = torch.stack([padded[:, 1 + dy:1 + dy + height, 1 + dx:1 + dx + width] for dy, dx in offsets])
    return shifted.amax(dim=0) if grow else shifted.amin(dim=0)


class GrowMask(NodeType):
    category = "mask"
    description = ("Grows (expand > 0) or shrinks (expand < 0) masks by |expand| pixels, one grey "
                   "dilation or erosion per pixel; tapered_corners leaves the diagonal neighbours out.")
    inputs = (link_input("mask", "MASK"),
              int_input("expand", 0, min=-MAX_RESOLUTION, max=MAX_RESOLUTION),
              bool_input("tapered_corners", True))
    outputs = (Output("MASK", "MASK"),)

    def run(self, ctx: RunContext, mask: torch.Tensor, expand: int, tapered_corners: bool) -> tuple:
        masks = as_masks(mask).float()
        for _ in range(abs(expand)):
            ctx.check_interrupt()
            masks = _grow_once(masks, expand > 0, tapered_corners)
        return (masks,)


class FeatherMask(NodeType):
    category = "mask"
    description = ("Fades the mask linearly towards each edge over the given number of pixels. As in "
                   "ComfyUI, the right and bottom ramps are indexed from -0: their first step (1 / n) falls "
                   "on the left column and top row, and the outermost right column and bottom row get 2 / n.")
    inputs = (link_input("mask", "MASK"),
              int_input("left", 0, min=0, max=MAX_RESOLUTION),
              int_input("top", 0, min=0, max=MAX_RESOLUTION),
              int_input("right", 0, min=0, max=MAX_RESOLUTION),
              int_input("bottom", 0, min=0, max=MAX_RESOLUTION))
    outputs = (Output("MASK", "MASK"),)

    def run(self, ctx: RunContext, mask: torch.Tensor, left: int, top: int, right: int, bottom: int) -> tuple:
        output = as_masks(mask).clone()
        height, width = output.shape[1:]
        left, right = min(left, width), min(right, width)
        top, bottom = min(top, height), min(bottom, height)
        for i in range(left):
            output[:, :, i] *= (i + 1) / left
        for i in range(right):
            output[:, :, -i] *= (i + 1) / right  # -0 is column 0: ComfyUI's indexing, kept for parity
        for i in range(top):
            output[:, i, :] *= (i + 1) / top
        for i in range(bottom):
            output[:, -i, :] *= (i + 1) / bottom
        return (output,)


NODE_TYPES = (LoadImageMask, ImageToMask, MaskToImage, SolidMask, InvertMask, MaskComposite, GrowMask,
              FeatherMask)
