"""Patches of a diffusion model that ComfyUI's model nodes make: FreeU v2 on the UNet's skip connections, and
the weighted merge of two models (ModelMergeSimple).

Both return clones (DiffusionModel.clone): the incoming bundle, its module and its weights stay as they were.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from engine.models.bundles import DiffusionModel
from engine.models.lora_apply import MERGEABLE_DTYPES, structural_copy
from engine.models.unet import UNetModel

log = logging.getLogger(__name__)


def fourier_filter(x: torch.Tensor, threshold: int, scale: float) -> torch.Tensor:
    """x (B, C, H, W) with its lowest spatial frequencies, the centred 2 threshold x 2 threshold of the
    shifted spectrum, scaled by `scale` (FreeU's skip filter; FFT in float32)."""
    spectrum = torch.fft.fftshift(torch.fft.fftn(x.float(), dim=(-2, -1)), dim=(-2, -1))
    height, width = spectrum.shape[-2:]
    mask = torch.ones(spectrum.shape, device=x.device)
    row, col = height // 2, width // 2
    mask[..., row - threshold:row + threshold, col - threshold:col + threshold] = scale
    filtered = torch.fft.ifftn(torch.fft.ifftshift(spectrum * mask, dim=(-2, -1)), dim=(-2, -1)).real
    return filtered.to(x.dtype)


@dataclass(frozen=True)
class FreeUV2:
    """FreeU v2 (Si et al. 2024, "FreeU: Free Lunch in Diffusion U-Net") as ComfyUI's FreeU_V2: where an
    output block's incoming features have 4x (2x) the model's base channels, the first half of their channels
    is scaled by 1 + (b1 - 1) m (b2), m being the channel mean normalised to [0, 1] per item, and the skip's
    lowest frequencies by s1 (s2). A UNet output-block patch: (h, skip) -> (h, skip)."""

    model_channels: int
    b1: float
    b2: float
    s1: float
    s2: float

    def __call__(self, h: torch.Tensor, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scales = {self.model_channels * 4: (self.b1, self.s1), self.model_channels * 2: (self.b2, self.s2)}
        if h.shape[1] not in scales:
            return h, skip
        backbone, skip_scale = scales[h.shape[1]]
        mean = h.mean(1, keepdim=True)  # (B, 1, H, W)
        flat = mean.reshape(mean.shape[0], -1)  # (B, H * W)
        low = flat.min(dim=-1).values.reshape(-1, 1, 1, 1)
        high = flat.max(dim=-1).values.reshape(-1, 1, 1, 1)
        mean = (mean - low) / (high - low)
        half = h.shape[1] // 2
        h = torch.cat([h[:, :half] * ((backbone - 1) * mean + 1), h[:, half:]], dim=1)
        return h, fourier_filter(skip, threshold=1, scale=skip_scale)


def with_freeu_v2(model: DiffusionModel, b1: float, b2: float, s1: float, s2: float) -> DiffusionModel:
    """A clone of an SD model whose UNet runs FreeU v2 (added after its other output-block patches)."""
    if not isinstance(model.unet, UNetModel):
        raise ValueError(f"FreeU patches a UNet's skip connections; this {model.family} model has no UNet")
    clone = model.clone()
    patch = FreeUV2(model.unet.config.model_channels, b1, b2, s1, s2)
    clone.options["output_block_patches"] = (*clone.options.get("output_block_patches", ()), patch)
    return clone


def _plain_weights(model: DiffusionModel, role: str) -> None:
    memory = model.memory
    if memory is not None and memory.params != "device":
        raise ValueError(f"cannot merge {role}: the memory runtime keeps its weights at {memory.params!r}; "
                         f"load it with params_backend device")


def merge_simple(model1: DiffusionModel, model2: DiffusionModel, ratio: float) -> DiffusionModel:
    """ComfyUI's ModelMergeSimple: model1's clone whose every weight that model2 also has (same name and
    shape) is ratio * model1's + (1 - ratio) * model2's, computed in float32 (as ComfyUI's weight patches:
    model1's weight times ratio, then (1 - ratio) times model2's added) and stored in model1's dtype.
    Weights of other shapes keep model1's, with a warning; model2's LoRAs are in its weights."""
    _plain_weights(model1, "model1")
    _plain_weights(model2, "model2")
    theirs = dict(model2.unet.named_parameters())
    merged = structural_copy(model1.unet)
    mismatched = []
    for name, weight in model1.unet.named_parameters():
        other = theirs.get(name)
        if other is None:
            continue
        if other.shape != weight.shape:
            mismatched.append(name)
            continue
        if weight.dtype not in MERGEABLE_DTYPES:
            raise ValueError(f"cannot merge {name}: model1 stores it as {weight.dtype}; load it as fp16, "
                             f"bf16 or fp32")
        work = weight.detach().to(torch.promote_types(weight.dtype, torch.float32), copy=True)
        if ratio != 1.0:
            work *= ratio
        if 1.0 - ratio != 0.0:
            work += (1.0 - ratio) * other.detach().to(device=work.device, dtype=work.dtype)
        owner_name, _, attribute = name.rpartition(".")
        merged.get_submodule(owner_name)._parameters[attribute] = nn.Parameter(work.to(weight.dtype),
                                                                               requires_grad=False)
    if mismatched:
        log.warning("ModelMergeSimple: %d weights differ in shape and keep model1's (first: %s)",
                    len(mismatched), mismatched[0])
    clone = model1.clone()
    clone.unet = merged
    clone.options.pop("loras", None)  # now part of the merged weights
    return clone
