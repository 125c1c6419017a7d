"""Image operations with ComfyUI's names, input order, defaults and results: ImageInvert, ImageBatch,
ImageCrop, EmptyImage, ImageCompositeMasked, ImageScaleToTotalPixels, ImagePadForOutpaint.

IMAGE is [B, H, W, 3] float32 in 0..1 (ImageCompositeMasked also takes 4-channel images, as ComfyUI does).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.graph.spec import (
    NodeType,
    Output,
    RunContext,
    bool_input,
    combo_input,
    float_input,
    int_input,
    link_input,
)
from engine.resize import IMAGE_METHODS, resize
from nodes.latent import MAX_RESOLUTION
from nodes.masks import composite

OUTPAINT_GREY = 0.5  # the value of the padding ImagePadForOutpaint adds


def images_of(image: Any, name: str = "image") -> torch.Tensor:
    if not isinstance(image, torch.Tensor) or image.ndim != 4:
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(f"{name}: expected an IMAGE batch of shape (B, H, W, C); got {shape}")
    return image


def resize_images(image: torch.Tensor, width: int, height: int, method: str, crop: str) -> torch.Tensor:
    return resize(image.movedim(-1, 1), width, height, method, crop).movedim(1, -1).contiguous()


class ImageInvert(NodeType):
    display_name = "Invert Image"
    category = "image"
    description = "1 - image."
    inputs = (link_input("image", "IMAGE"),)
    outputs = (Output("IMAGE", "IMAGE"),)

    def run(self, ctx: RunContext, image: torch.Tensor) -> tuple:
        return (1.0 - images_of(image),)


class ImageBatch(NodeType):
    display_name = "Batch Images"
    category = "image"
    description = ("image1's batch followed by image2's; image2 is first resized (bilinear, centre crop) to "
                   "image1's size when the sizes differ.")
    inputs = (link_input("image1", "IMAGE"), link_input("image2", "IMAGE"))
    outputs = (Output("IMAGE", "IMAGE"),)

    def run(self, ctx: RunContext, image1: torch.Tensor, image2: torch.Tensor) -> tuple:
        image1, image2 = images_of(image1, "image1"), images_of(image2, "image2")
        if image1.shape[-1] != image2.shape[-1]:
            raise ValueError(f"image1 has {image1.shape[-1]} channels, image2 {image2.shape[-1]}; "
                             f"a batch needs the same number")
        if image1.shape[1:] != image2.shape[1:]:
            image2 = resize_images(image2, image1.shape[2], image1.shape[1], "bilinear", "center")
        return (torch.cat((image1, image2)),)


class ImageCrop(NodeType):
    category = "image/transform"
    description = ("The width x height region at (x, y); x and y beyond the image are moved to its last "
                   "column and row, and the region is cut off at the image's edges.")
    inputs = (link_input("image", "IMAGE"),
              int_input("width", 512, min=1, max=MAX_RESOLUTION),
              int_input("height", 512, min=1, max=MAX_RESOLUTION),
              int_input("x", 0, min=0, max=MAX_RESOLUTION),
              int_input("y", 0, min=0, max=MAX_RESOLUTION))
    outputs = (Output("IMAGE", "IMAGE"),)

    def run(self, ctx: RunContext, image: torch.Tensor, width: int, height: int, x: int, y: int) -> tuple:
        image = images_of(image)
        x, y = min(x, image.shape[2] - 1), min(y, image.shape[1] - 1)
        return (image[:, y:y + height, x:x + width, :],)


class EmptyImage(NodeType):
    category = "image"
    description = "A batch of images of one colour (0xRRGGBB)."
    inputs = (int_input("width", 512, min=1, max=MAX_RESOLUTION),
              int_input("height", 512, min=1, max=MAX_RESOLUTION),
              int_input("batch_size", 1, min=1, max=4096),
              int_input("color", 0, min=0, max=0xFFFFFF))
    outputs = (Output("IMAGE", "IMAGE"),)

    def run(self, ctx: RunContext, width: int, height: int, batch_size: int = 1, color: int = 0) -> tuple:
        channels = [(color >> 16) & 0xFF, (color >> 8) & 0xFF, color & 0xFF]
        rgb = torch.tensor(channels, dtype=torch.float32) / 0xFF
        return (rgb.expand(batch_size, height, width, 3).contiguous(),)


class ImageCompositeMasked(NodeType):
    category = "image"
    description = ("Pastes source onto destination at (x, y) through the optional mask (resized to the "
                   "source); resize_source first scales the source to the destination's size. The source "
                   "batch repeats to the destination's; a 4-channel source loses its alpha over a 3-channel "
                   "destination, and a 3-channel source gains an opaque alpha over a 4-channel one.")
    inputs = (link_input("destination", "IMAGE"), link_input("source", "IMAGE"),
              int_input("x", 0, min=0, max=MAX_RESOLUTION),
              int_input("y", 0, min=0, max=MAX_RESOLUTION),
              bool_input("resize_source", False),
              link_input("mask", "MASK", optional=True))
    outputs = (Output("IMAGE", "IMAGE"),)

    def run(self, ctx: RunContext, destination: torch.Tensor, source: torch.Tensor, x: int, y: int,
            resize_source: bool, mask: torch.Tensor | None = None) -> tuple:
        destination, source = images_of(destination, "destination"), images_of(source, "source")
        if destination.shape[-1] < source.shape[-1]:
            source = source[..., :destination.shape[-1]]
        elif destination.shape[-1] > source.shape[-1]:
            source = torch.nn.functional.pad(source, (0, 1), value=1.0)
        result = composite(destination.movedim(-1, 1), source.movedim(-1, 1), x, y, mask, 1, resize_source)
        return (result.movedim(1, -1).contiguous(),)


class ImageScaleToTotalPixels(NodeType):
    display_name = "Scale Image to Total Pixels"
    category = "image/upscaling"
    description = ("Resizes images to about `megapixels` x 1024 x 1024 pixels keeping the aspect ratio; "
                   "each side is rounded to a multiple of resolution_steps.")
    inputs = (link_input("image", "IMAGE"),
              combo_input("upscale_method", IMAGE_METHODS, "nearest-exact"),
              float_input("megapixels", 1.0, min=0.01, max=16.0, step=0.01),
              int_input("resolution_steps", 1, min=1, max=256))
    outputs = (Output("IMAGE", "IMAGE"),)

    def run(self, ctx: RunContext, image: torch.Tensor, upscale_method: str, megapixels: float,
            resolution_steps: int = 1) -> tuple:
        image = images_of(image)
        height, width = image.shape[1:3]
        scale_by = math.sqrt(int(megapixels * 1024 * 1024) / (width * height))
        new_width = round(width * scale_by / resolution_steps) * resolution_steps
        new_height = round(height * scale_by / resolution_steps) * resolution_steps
        if new_width < 1 or new_height < 1:
            raise ValueError(f"{megapixels} megapixels of a {width}x{height} image in steps of "
                             f"{resolution_steps} is {new_width}x{new_height}: no pixels left")
        return (resize_images(image, new_width, new_height, upscale_method, "disabled"),)


def outpaint_mask(height: int, width: int, left: int, top: int, right: int, bottom: int,
                  feathering: int) -> torch.Tensor:
    """The [height, width] part of ImagePadForOutpaint's mask over the original image: ((f - d) / f)^2 within
    `feathering` pixels of a padded side (d: the distance to the nearest padded side), else 0."""
    inside = torch.zeros(height, width)
    if not (feathering > 0 and feathering * 2 < height and feathering * 2 < width):
        return inside
    rows = torch.arange(height)[:, None].expand(height, width)
    cols = torch.arange(width)[None, :].expand(height, width)
    distances = torch.stack([rows if top else torch.full_like(rows, height),
                             height - rows if bottom else torch.full_like(rows, height),
                             cols if left else torch.full_like(cols, width),
                             width - cols if right else torch.full_like(cols, width)]).amin(dim=0)
    ramp = ((feathering - distances) / feathering) ** 2
    return torch.where(distances < feathering, ramp, inside).float()


class ImagePadForOutpaint(NodeType):
    display_name = "Pad Image for Outpainting"
    category = "image"
    description = ("Pads images with grey (0.5) on each side; the mask is 1 over the padding and fades "
                   "quadratically over `feathering` pixels into the image (no fade when feathering is at "
                   "least half the image's width or height).")
    inputs = (link_input("image", "IMAGE"),
              int_input("left", 0, min=0, max=MAX_RESOLUTION, step=8),
              int_input("top", 0, min=0, max=MAX_RESOLUTION, step=8),
              int_input("right", 0, min=0, max=MAX_RESOLUTION, step=8),
              int_input("bottom", 0, min=0, max=MAX_RESOLUTION, step=8),
              int_input("feathering", 40, min=0, max=MAX_RESOLUTION))
    outputs = (Output("IMAGE", "IMAGE"), Output("MASK", "MASK"))

    def run(self, ctx: RunContext, image: torch.Tensor, left: int, top: int, right: int, bottom: int,
            feathering: int) -> tuple:
        image = images_of(image)
        batch, height, width, channels = image.shape
        padded = torch.full((batch, height + top + bottom, width + left + right, channels), OUTPAINT_GREY)
        padded[:, top:top + height, left:left + width] = image
        mask = torch.ones(height + top + bottom, width + left + right)
        mask[top:top + height, left:left + width] = outpaint_mask(height, width, left, top, right, bottom,
                                                                  feathering)
        return (padded, mask[None])


NODE_TYPES = (ImageInvert, ImageBatch, ImageCrop, EmptyImage, ImageCompositeMasked, ImageScaleToTotalPixels,
              ImagePadForOutpaint)
