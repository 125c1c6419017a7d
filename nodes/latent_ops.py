"""Latent batch, composition and file nodes with ComfyUI's names, input order, defaults and results:
LatentComposite, LatentCompositeMasked, LatentBlend, RepeatLatentBatch, LatentFromBatch, SetLatentNoiseMask,
SaveLatent, LoadLatent.

A LATENT dict may carry, besides "samples" [B, C, h, w]: "noise_mask" [B or 1, 1, H, W] (SetLatentNoiseMask)
and "batch_index" (the seed offsets of the items, kept by LatentFromBatch and RepeatLatentBatch), as in
ComfyUI. SaveLatent writes ComfyUI's .latent files: safetensors with the samples under "latent_tensor", an
empty "latent_format_version_0" tensor, and the prompt and workflow as JSON metadata. LoadLatent reads them
from the input folder (older files without the version tensor are scaled by 1 / 0.18215, as ComfyUI does).
"""

from __future__ import annotations

import os
from typing import Any

import safetensors
import safetensors.torch
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
    string_input,
)
from engine.images import workflow_chunks
from engine.resize import resize
from engine.settings import output_prefix_problem
from nodes.image import input_dir
from nodes.latent import MAX_RESOLUTION, latent_samples
from nodes.loaders import current_settings
from nodes.masks import as_masks, composite, repeat_to_batch

LATENT_EXTENSION = ".latent"
LATENT_KEY = "latent_tensor"
VERSION_KEY = "latent_format_version_0"  # present: samples stored raw; absent: stored x 0.18215 (old files)
OLD_FORMAT_SCALE = 0.18215
MAX_BATCH_INDEX = 63


def _check_batches(target: torch.Tensor, source: torch.Tensor, what: str) -> None:
    if source.shape[0] not in (1, target.shape[0]):
        raise ValueError(f"{what}: the source has {source.shape[0]} latents, the destination "
                         f"{target.shape[0]}; the source needs 1 or the same number")
    if source.shape[1] != target.shape[1]:
        raise ValueError(f"{what}: the source has {source.shape[1]} channels, the destination "
                         f"{target.shape[1]}")


class LatentComposite(NodeType):
    display_name = "Latent Composite"
    category = "latent"
    description = ("Pastes samples_from into samples_to at (x, y) pixels (in steps of 8); feather > 0 fades "
                   "the pasted edges that lie inside samples_to linearly over feather pixels.")
    inputs = (link_input("samples_to", "LATENT"), link_input("samples_from", "LATENT"),
              int_input("x", 0, min=0, max=MAX_RESOLUTION, step=8),
              int_input("y", 0, min=0, max=MAX_RESOLUTION, step=8),
              int_input("feather", 0, min=0, max=MAX_RESOLUTION, step=8))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, samples_to: Any, samples_from: Any, x: int, y: int,
            feather: int = 0) -> tuple:
        target, source = latent_samples(samples_to), latent_samples(samples_from)
        _check_batches(target, source, "LatentComposite")
        x, y, feather = x // 8, y // 8, feather // 8
        result = target.clone()
        source = source[:, :, :max(0, target.shape[2] - y), :max(0, target.shape[3] - x)]
        height, width = source.shape[2:]
        if height and width:
            mask = torch.ones_like(source)
            for t in range(feather):
                rate = (1.0 / feather) * (t + 1)
                if y != 0:
                    mask[:, :, t] *= rate
                if y + height < target.shape[2]:
                    mask[:, :, height - 1 - t] *= rate
                if x != 0:
                    mask[:, :, :, t] *= rate
                if x + width < target.shape[3]:
                    mask[:, :, :, width - 1 - t] *= rate
            region = result[:, :, y:y + height, x:x + width]
            result[:, :, y:y + height, x:x + width] = source * mask + region * (1 - mask)
        return ({**samples_to, "samples": result},)


class LatentCompositeMasked(NodeType):
    category = "latent"
    description = ("Pastes source into destination at (x, y) pixels (in steps of 8) through the optional "
                   "mask (resized to the source); resize_source first scales the source to the "
                   "destination's size. The source batch repeats to the destination's.")
    inputs = (link_input("destination", "LATENT"), link_input("source", "LATENT"),
              int_input("x", 0, min=0, max=MAX_RESOLUTION, step=8),
              int_input("y", 0, min=0, max=MAX_RESOLUTION, step=8),
              bool_input("resize_source", False),
              link_input("mask", "MASK", optional=True))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, destination: Any, source: Any, x: int, y: int, resize_source: bool,
            mask: torch.Tensor | None = None) -> tuple:
        target, pasted = latent_samples(destination), latent_samples(source)
        if pasted.shape[1] != target.shape[1]:
            raise ValueError(f"LatentCompositeMasked: the source has {pasted.shape[1]} channels, the "
                             f"destination {target.shape[1]}")
        return ({**destination, "samples": composite(target, pasted, x, y, mask, 8, resize_source)},)


class LatentBlend(NodeType):
    display_name = "Latent Blend"
    category = "_for_testing"
    description = ("samples1 x blend_factor + samples2 x (1 - blend_factor); samples2 is first resized "
                   "(bicubic, centre crop) to samples1's size when the shapes differ.")
    inputs = (link_input("samples1", "LATENT"), link_input("samples2", "LATENT"),
              float_input("blend_factor", 0.5, min=0.0, max=1.0, step=0.01))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, samples1: Any, samples2: Any, blend_factor: float) -> tuple:
        first, second = latent_samples(samples1), latent_samples(samples2)
        if first.shape != second.shape:
            second = resize(second, first.shape[3], first.shape[2], "bicubic", "center")
        _check_batches(first, second, "LatentBlend")
        return ({**samples1, "samples": first * blend_factor + second * (1 - blend_factor)},)


def _masks_for(masks: torch.Tensor, batch: int) -> torch.Tensor:
    """Noise masks repeated to cover `batch` latents when there are fewer (ComfyUI's rule)."""
    return repeat_to_batch(masks, batch) if masks.shape[0] < batch else masks


class RepeatLatentBatch(NodeType):
    display_name = "Repeat Latent Batch"
    category = "latent/batch"
    description = "The batch repeated `amount` times (noise masks and batch indices follow)."
    inputs = (link_input("samples", "LATENT"), int_input("amount", 1, min=1, max=64))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, samples: Any, amount: int) -> tuple:
        latents = latent_samples(samples)
        out = {**samples, "samples": latents.repeat(amount, 1, 1, 1)}
        masks = samples.get("noise_mask")
        if masks is not None and masks.shape[0] > 1:  # ComfyUI repeats the masks as given
            out["noise_mask"] = masks.repeat(amount, 1, 1, 1)
        if "batch_index" in samples:
            indices = list(samples["batch_index"])
            offset = max(indices) - min(indices) + 1
            out["batch_index"] = indices + [i + n * offset for n in range(1, amount) for i in indices]
        return (out,)


class LatentFromBatch(NodeType):
    display_name = "Latent From Batch"
    category = "latent/batch"
    description = ("`length` latents from batch_index on (both limited to the batch); they keep their "
                   "batch indices, so a sampler gives them the noise they had in the whole batch.")
    inputs = (link_input("samples", "LATENT"),
              int_input("batch_index", 0, min=0, max=MAX_BATCH_INDEX),
              int_input("length", 1, min=1, max=64))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, samples: Any, batch_index: int, length: int) -> tuple:
        latents = latent_samples(samples)
        start = min(latents.shape[0] - 1, batch_index)
        length = min(latents.shape[0] - start, length)
        out = {**samples, "samples": latents[start:start + length].clone()}
        masks = samples.get("noise_mask")
        if masks is not None:
            out["noise_mask"] = (masks.clone() if masks.shape[0] == 1 else
                                 _masks_for(masks, latents.shape[0])[start:start + length].clone())
        if "batch_index" in samples:
            out["batch_index"] = list(samples["batch_index"])[start:start + length]
        else:
            out["batch_index"] = list(range(start, start + length))
        return (out,)


class SetLatentNoiseMask(NodeType):
    display_name = "Set Latent Noise Mask"
    category = "latent/inpaint"
    description = ("Stores the mask as the latent's noise_mask (1 = resample, 0 = keep), as ComfyUI does. "
                   "Sluice's samplers do not apply noise masks yet: they sample the whole latent.")
    inputs = (link_input("samples", "LATENT"), link_input("mask", "MASK"))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, samples: Any, mask: torch.Tensor) -> tuple:
        latent_samples(samples)
        return ({**samples, "noise_mask": as_masks(mask)[:, None]},)


class SaveLatent(NodeType):
    category = "_for_testing"
    description = ("Saves the latent as prefix_00001_.latent in the output folder: ComfyUI's format "
                   "(safetensors, 'latent_tensor'), with the prompt and workflow as metadata.")
    output_node = True
    inputs = (link_input("samples", "LATENT"),
              string_input("filename_prefix", "latents/ComfyUI", check=output_prefix_problem))
    outputs = ()

    def run(self, ctx: RunContext, samples: Any, filename_prefix: str) -> tuple:
        latents = latent_samples(samples).detach().cpu().contiguous()
        path = current_settings(ctx.settings).output_path(filename_prefix, LATENT_EXTENSION)
        metadata = workflow_chunks(ctx.workflow, ctx.lookup) or None
        safetensors.torch.save_file({LATENT_KEY: latents, VERSION_KEY: torch.tensor([])}, str(path),
                                    metadata=metadata)
        return ()


def latent_choices() -> list[str]:
    """The .latent files in the input folder, sorted (ComfyUI's LoadLatent list)."""
    try:
        folder = input_dir(None)
        return sorted(f for f in os.listdir(folder)
                      if f.endswith(LATENT_EXTENSION) and os.path.isfile(folder / f))
    except OSError:
        return []


def latent_path(settings: Any, name: str) -> Any:
    """A .latent file directly in the input folder; names with folders, or of missing files, are errors."""
    folder = input_dir(settings)
    path = folder / name
    if not name or os.path.basename(name) != name or not name.endswith(LATENT_EXTENSION):
        raise ValueError(f"latent {name!r} is not a .latent file name in the input folder {folder}")
    if not path.is_file():
        raise FileNotFoundError(f"latent file not found: {path}")
    return path


def load_latent_file(path: Any) -> dict[str, torch.Tensor]:
    """A ComfyUI .latent file as a LATENT (safetensors only: nothing is unpickled)."""
    try:
        tensors = safetensors.torch.load_file(str(path), device="cpu")
    except (safetensors.SafetensorError, OSError) as error:
        raise ValueError(f"cannot read latent {path}: {error}; accepted: ComfyUI's .latent "
                         f"(safetensors) files") from None
    if LATENT_KEY not in tensors:
        raise ValueError(f"latent {path} has no {LATENT_KEY!r} tensor (found: {', '.join(sorted(tensors))})")
    scale = 1.0 if VERSION_KEY in tensors else 1.0 / OLD_FORMAT_SCALE
    return {"samples": tensors[LATENT_KEY].float() * scale}


class LoadLatent(NodeType):
    category = "_for_testing"
    description = "Loads a .latent file (ComfyUI's format) from the input folder."
    inputs = (combo_input("latent", latent_choices),)
    outputs = (Output("LATENT", "LATENT"),)
    input_files = ("latent",)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        path = latent_path(settings, widgets["latent"])
        return (str(path), os.stat(path).st_mtime_ns, os.stat(path).st_size)

    def run(self, ctx: RunContext, latent: str) -> tuple:
        return (load_latent_file(latent_path(ctx.settings, latent)),)


NODE_TYPES = (LatentComposite, LatentCompositeMasked, LatentBlend, RepeatLatentBatch, LatentFromBatch,
              SetLatentNoiseMask, SaveLatent, LoadLatent)
