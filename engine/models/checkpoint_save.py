"""Writing models back to single files in the key layouts ComfyUI writes and reads (CheckpointSave, VAESave).

Parameter names are the checkpoint's keys without their component prefix (DESIGN.md), so a checkpoint is the
prefixed parameters of its parts:

| family       | diffusion model        | VAE                | text encoders                              |
| ------------ | ---------------------- | ------------------ | ------------------------------------------ |
| sd1          | model.diffusion_model. | first_stage_model. | cond_stage_model.transformer. (CLIP-L)     |
| sd2          | model.diffusion_model. | first_stage_model. | cond_stage_model.model. (OpenCLIP-H)       |
| sdxl         | model.diffusion_model. | first_stage_model. | conditioner.embedders.0.transformer.       |
|              |                        |                    | (CLIP-L), conditioner.embedders.1.model.   |
|              |                        |                    | (bigG)                                     |
| sdxl_refiner | model.diffusion_model. | first_stage_model. | conditioner.embedders.0.model. (bigG)      |
| flux         | model.diffusion_model. | vae.               | text_encoders.clip_l.transformer. (CLIP-L) |
|              |                        |                    | text_encoders.t5xxl.transformer. (T5-XXL)  |

A v-prediction model gets ComfyUI's empty `v_pred` marker tensor, a zero-terminal-SNR schedule its `ztsnr`
one. A VAE alone is written with bare keys (ComfyUI's VAESave). Files are written tensor by tensor in the
safetensors format, so saving needs no second copy of the weights.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from engine.models.bundles import DiffusionModel, TextEncoder, VAEModel
from engine.new_files import create_file
from engine.sampling.model_sampling import VPrediction

DIFFUSION_PREFIX = "model.diffusion_model."
VAE_PREFIXES = {"flux": "vae."}  # by layout; the SD families' VAE sits under first_stage_model.
SD_VAE_PREFIX = "first_stage_model."
TEXT_PREFIXES = {  # (layout, encoder kind) -> (prefix, the encoder layout it must have)
    ("sd1", "clip_l"): ("cond_stage_model.transformer.", "hf"),
    ("sd2", "openclip_h"): ("cond_stage_model.model.", "open_clip"),
    ("sdxl", "clip_l"): ("conditioner.embedders.0.transformer.", "hf"),
    ("sdxl", "openclip_g"): ("conditioner.embedders.1.model.", "open_clip"),
    ("sdxl_refiner", "openclip_g"): ("conditioner.embedders.0.model.", "open_clip"),
    ("flux", "clip_l"): ("text_encoders.clip_l.transformer.", "hf"),
    ("flux", "t5xxl"): ("text_encoders.t5xxl.transformer.", None),
}
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                      torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
                      torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}


def _layout(family: str) -> str:
    return "flux" if family.startswith("flux") else family


def module_tensors(module: nn.Module, prefix: str, what: str) -> dict[str, torch.Tensor]:
    """The module's parameters under their checkpoint keys (`prefix` + name); a clear error when the memory
    runtime keeps them off the module (cpu or disk weight homes leave placeholders there)."""
    tensors = {}
    for name, tensor in module.state_dict().items():
        if tensor.is_meta:
            raise ValueError(f"cannot save the {what}: the memory runtime keeps its weights off the model "
                             f"(params_backend cpu or disk); load it with params_backend device")
        tensors[prefix + name] = tensor
    return tensors


def vae_tensors(vae: VAEModel, prefix: str = "") -> dict[str, torch.Tensor]:
    """The VAE's tensors under `prefix` (bare keys by default, as ComfyUI's VAESave)."""
    return module_tensors(vae.autoencoder, prefix, "VAE")


def checkpoint_tensors(model: DiffusionModel, clip: TextEncoder, vae: VAEModel) -> dict[str, torch.Tensor]:
    """One checkpoint of the three parts, in the key layout of the model's family (the table above)."""
    layout = _layout(model.family)
    if layout not in {key[0] for key in TEXT_PREFIXES}:
        raise ValueError(f"cannot save a {model.family} checkpoint; accepted families: sd1, sd2, sdxl, "
                         f"sdxl_refiner, flux_dev, flux_schnell")
    if _layout(clip.family) != layout:
        raise ValueError(f"the text encoder is of family {clip.family}, the model of {model.family}; a "
                         f"checkpoint holds the parts of one family")
    tensors = module_tensors(model.unet, DIFFUSION_PREFIX, "diffusion model")
    for encoder, kind in zip(clip.encoders, clip.kinds, strict=True):
        if (layout, kind) not in TEXT_PREFIXES:
            raise ValueError(f"a {model.family} checkpoint has no place for a {kind} text encoder")
        prefix, needed = TEXT_PREFIXES[layout, kind]
        found = getattr(encoder.config, "layout", None)
        if needed is not None and found != needed:
            raise ValueError(f"a {model.family} checkpoint stores its {kind} text encoder in the {needed} "
                             f"key layout; this one has the {found} layout, which Sluice does not convert")
        tensors |= module_tensors(encoder, prefix, f"{kind} text encoder")
    tensors |= vae_tensors(vae, VAE_PREFIXES.get(layout, SD_VAE_PREFIX))
    if isinstance(model.model_sampling, VPrediction):
        tensors["v_pred"] = torch.tensor([])
    if getattr(model.model_sampling, "zsnr", False):
        tensors["ztsnr"] = torch.tensor([])
    return tensors


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None) -> Path:
    """Write `tensors` as a new safetensors file (never over an existing one), one tensor at a time: header
    (its length as little-endian u64, then JSON padded with spaces to 8 bytes), then the data in key order."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name} has dtype {tensor.dtype}, which safetensors cannot store")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    path = Path(path)
    return create_file(path, itertools.chain([struct.pack("<Q", len(encoded)) + encoded],
                                             _tensor_bytes(tensors.values())))


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> Iterable[memoryview]:
    """Each tensor's bytes in C order, copied to the CPU one tensor at a time."""
    for tensor in tensors:
        if tensor.numel():
            flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            yield memoryview(flat.numpy()).cast("B")
