"""Image nodes with ComfyUI's names and input order: LoadImage, SaveImage, PreviewImage.

Saved PNGs carry the workflow three ways (engine/images.py): Sluice's document ("sluice-workflow") and
ComfyUI's UI workflow ("workflow") and API prompt ("prompt"), so ComfyUI opens them too; SaveImage publishes
`image_saved(node_id, path)` and PreviewImage `image_preview(node_id, path)` on the bus.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine import telemetry
from engine.graph.spec import NodeType, Output, RunContext, link_input, string_input
from engine.images import load_image, save_png, workflow_chunks
from engine.settings import Settings, output_prefix_problem
from nodes.loaders import current_settings

log = logging.getLogger(__name__)
_process_preview_dir: Path | None = None  # made by preview_dir when the per-user folder cannot be trusted


def _check_private(folder: Path) -> None:
    """Raise PermissionError unless `folder` is a real folder (no symbolic link) owned by this user that no
    one else may write or read."""
    info = os.lstat(folder)
    if stat.S_ISLNK(info.st_mode):
        raise PermissionError(f"{folder} is a symbolic link; expected a folder")
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"{folder} is not a folder")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise PermissionError(f"{folder} belongs to user id {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & 0o077:
        raise PermissionError(f"{folder} has mode {stat.S_IMODE(info.st_mode):o}; expected 700 (this user "
                              f"only)")


def preview_dir() -> Path:
    """PreviewImage's folder: `$TMPDIR/sluice-<uid>/previews`, private to this user (mode 700, owned by them,
    no symbolic link on the way), so another local user can neither redirect previews nor read them. When
    that path is taken by something else, a fresh private folder of this process (tempfile.mkdtemp) is used
    instead and a warning logged."""
    global _process_preview_dir
    base = Path(tempfile.gettempdir()) / f"sluice-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    try:
        for folder in (base, base / "previews"):
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:
                pass
            _check_private(folder)
        return base / "previews"
    except OSError as error:
        if _process_preview_dir is None or not _process_preview_dir.is_dir():
            _process_preview_dir = Path(tempfile.mkdtemp(prefix="sluice-previews-"))
            log.warning("previews go to %s: the preview folder cannot be trusted (%s)", _process_preview_dir,
                        error)
        return _process_preview_dir


def input_dir(settings: Settings | None) -> Path:
    """The folder LoadImage reads relative names from: `input` beside the output folder (ComfyUI's layout)."""
    return current_settings(settings).output_dir.parent / "input"


def image_path(settings: Settings | None, image: str) -> Path:
    """An absolute path as given; a relative name inside the input folder (no climbing out of it)."""
    if not image.strip():
        raise ValueError("no image chosen; give a file name in the input folder or an absolute path")
    path = Path(image).expanduser()
    if path.is_absolute():
        return path
    folder = input_dir(settings).resolve()
    resolved = (folder / path).resolve()
    if not resolved.is_relative_to(folder):
        raise ValueError(f"image {image!r} leads outside the input folder {folder}")
    return resolved


def _check_images(images: Any) -> torch.Tensor:
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[-1] not in (3, 4):
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"expected an IMAGE batch of shape (B, H, W, 3); got {shape}")
    return images


class LoadImage(NodeType):
    display_name = "Load Image"
    category = "image"
    description = ("Loads an image (a name in the input folder beside the output folder, or an absolute "
                   "path); MASK is 1 - alpha (zeros without alpha).")
    inputs = (string_input("image", ""),)
    outputs = (Output("IMAGE", "IMAGE"), Output("MASK", "MASK"))
    input_files = ("image",)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        path = image_path(settings, widgets["image"])
        return (str(path), os.stat(path).st_mtime_ns, os.stat(path).st_size)

    def run(self, ctx: RunContext, image: str) -> tuple:
        return load_image(image_path(ctx.settings, image))


def _save_all(ctx: RunContext, images: torch.Tensor, settings: Settings, prefix: str, event: str,
              compress_level: int) -> list[Path]:
    chunks = workflow_chunks(ctx.workflow, ctx.lookup)
    paths = []
    for image in _check_images(images):
        ctx.check_interrupt()
        path = save_png(image, settings.output_path(prefix, "png"), chunks, compress_level)
        telemetry.bus.publish(event, node_id=ctx.node_id, path=str(path))
        paths.append(path)
    return paths


class SaveImage(NodeType):
    display_name = "Save Image"
    category = "image"
    description = ("Saves images as PNGs named prefix_00001_.png in the output folder (never overwriting), "
                   "with the workflow embedded.")
    output_node = True
    inputs = (link_input("images", "IMAGE"),
              string_input("filename_prefix", "Sluice", check=output_prefix_problem))
    outputs = ()

    def run(self, ctx: RunContext, images: torch.Tensor, filename_prefix: str) -> tuple:
        settings = current_settings(ctx.settings)
        _save_all(ctx, images, settings, filename_prefix, "image_saved", compress_level=4)
        return ()


class PreviewImage(NodeType):
    display_name = "Preview Image"
    category = "image"
    description = "Shows images without keeping them: PNGs in a temporary preview folder private to the user."
    output_node = True
    inputs = (link_input("images", "IMAGE"),)
    outputs = ()

    def run(self, ctx: RunContext, images: torch.Tensor) -> tuple:
        settings = dataclasses.replace(current_settings(ctx.settings), output_dir=preview_dir())
        _save_all(ctx, images, settings, "preview", "image_preview", compress_level=1)
        return ()


NODE_TYPES = (LoadImage, SaveImage, PreviewImage)
