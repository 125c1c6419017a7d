"""unCLIP conditioning: CLIP image embeddings, noise-augmented, as the UNet's vector condition y (Ramesh et
al. 2022, "Hierarchical Text-Conditional Image Generation with CLIP Latents"; Stability's SD2.1 unCLIP; SDXL
"revision"), with ComfyUI's arithmetic (comfy/model_base.py unclip_adm, SD21UNCLIP, sdxl_pooled;
comfy/ldm/modules/encoders/noise_aug_modules.py CLIPEmbeddingNoiseAugmentation).

unCLIPConditioning appends `{"clip_vision_output", "strength", "noise_augmentation"}` to an entry's
"unclip_conditioning" list. For each image embedding e [D] of each item (every image of each output):

    level = round((1000 - 1) * noise_augmentation)
    z     = sqrt(abar[level]) e + sqrt(1 - abar[level]) n,   n ~ N(0, 1) from torch.manual_seed(seed - 10)
    item  = strength * concat(z, timestep_embedding(level, D))                         [1, 2D]

with abar the cumulative product of the "squaredcos_cap_v2" betas over 1000 steps (Nichol & Dhariwal 2021's
cosine schedule), and the embedding's data statistics mean 0, std 1 (ComfyUI never loads the `karlo` stats:
its noise_aug_config has no clip_stats_path). One item is the result. Several are summed, and the sum's
first D values are augmented again at round(999 * merge) with noise from the global generator, which in
ComfyUI (on the CPU) continues the last item's seeded stream: the next D normals of the same generator.

- SD2.1 unCLIP (a UNet with a label_emb of width 2D = 1536 for ViT-L, 2048 for ViT-H): y is the result,
  merge 0.05; an entry without unCLIP conditioning gets zeros.
- SDXL (revision, a bigG embedding, D = 1280): the pooled text feature is replaced by the result's first
  1280 values, merge 0.
`seed` is the sampler's seed (the KSampler's `seed` widget).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine.models.unet import timestep_embedding

MAX_NOISE_LEVEL = 1000  # ImageConcatWithNoiseAugmentation's max_noise_level
SCHEDULE_STEPS = 1000  # noise_schedule_config timesteps
SEED_OFFSET = -10  # ComfyUI seeds the augmentation with the sampler's seed - 10
SD21_MERGE = 0.05  # SD21UNCLIP's unclip_noise_augment_merge default
SDXL_MERGE = 0.0  # sdxl_pooled's (the default of unclip_adm)
SDXL_POOLED = 1280  # the pooled width of SDXL's bigG encoder; also its noise augmentor's timestep_dim


def squaredcos_alphas_cumprod(steps: int = SCHEDULE_STEPS, max_beta: float = 0.999) -> torch.Tensor:
    """abar_t of the "squaredcos_cap_v2" schedule (betas from alpha_bar(t) = cos((t + 0.008) / 1.008 pi/2)^2,
    capped at max_beta), computed in float64 as the LDM code does -> [steps] float64."""
    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = torch.tensor([min(1 - alpha_bar((i + 1) / steps) / alpha_bar(i / steps), max_beta)
                          for i in range(steps)], dtype=torch.float64)
    return torch.cumprod(1.0 - betas, dim=0)


_ALPHAS_CUMPROD = squaredcos_alphas_cumprod()
SQRT_ALPHAS_CUMPROD = _ALPHAS_CUMPROD.sqrt().float()  # stored as float32 buffers, as ComfyUI registers them
SQRT_ONE_MINUS_ALPHAS_CUMPROD = (1.0 - _ALPHAS_CUMPROD).sqrt().float()


def noise_level(noise_augmentation: float) -> int:
    """The schedule step of a noise_augmentation in [0, 1]."""
    return round((MAX_NOISE_LEVEL - 1) * float(noise_augmentation))


def augment(embed: torch.Tensor, level: int, noise: torch.Tensor) -> torch.Tensor:
    """One embedding [1, D] noised to `level` with `noise` [1, D], followed by the level's timestep
    embedding -> [1, 2D]."""
    z = SQRT_ALPHAS_CUMPROD[level] * embed + SQRT_ONE_MINUS_ALPHAS_CUMPROD[level] * noise
    level_embedding = timestep_embedding(torch.tensor([level]), embed.shape[-1]).to(z)  # (1, D)
    return torch.cat([z, level_embedding], dim=1)


def check_unclip_entries(entries: Any) -> list[Mapping[str, Any]]:
    """The "unclip_conditioning" list of an entry, checked."""
    if not isinstance(entries, (list, tuple)) or not all(
            isinstance(e, Mapping) and {"clip_vision_output", "strength", "noise_augmentation"} <= set(e)
            for e in entries):
        raise ValueError("unclip_conditioning must be a list of {clip_vision_output, strength, "
                         "noise_augmentation} dicts (from unCLIPConditioning)")
    return list(entries)


def unclip_adm(entries: Sequence[Mapping[str, Any]], seed: int, merge: float, width: int | None = None,
               ) -> torch.Tensor:
    """The vector condition [1, 2D] of an entry's unCLIP conditioning (module docstring): ComfyUI's
    unclip_adm. `width` (D), when given, must be the embeddings' width."""
    generator = torch.Generator(device="cpu")
    items = []
    for entry in check_unclip_entries(entries):
        embeds = entry["clip_vision_output"].image_embeds  # (B, D)
        if width is not None and embeds.shape[-1] != width:
            raise ValueError(f"an image embedding {embeds.shape[-1]} wide does not suit this model, which "
                             f"takes {width}-wide CLIP vision embeddings; use the CLIP vision model made "
                             f"for it")
        level = noise_level(entry["noise_augmentation"])
        for embed in embeds.float().cpu():
            generator.manual_seed(seed + SEED_OFFSET)
            noise = torch.randn((1, embed.shape[-1]), generator=generator)
            items.append(augment(embed[None], level, noise) * float(entry["strength"]))
    if not items:
        raise ValueError("unclip_conditioning holds no image embedding")
    if len(items) == 1:
        return items[0]
    summed = torch.stack(items).sum(0)  # (1, 2D)
    dim = summed.shape[-1] // 2
    noise = torch.randn((1, dim), generator=generator)  # the last item's stream, continued
    return augment(summed[:, :dim], noise_level(merge), noise)
