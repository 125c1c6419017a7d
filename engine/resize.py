"""Resizing of (B, C, H, W) pixel or latent batches as ComfyUI's `common_upscale` does: optional centre crop
to the target aspect, then torch interpolation, PIL Lanczos, or bislerp (slerp along each axis, for latents).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

IMAGE_METHODS = ("nearest-exact", "bilinear", "area", "bicubic", "lanczos")
LATENT_METHODS = ("nearest-exact", "bilinear", "area", "bicubic", "bislerp")
CROP_MODES = ("disabled", "center")


def center_crop_to_aspect(samples: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """The centred part of (..., H, W) `samples` with the aspect ratio of width x height."""
    old_height, old_width = samples.shape[-2:]
    old_aspect, new_aspect = old_width / old_height, width / height
    x = y = 0
    if old_aspect > new_aspect:
        x = round((old_width - old_width * (new_aspect / old_aspect)) / 2)
    elif old_aspect < new_aspect:
        y = round((old_height - old_height * (old_aspect / new_aspect)) / 2)
    return samples[..., y:old_height - y, x:old_width - x]


def lanczos(samples: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """PIL's Lanczos resampling of a (B, C, H, W) batch in 0..1 (through 8-bit images, as ComfyUI)."""
    images = samples.movedim(1, -1).clamp(0, 1).mul(255).round().to(torch.uint8).cpu().numpy()  # (B, H, W, C)
    resized = [np.asarray(Image.fromarray(image.squeeze(-1) if image.shape[-1] == 1 else image)
                          .resize((width, height), Image.Resampling.LANCZOS)) for image in images]
    stacked = torch.from_numpy(np.stack(resized)).float().div(255)
    if stacked.ndim == 3:
        stacked = stacked.unsqueeze(-1)  # grayscale (B, H, W) -> (B, H, W, 1)
    return stacked.movedim(-1, 1).to(samples.device, samples.dtype)


def _slerp(low: torch.Tensor, high: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """Spherical interpolation of channel vectors (dim 1), with norms interpolated linearly."""
    low_norm, high_norm = low.norm(dim=1, keepdim=True), high.norm(dim=1, keepdim=True)
    low_unit = low / low_norm.clamp_min(1e-12)
    high_unit = high / high_norm.clamp_min(1e-12)
    dot = (low_unit * high_unit).sum(dim=1, keepdim=True).clamp(-1, 1)
    omega = torch.acos(dot)
    sin_omega = torch.sin(omega)
    safe = sin_omega.abs() > 1e-5  # nearly parallel or opposite vectors fall back to linear interpolation
    sin_omega = torch.where(safe, sin_omega, torch.ones_like(sin_omega))
    direction = (torch.sin((1 - ratio) * omega) * low_unit + torch.sin(ratio * omega) * high_unit) / sin_omega
    spherical = direction * (low_norm * (1 - ratio) + high_norm * ratio)
    return torch.where(safe, spherical, low * (1 - ratio) + high * ratio)


def _bislerp_axis(samples: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """Resize one axis (dim 2 or 3) of (B, C, H, W) by slerp between the two nearest source samples."""
    old = samples.shape[dim]
    position = ((torch.arange(size, dtype=torch.float32) + 0.5) * old / size - 0.5).clamp(0, old - 1)
    lower = position.floor().long()
    upper = (lower + 1).clamp(max=old - 1)
    shape = [1, 1, 1, 1]
    shape[dim] = size
    ratio = (position - lower).view(shape).to(samples.device, samples.dtype)
    return _slerp(samples.index_select(dim, lower.to(samples.device)),
                  samples.index_select(dim, upper.to(samples.device)), ratio)


def bislerp(samples: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Bilinear resize where each 1-D step is a slerp of channel vectors (ComfyUI's bislerp for latents)."""
    return _bislerp_axis(_bislerp_axis(samples.float(), width, 3), height, 2).to(samples.dtype)


def resize(samples: torch.Tensor, width: int, height: int, method: str,
           crop: str = "disabled") -> torch.Tensor:
    """(B, C, H, W) -> (B, C, height, width) by `method`, centre-cropped to the new aspect first if asked."""
    if method not in IMAGE_METHODS + LATENT_METHODS:
        raise ValueError(f"unknown upscale method {method!r}; accepted: "
                         f"{', '.join(dict.fromkeys(IMAGE_METHODS + LATENT_METHODS))}")
    if crop not in CROP_MODES:
        raise ValueError(f"unknown crop {crop!r}; accepted: {', '.join(CROP_MODES)}")
    if width < 1 or height < 1:
        raise ValueError(f"cannot resize to {width}x{height}; both sides must be at least 1")
    if crop == "center":
        samples = center_crop_to_aspect(samples, width, height)
    if method == "lanczos":
        return lanczos(samples, width, height)
    if method == "bislerp":
        return bislerp(samples, width, height)
    return F.interpolate(samples, size=(height, width), mode=method)


def target_size(width: int, height: int, old_width: int, old_height: int) -> tuple[int, int]:
    """ComfyUI's size rule for a resize: a 0 side follows the other one, keeping the aspect ratio."""
    if width == 0:
        width = max(1, round(old_width * height / old_height))
    elif height == 0:
        height = max(1, round(old_height * width / old_width))
    return width, height
