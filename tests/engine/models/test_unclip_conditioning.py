"""unCLIP conditioning (engine/models/unclip.py) against ComfyUI's formula written down by hand from
comfy/model_base.py (unclip_adm, SD21UNCLIP.encode_adm, sdxl_pooled) and comfy/ldm/.../noise_aug_modules.py
(CLIPEmbeddingNoiseAugmentation with its squaredcos_cap_v2 schedule computed in numpy, seeded through torch's
global generator as ComfyUI does), on a tiny SD2.1 unCLIP checkpoint and a meta-device SDXL UNet.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from engine.models.bundles import DiffusionModel
from engine.models.clip_vision import CLIPVisionOutput
from engine.models.clip_vision_loader import load_clip_vision
from engine.models.loader import load_checkpoint
from engine.models.unet import UNetModel, sdxl_unet_config
from engine.sampling.model_sampling import EpsPrediction, VPrediction
from tests.engine.models.clip_vision_checkpoints import IMAGE, PROJECTION, write_unclip_checkpoint

TOLERANCE = 1e-6  # y is O(1) float32 arithmetic in the same order as ComfyUI's


def comfy_schedule() -> tuple[torch.Tensor, torch.Tensor]:
    """sqrt(abar), sqrt(1 - abar) of make_beta_schedule("squaredcos_cap_v2", 1000), float32 buffers."""
    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = np.array([min(1 - alpha_bar((i + 1) / 1000) / alpha_bar(i / 1000), 0.999) for i in range(1000)])
    alphas_cumprod = np.cumprod(1.0 - betas, axis=0)
    return (torch.tensor(np.sqrt(alphas_cumprod), dtype=torch.float32),
            torch.tensor(np.sqrt(1.0 - alphas_cumprod), dtype=torch.float32))


def comfy_noise_augmentor(x: torch.Tensor, level: int, seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """CLIPEmbeddingNoiseAugmentation.forward with data_mean 0, data_std 1 (no clip_stats_path)."""
    dim = x.shape[-1]
    x = (x - torch.zeros(dim)[None]) / torch.ones(dim)[None]  # (1, D)
    if seed is None:
        noise = torch.randn_like(x)
    else:
        noise = torch.randn(x.size(), dtype=x.dtype, generator=torch.manual_seed(seed))
    sqrt_ac, sqrt_1m = comfy_schedule()
    t = torch.tensor([level])
    z = sqrt_ac.gather(-1, t).reshape(1, 1) * x + sqrt_1m.gather(-1, t).reshape(1, 1) * noise
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(0, half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return z, torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def comfy_unclip_adm(unclip_conditioning: list, noise_augment_merge: float, seed: int) -> torch.Tensor:
    with torch.random.fork_rng():
        adm_inputs, noise_aug = [], []
        for unclip_cond in unclip_conditioning:
            for adm_cond in unclip_cond["clip_vision_output"].image_embeds:
                weight = unclip_cond["strength"]
                noise_augment = unclip_cond["noise_augmentation"]
                noise_level = round((1000 - 1) * noise_augment)
                c_adm, noise_level_emb = comfy_noise_augmentor(adm_cond, noise_level, seed)
                adm_out = torch.cat((c_adm, noise_level_emb), 1) * weight
                noise_aug.append(noise_augment)
                adm_inputs.append(adm_out)
        if len(noise_aug) > 1:
            adm_out = torch.stack(adm_inputs).sum(0)
            noise_level = round((1000 - 1) * noise_augment_merge)
            dim = adm_out.shape[1] // 2
            c_adm, noise_level_emb = comfy_noise_augmentor(adm_out[:, :dim], noise_level, None)
            adm_out = torch.cat((c_adm, noise_level_emb), 1)
    return adm_out


def vision_output(batch: int, width: int, seed: int) -> CLIPVisionOutput:
    embeds = torch.randn(batch, width, generator=torch.Generator().manual_seed(seed))
    return CLIPVisionOutput(embeds, torch.zeros(batch, 1, 1), torch.zeros(batch, 1, 1))


@pytest.fixture(scope="module")
def unclip_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("unclip") / "sd21_unclip_tiny.safetensors"
    write_unclip_checkpoint(path)
    model, clip, vae = load_checkpoint(path)
    return model, path


def test_unclip_checkpoint_is_an_sd2_v_model_with_its_image_embedder(unclip_model) -> None:
    model, path = unclip_model
    assert model.family == "sd2" and isinstance(model.model_sampling, VPrediction)
    assert model.unet.config.adm_in_channels == 2 * PROJECTION
    vision = load_clip_vision(path)
    out = vision.encode_image(torch.rand(1, 2 * IMAGE, IMAGE, 3))
    assert out.image_embeds.shape == (1, PROJECTION)


@pytest.mark.parametrize(("seed", "strength", "noise_augmentation"), [(42, 0.7, 0.3), (3, 1.0, 0.0),
                                                                        (123456789, -1.5, 1.0)])
def test_sd21_unclip_y_and_unet_output_follow_comfyui(unclip_model, seed, strength,
                                                      noise_augmentation) -> None:
    model, _ = unclip_model
    unclip = [{"clip_vision_output": vision_output(1, PROJECTION, 1), "strength": strength,
               "noise_augmentation": noise_augmentation}]
    context = torch.randn(1, 77, model.unet.config.context_dim, generator=torch.Generator().manual_seed(2))
    positive = [[context, {"pooled_output": None, "unclip_conditioning": unclip}]]
    entry = model.guidance_conditioning(positive, 32, 32, seed=seed)[0]
    expected_y = comfy_unclip_adm(unclip, 0.05, seed - 10)
    assert entry.y.shape == (1, 2 * PROJECTION)
    assert (entry.y - expected_y).abs().max().item() < TOLERANCE
    x = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(3))
    timesteps = torch.tensor([500.0])
    with torch.no_grad():
        expected = model.unet(x, timesteps, context, expected_y)
    assert (model.apply(x, timesteps, entry.context, entry.y) - expected).abs().max().item() < 1e-5


def test_several_embeddings_are_summed_and_augmented_again_as_comfyui(unclip_model) -> None:
    model, _ = unclip_model
    unclip = [{"clip_vision_output": vision_output(2, PROJECTION, 4), "strength": 0.8,
               "noise_augmentation": 0.1},
              {"clip_vision_output": vision_output(1, PROJECTION, 5), "strength": 1.2,
               "noise_augmentation": 0.5}]
    context = torch.zeros(1, 77, model.unet.config.context_dim)
    entry = model.guidance_conditioning([[context, {"unclip_conditioning": unclip}]], 32, 32, seed=77)[0]
    assert (entry.y - comfy_unclip_adm(unclip, 0.05, 67)).abs().max().item() < TOLERANCE


def test_an_entry_without_image_embedding_gets_zeros(unclip_model) -> None:
    model, _ = unclip_model
    entry = model.guidance_conditioning([[torch.zeros(1, 77, model.unet.config.context_dim), {}]], 32, 32)[0]
    assert torch.equal(entry.y, torch.zeros(1, 2 * PROJECTION))


def test_an_embedding_of_the_wrong_width_is_refused(unclip_model) -> None:
    model, _ = unclip_model
    unclip = [{"clip_vision_output": vision_output(1, PROJECTION + 1, 1), "strength": 1.0,
               "noise_augmentation": 0.0}]
    with pytest.raises(ValueError, match="CLIP vision"):
        model.guidance_conditioning([[torch.zeros(1, 77, model.unet.config.context_dim),
                                      {"unclip_conditioning": unclip}]], 32, 32)


def test_sdxl_revision_replaces_the_pooled_feature_as_comfyui() -> None:
    config = dataclasses.replace(sdxl_unet_config(), model_channels=32)
    unet = UNetModel(config, device="meta")
    model = DiffusionModel(unet, EpsPrediction(), "sdxl", 4, 0.13025, 0.0, "cpu")
    unclip = [{"clip_vision_output": vision_output(1, 1280, 6), "strength": 0.6, "noise_augmentation": 0.2}]
    pooled = torch.randn(1, 1280)
    extras = {"pooled_output": pooled, "unclip_conditioning": unclip, "width": 1024, "height": 768}
    entry = model.guidance_conditioning([[torch.zeros(1, 77, 2048), extras]], 512, 512, seed=1000)[0]
    expected_pooled = comfy_unclip_adm(unclip, 0.0, 990)[:, :1280]
    assert (entry.y[:, :1280] - expected_pooled).abs().max().item() < TOLERANCE
    plain = model.guidance_conditioning([[torch.zeros(1, 77, 2048), {**extras, "unclip_conditioning": None}]],
                                        512, 512)[0]
    assert torch.equal(entry.y[:, 1280:], plain.y[:, 1280:])  # the size embeddings are untouched
