"""Images in and out: PIL <-> ComfyUI IMAGE tensors, PNGs that carry their workflow, masks from alpha.

IMAGE is [B, H, W, 3] float32 in 0..1; MASK is [B, H, W] with 1 where ComfyUI masks (1 - alpha). A saved PNG
holds three text chunks: ComfyUI's two, "workflow" (the UI-format workflow ComfyUI's Load and drag-and-drop
read) and "prompt" (the API-format prompt), both written by engine/graph/comfy_export.py, and Sluice's own
document under "sluice-workflow" (which engine/graph/interchange.py reads first). PNGs of earlier Sluice
versions hold the Sluice document under "workflow"; interchange tells the two apart by its "format" field.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, ImageSequence, PngImagePlugin, UnidentifiedImageError

from engine.new_files import create_file

SLUICE_CHUNK = "sluice-workflow"
WORKFLOW_CHUNK = "workflow"
PROMPT_CHUNK = "prompt"
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def tensor_to_pil(image: torch.Tensor) -> Image.Image:
    """One IMAGE item [H, W, 3] (or [H, W, 4]) in 0..1 -> an 8-bit RGB(A) PIL image.

    Levels are ComfyUI's SaveImage's: 255 * x in float32, clipped to 0..255, truncated (0.999 -> 254).
    """
    if image.ndim != 3 or image.shape[-1] not in (3, 4):
        raise ValueError(f"expected one image of shape (H, W, 3); got {tuple(image.shape)}")
    array = (image.detach().float().cpu() * 255.0).clamp(0, 255).to(torch.uint8).numpy()  # truncates
    return Image.fromarray(array, "RGB" if array.shape[-1] == 3 else "RGBA")


def pil_to_tensor(image: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
    """A PIL image -> (IMAGE [1, H, W, 3], MASK [1, H, W] = 1 - alpha, zeros without alpha)."""
    if image.mode == "I":  # 16-bit greyscale PNGs
        image = image.point(lambda value: value * (1 / 255))
    has_alpha = "A" in image.getbands() or (image.mode == "P" and "transparency" in image.info)
    if image.mode == "P" and has_alpha:
        image = image.convert("RGBA")
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0  # (H, W, 3)
    if has_alpha:
        alpha = np.asarray(image.getchannel("A"), dtype=np.float32) / 255.0  # (H, W)
        mask = 1.0 - torch.from_numpy(alpha)
    else:
        mask = torch.zeros(rgb.shape[:2], dtype=torch.float32)
    return torch.from_numpy(rgb)[None], mask[None]


def jpeg_bytes(image: Any, quality: int = 95) -> bytes:
    """A preview frame (a PIL image, or an H x W x 3 uint8 array) as JPEG bytes."""
    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.ascontiguousarray(np.asarray(image, dtype=np.uint8)))
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def load_image(path: str | os.PathLike[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """An image file -> (IMAGE [F, H, W, 3], MASK [F, H, W]); frames of one size form the batch (EXIF rotation
    applied). Errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image file not found: {path}")
    try:
        with Image.open(path) as opened:
            images, masks = [], []
            for frame in ImageSequence.Iterator(opened):
                image, mask = pil_to_tensor(ImageOps.exif_transpose(frame))
                if images and image.shape != images[0].shape:
                    break
                images.append(image)
                masks.append(mask)
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"cannot read image {path}: {error}; accepted: "
                         f"{', '.join(IMAGE_EXTENSIONS)} files") from None
    return torch.cat(images), torch.cat(masks)


def workflow_chunks(workflow: Any, lookup: Callable[[str], Any] | None = None) -> dict[str, str]:
    """The text chunks that embed `workflow` (empty when there is none): Sluice's document and ComfyUI's UI
    workflow and API prompt; `lookup` (the node registry's) gives ComfyUI's widget order and defaults."""
    if workflow is None:
        return {}
    from engine.graph.comfy_export import to_api_prompt, to_comfy_ui

    known = lookup or (lambda type_name: None)
    return {SLUICE_CHUNK: workflow.dumps(),
            WORKFLOW_CHUNK: json.dumps(to_comfy_ui(workflow, known), default=str),
            PROMPT_CHUNK: json.dumps(to_api_prompt(workflow, known), default=str)}


def save_png(image: torch.Tensor, path: str | os.PathLike[str], text: dict[str, str] | None = None,
             compress_level: int = 4) -> Path:
    """Write one IMAGE item as a PNG with `text` chunks; refuses to overwrite an existing file."""
    path = Path(path)
    info = PngImagePlugin.PngInfo()
    for key, value in (text or {}).items():
        info.add_text(key, value)
    encoded = io.BytesIO()
    tensor_to_pil(image).save(encoded, format="PNG", pnginfo=info, compress_level=compress_level)
    return create_file(path, encoded.getbuffer())


def png_text(path: str | os.PathLike[str]) -> dict[str, str]:
    """The text chunks of a PNG file."""
    try:
        with Image.open(path) as image:
            image.load()
            return {str(k): str(v) for k, v in getattr(image, "text", {}).items()}
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"cannot read PNG {path}: {error}") from None
