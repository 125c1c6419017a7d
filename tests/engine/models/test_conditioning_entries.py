"""A CONDITIONING of several entries as the sampler's entries, for SD1, SDXL (ADM per entry) and FLUX (pooled
CLIP-L and guidance per entry): ComfyUI's resolution of areas, percentages, masks and timestep ranges, checked
by hand, and an area-conditioned FLUX step against its crop-predict-paste computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.models.conditioning import sdxl_adm
from engine.models.loader import clear_cache, load_checkpoint
from engine.sampling.guidance import CFGDenoiser, calc_cond_batch
from engine.sampling.model_sampling import EpsPrediction, FluxFlowMatching, scaled_linear_betas
from tests.engine.models.flux_checkpoints import write_flux_files
from tests.engine.models.sd_checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("sdxl") / "sdxl.safetensors"
    write_checkpoint(path, "sdxl", "tiny")
    clear_cache()
    return load_checkpoint(path)


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory):
    files = write_flux_files(tmp_path_factory.mktemp("flux") / "models")
    clear_cache()
    return load_checkpoint(files["checkpoint"])


def comfy_percent_to_sigma(percent: float) -> float:
    """ComfyUI's ModelSamplingDiscrete.percent_to_sigma on SD's schedule, in numpy."""
    if percent <= 0:
        return 999999999.9
    if percent >= 1:
        return 0.0
    betas = scaled_linear_betas().numpy()
    cumprod = np.cumprod(1 - betas)
    log_sigmas = np.log(np.sqrt((1 - cumprod) / cumprod)).astype(np.float32)
    t = np.float32((1.0 - percent) * 999.0)
    low, high = int(np.floor(t)), int(np.ceil(t))
    w = t - low
    return float(np.exp((1 - w) * log_sigmas[low] + w * log_sigmas[high]))


def test_sdxl_entries_each_carry_their_own_adm_area_mask_strength_and_sigma_range(sdxl):
    model, clip, _ = sdxl
    width = model.unet.config.context_dim
    pooled_width = model.unet.config.adm_in_channels - 6 * 256
    context, pooled = torch.randn(1, 77, width), torch.randn(1, pooled_width)
    mask = torch.rand(16, 16, generator=torch.Generator().manual_seed(3))  # bilinear halving: 2x2 block means
    conditioning = [
        [context, {"pooled_output": pooled, "area": (4, 4, 2, 2), "strength": 0.5}],
        [context * 2, {"pooled_output": pooled * 2, "width": 512, "height": 256, "target_width": 256,
                       "mask": mask, "mask_strength": 0.25, "start_percent": 0.2, "end_percent": 0.7}],
        [context * 3, {"pooled_output": pooled, "area": ("percentage", 0.3125, 0.5, 0.1875, 0.0625)}],
    ]
    first, second, third = model.guidance_conditioning(conditioning, 64, 64)
    torch.testing.assert_close(first.y, sdxl_adm(pooled, 64, 64))
    torch.testing.assert_close(second.y, sdxl_adm(pooled * 2, 512, 256, target_width=256, target_height=256))
    assert (first.area, first.strength, first.mask) == ((4, 4, 2, 2), 0.5, None)
    expected_mask = torch.from_numpy(mask.numpy().reshape(8, 2, 8, 2).mean(axis=(1, 3)))[None]
    torch.testing.assert_close(second.mask, expected_mask)
    assert second.mask_strength == 0.25 and second.area is None
    assert math.isclose(second.sigma_start, comfy_percent_to_sigma(0.2), rel_tol=1e-6)
    assert math.isclose(second.sigma_end, comfy_percent_to_sigma(0.7), rel_tol=1e-6)
    assert third.area == (2, 4, 2, 0)  # round half to even: 2.5 -> 2, 1.5 -> 2, 0.5 -> 0
    x = torch.randn(1, 4, 8, 8)
    cond, uncond = calc_cond_batch(model.denoiser(), [[first, second, third], None], x, torch.tensor([1.0]))
    assert cond.shape == x.shape and bool(torch.isfinite(cond).all())


def test_mask_bounds_become_the_area_at_least_eight_cells_and_an_empty_mask_the_corner(sdxl):
    model, _, _ = sdxl
    context, pooled = torch.randn(1, 77, model.unet.config.context_dim), torch.randn(1, 128)
    mask = torch.zeros(1, 16, 16)
    mask[0, 1:3, 3:14] = 1.0
    empty = torch.zeros(1, 16, 16)
    entries = model.guidance_conditioning([[context, {"pooled_output": pooled, "mask": mask,
                                                      "set_area_to_bounds": True}],
                                           [context, {"pooled_output": pooled, "mask": empty,
                                                      "set_area_to_bounds": True}]], 128, 128)
    assert [e.area for e in entries] == [(8, 11, 1, 3), (8, 8, 0, 0)]


def test_percent_to_sigma_follows_comfyuis_discrete_and_flux_rules():
    sampling = EpsPrediction()
    for percent in (0.0, 0.1, 0.37, 0.5, 0.999, 1.0):
        assert math.isclose(sampling.percent_to_sigma(percent), comfy_percent_to_sigma(percent), rel_tol=1e-6)
    flux = FluxFlowMatching(shift=1.15)
    for percent in (0.25, 0.6):
        t = 1 - percent
        assert math.isclose(flux.percent_to_sigma(percent), math.exp(1.15) / (math.exp(1.15) + (1 / t - 1)),
                            rel_tol=1e-6)
    assert (flux.percent_to_sigma(0.0), flux.percent_to_sigma(1.0)) == (1.0, 0.0)


def test_a_bad_conditioning_is_a_clear_error(sdxl):
    model, _, _ = sdxl
    context, pooled = torch.randn(1, 77, model.unet.config.context_dim), torch.randn(1, 128)
    with pytest.raises(ValueError, match="area .* is not"):
        model.guidance_conditioning([[context, {"pooled_output": pooled, "area": (1, 2)}]], 64, 64)
    with pytest.raises(ValueError, match="conditioning width 5 does not suit"):
        model.guidance_conditioning([[torch.zeros(1, 77, 5), {"pooled_output": pooled}]], 64, 64)
    with pytest.raises(ValueError, match="empty"):
        model.guidance_conditioning([], 64, 64)
    with pytest.raises(ValueError, match="expected a CONDITIONING"):
        model.guidance_conditioning([[torch.zeros(77, 5), {}]], 64, 64)


def test_an_area_conditioned_flux_step_is_the_crop_predict_paste_average(flux):
    model, _, _ = flux
    config = model.unet.config
    generator = torch.Generator().manual_seed(0)
    t5 = torch.randn(1, 16, config.context_in_dim, generator=generator)
    pooled = torch.randn(1, config.vec_in_dim, generator=generator)
    area = (5, 3, 1, 4)  # odd sizes: FLUX pads the crop to its 2 x 2 patches
    conditioning = [[t5, {"pooled_output": pooled, "guidance": 2.0}],
                    [t5 * -1, {"pooled_output": pooled * 0.5, "area": area, "strength": 2.0}]]
    entries = model.guidance_conditioning(conditioning, 64, 64)
    assert [e.guidance for e in entries] == [2.0, 3.5]  # FLUX dev's default where FluxGuidance set none
    denoiser = model.denoiser()
    x, sigma = torch.randn(1, 16, 8, 8, generator=generator), torch.tensor([0.7])
    out = CFGDenoiser(denoiser, entries, None, 1.0)(x, sigma)
    h, w, top, left = area
    with torch.no_grad():
        whole = denoiser(x, sigma, context=t5, y=pooled, guidance=torch.tensor([2.0]))
        crop = denoiser(x[:, :, top:top + h, left:left + w], sigma, context=-t5, y=pooled * 0.5,
                        guidance=torch.tensor([3.5]))
    weight = torch.full((h, w), 2.0)  # ramps of min(8, size // 4) = 1 cell leave the weight as it is
    pasted, count = torch.zeros_like(x), torch.ones(8, 8)
    pasted[:, :, top:top + h, left:left + w] = crop * weight
    count[top:top + h, left:left + w] += weight
    torch.testing.assert_close(out, (whole + pasted) / (1e-37 + count), rtol=1e-5, atol=1e-5)
