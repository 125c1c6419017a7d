"""Cheap live previews: project a model-space latent to RGB with a fixed C x 3 linear map (no VAE).

The factors are ComfyUI's latent_rgb_factors (comfy/latent_formats.py, classes SD15, SDXL and Flux), applied,
as ComfyUI's Latent2RGBPreviewer does, to the denoised latent in the space the model samples in.
"""

from functools import lru_cache

import numpy as np
import torch

LATENT_RGB_FACTORS: dict[str, list[list[float]]] = {
    "sd1": [[0.3512, 0.2297, 0.3227],  # rows: latent channels; columns: R, G, B
            [0.3250, 0.4974, 0.2350],
            [-0.2829, 0.1762, 0.2721],
            [-0.2120, -0.2616, -0.7177]],
    "sdxl": [[0.3651, 0.4232, 0.4341],
             [-0.2533, -0.0042, 0.1068],
             [0.1076, 0.1111, -0.0362],
             [-0.3165, -0.2492, -0.2188]],
    "flux": [[-0.0346, 0.0244, 0.0681],  # 16 latent channels
             [0.0034, 0.0210, 0.0687],
             [0.0275, -0.0668, -0.0433],
             [-0.0174, 0.0160, 0.0617],
             [0.0859, 0.0721, 0.0329],
             [0.0004, 0.0383, 0.0115],
             [0.0405, 0.0861, 0.0915],
             [-0.0236, -0.0185, -0.0259],
             [-0.0245, 0.0250, 0.1180],
             [0.1008, 0.0755, -0.0421],
             [-0.0515, 0.0201, 0.0011],
             [0.0428, -0.0012, -0.0036],
             [0.0817, 0.0765, 0.0749],
             [-0.1264, -0.0522, -0.1103],
             [-0.0280, -0.0881, -0.0499],
             [-0.1262, -0.0982, -0.0778]],
}
LATENT_RGB_BIAS: dict[str, list[float]] = {"sd1": [0.0, 0.0, 0.0], "sdxl": [0.1084, -0.0175, -0.0011],
                                           "flux": [-0.0329, -0.0718, -0.0851]}


def latent_to_rgb(latent: torch.Tensor, family: str = "sd1") -> np.ndarray:
    """(C, H, W) or (B, C, H, W) latent (first item used) -> (H, W, 3) uint8 preview, computed on the CPU."""
    return latent_to_rgb_frame(latent.detach().cpu(), family).numpy()


def latent_to_rgb_frame(latent: torch.Tensor, family: str = "sd1") -> torch.Tensor:
    """`latent_to_rgb` on the latent's own device: an (H, W, 3) uint8 tensor there."""
    key = family.lower()
    if key not in LATENT_RGB_FACTORS:
        raise ValueError(f"no latent preview factors for model family '{family}'; accepted: "
                         f"{', '.join(LATENT_RGB_FACTORS)}")
    if latent.ndim == 4:
        latent = latent[0]
    factors, bias = _projection(key, latent.device)  # (C, 3), (3,)
    if latent.ndim != 3 or latent.shape[0] != factors.shape[0]:
        raise ValueError(f"preview needs a ({factors.shape[0]}, H, W) latent for '{family}'; got shape "
                         f"{tuple(latent.shape)}")
    rgb = torch.einsum("chw,cr->hwr", latent.detach().float(), factors)  # (H, W, 3)
    rgb = rgb + bias
    return ((rgb + 1.0) / 2.0).clamp(0, 1).mul(255).to(torch.uint8)


@lru_cache(maxsize=16)
def _projection(family: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A family's factors and bias on `device`, made once: a tensor made from a list on a GPU is a copy from
    pageable memory, which waits for all the work queued before it (every step's, in a sampler)."""
    return (torch.tensor(LATENT_RGB_FACTORS[family], device=device),
            torch.tensor(LATENT_RGB_BIAS[family], device=device))
