"""Noise masks and inpainting UNets in the sampler, against ComfyUI's behaviour written down here:
comfy.utils.reshape_mask (bilinear to the latent, channels and batch repeated), KSamplerX0Inpaint (blend the
latent noised to sigma with the job's noise into every model input, and the latent into every prediction),
ComfyUI's ddim (euler blending fresh noise, a CPU draw seeded seed + 1), and BaseModel.concat_cond for
9-channel UNets (mask, rounded, then the masked image's latent; ones and a blank latent without a mask)."""

import math

import pytest
import torch

from engine.sampling.guidance import CFGDenoiser, Conditioning
from engine.sampling.inpaint import (
    BLANK_INPAINT_LATENT,
    InpaintDenoiser,
    inpaint_concat,
    latent_noise_mask,
    resize_to_batch,
)
from engine.sampling.model_sampling import Denoiser, EpsPrediction, FluxFlowMatching
from engine.sampling.noise import prepare_noise
from engine.sampling.sample import ksampler_sigmas, sample

POSITIVE = Conditioning(torch.full((1, 5, 8), 0.3))
NEGATIVE = Conditioning(torch.full((1, 5, 8), -0.2))


def mixing_unet(x_in, timesteps, context, y=None):
    """An eps 'network' that mixes every latent cell with the image mean, so what is blended in outside the
    mask reaches the prediction inside it."""
    bias = context.mean(dim=(1, 2)).reshape(-1, 1, 1, 1)
    return 0.3 * x_in + 0.2 * x_in.mean(dim=(2, 3), keepdim=True) + bias


def hole_mask(height: int = 16, width: int = 16) -> torch.Tensor:
    """(1, 1, H, W): 1 (resample) in a centred square, 0 (keep) around it."""
    mask = torch.zeros(1, 1, height, width)
    mask[:, :, height // 4:3 * height // 4, width // 4:3 * width // 4] = 1.0
    return mask


def test_latent_noise_mask_is_comfyui_reshape_mask():
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0],
                         [0.0, 1.0, 1.0, 1.0],
                         [1.0, 1.0, 0.0, 0.0],
                         [1.0, 0.5, 0.0, 0.0]])[None]  # (1, 4, 4)
    out = latent_noise_mask(mask, (3, 2, 2, 2))
    # bilinear halving with align_corners False samples each 2 x 2 block's centre: the block means
    expected = torch.tensor([[0.25, 1.0], [0.875, 0.0]])
    assert out.shape == (3, 2, 2, 2)
    assert torch.equal(out, expected.expand(3, 2, 2, 2))
    two = torch.stack([torch.zeros(2, 2), torch.ones(2, 2)])[:, None]  # (2, 1, 2, 2), already latent size
    assert latent_noise_mask(two, (3, 4, 2, 2))[:, 0, 0, 0].tolist() == [0.0, 1.0, 0.0]  # repeated, then cut
    assert latent_noise_mask(torch.ones(5, 2, 2), (2, 4, 2, 2)).shape == (2, 4, 2, 2)  # the first two


def test_inpaint_denoiser_blends_as_ksampler_x0_inpaint():
    latent, noise = torch.randn(1, 4, 2, 2), torch.randn(1, 4, 2, 2)
    mask = torch.tensor([[1.0, 0.0], [0.25, 1.0]]).expand(1, 4, 2, 2)
    seen = []

    class Model:
        model_sampling = EpsPrediction()

        def __call__(self, x, sigma, **extra):
            seen.append(x)
            return 0.5 * x

    out = InpaintDenoiser(Model(), latent, noise, mask)(torch.full((1, 4, 2, 2), 3.0), torch.tensor(2.0))
    blended = 3.0 * mask + (latent + 2.0 * noise) * (1 - mask)
    assert torch.allclose(seen[0], blended)
    assert torch.allclose(out, 0.5 * blended * mask + latent * (1 - mask))


def euler_with_mask(guided, latent, noise, blend_noise, mask, sigmas):
    """ComfyUI's euler sampler through KSAMPLER and KSamplerX0Inpaint, written out."""
    x = latent + noise * math.sqrt(1 + float(sigmas[0]) ** 2)  # max_denoise noise scaling
    for i in range(len(sigmas) - 1):
        x_in = x * mask + (latent + blend_noise * sigmas[i]) * (1 - mask)
        denoised = guided(x_in, sigmas[i].expand(x.shape[0])) * mask + latent * (1 - mask)
        x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
    return x


def test_ksampler_with_a_noise_mask_is_comfyui_euler_through_the_inpainting_wrapper():
    latent = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    mask = hole_mask()
    model = Denoiser(mixing_unet, EpsPrediction())
    ours = sample(model, latent, POSITIVE, NEGATIVE, 5.0, "euler", "karras", 4, seed=7, denoise_mask=mask)
    sigmas = ksampler_sigmas(EpsPrediction(), "karras", 4)
    noise = prepare_noise(latent, 7)
    expected = euler_with_mask(CFGDenoiser(model, POSITIVE, NEGATIVE, 5.0), latent, noise, noise,
                               latent_noise_mask(mask, latent.shape), sigmas)
    assert torch.allclose(ours, expected, atol=1e-5)


def test_comfyui_ddim_is_euler_blending_fresh_noise_seeded_seed_plus_one():
    latent = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    mask = hole_mask()
    model = Denoiser(mixing_unet, EpsPrediction())
    ddim = sample(model, latent, POSITIVE, NEGATIVE, 5.0, "ddim", "karras", 4, seed=7, denoise_mask=mask)
    sigmas = ksampler_sigmas(EpsPrediction(), "karras", 4)
    fresh = torch.randn(latent.shape, generator=torch.Generator().manual_seed(8))
    expected = euler_with_mask(CFGDenoiser(model, POSITIVE, NEGATIVE, 5.0), latent, prepare_noise(latent, 7),
                               fresh, latent_noise_mask(mask, latent.shape), sigmas)
    assert torch.allclose(ddim, expected, atol=1e-5)
    euler = sample(model, latent, POSITIVE, NEGATIVE, 5.0, "euler", "karras", 4, seed=7, denoise_mask=mask)
    assert (ddim - euler).abs().max() > 1e-3
    no_mask = sample(model, latent, POSITIVE, NEGATIVE, 5.0, "ddim", "karras", 4, seed=7)
    assert torch.equal(no_mask, sample(model, latent, POSITIVE, NEGATIVE, 5.0, "euler", "karras", 4, seed=7))


# Samplers that end on a prediction keep the masked-out latent to rounding; UniPC ends at sigma 0.001.
MASKED_OUT_TOLERANCE = {"uni_pc": 5e-3, "uni_pc_bh2": 5e-3}  # the noise at sigma 0.001


@pytest.mark.parametrize("name", ["euler", "euler_ancestral", "heun", "dpmpp_2m", "dpmpp_2m_sde",
                                  "dpmpp_3m_sde", "lcm", "uni_pc", "uni_pc_bh2", "res_multistep_cfg_pp",
                                  "seeds_2", "sa_solver", "ddim", "dpmpp_2s_ancestral_cfg_pp", "deis"])
def test_masked_out_latent_is_the_original_at_the_end(name):
    latent = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    mask = hole_mask()
    keep = latent_noise_mask(mask, latent.shape) == 0
    model = Denoiser(mixing_unet, EpsPrediction())
    out = sample(model, latent, POSITIVE, NEGATIVE, 5.0, name, "karras", 5, seed=7, denoise_mask=mask)
    assert (out - latent)[keep].abs().max() < MASKED_OUT_TOLERANCE.get(name, 1e-5)
    assert (out - latent)[~keep].abs().max() > 0.1
    partial = sample(model, latent, POSITIVE, NEGATIVE, 5.0, name, "karras", 5, seed=7, denoise_mask=mask,
                     denoise=0.5)
    assert (partial - latent)[keep].abs().max() < MASKED_OUT_TOLERANCE.get(name, 1e-5)


def test_resize_to_batch_picks_evenly_as_comfyui():
    items = torch.arange(4.0)[:, None]
    assert resize_to_batch(items[:2], 4).flatten().tolist() == [0.0, 0.0, 1.0, 1.0]
    assert resize_to_batch(items[:3], 2).flatten().tolist() == [0.0, 2.0]
    assert resize_to_batch(items, 3).flatten().tolist() == [0.0, 2.0, 3.0]
    assert resize_to_batch(items, 1).flatten().tolist() == [0.0]


def test_inpaint_concat_is_comfyui_concat_cond():
    latent = torch.randn(2, 4, 2, 2)
    concat_latent = torch.randn(1, 4, 2, 2)
    pixel_mask = torch.tensor([[0.0, 0.0, 1.0, 1.0],
                               [0.0, 1.0, 1.0, 1.0],
                               [1.0, 1.0, 0.0, 0.0],
                               [1.0, 0.0, 0.0, 1.0]])[None, None]  # block means 0.25, 1, 0.75, 0.25
    out = inpaint_concat(latent.shape, latent, None, concat_latent, pixel_mask)
    assert out.shape == (2, 5, 2, 2)
    assert torch.equal(out[:, 0], torch.tensor([[0.0, 1.0], [1.0, 0.0]]).expand(2, 2, 2))  # rounded
    assert torch.equal(out[:, 1:], concat_latent.expand(2, 4, 2, 2))
    noise_mask = torch.tensor([[0.5, 0.51], [0.49, 1.0]]).expand(2, 4, 2, 2)  # a sampler's (B, C, h, w) mask
    out = inpaint_concat(latent.shape, latent, noise_mask)
    assert torch.equal(out[:, 0], torch.tensor([[0.0, 1.0], [0.0, 1.0]]).expand(2, 2, 2))  # 0.5 rounds to 0
    assert torch.equal(out[:, 1:], latent)
    out = inpaint_concat(latent.shape, latent, None)
    assert torch.equal(out[:, 0], torch.ones(2, 2, 2))
    assert torch.equal(out[:, 1:, 1, 0], torch.tensor(BLANK_INPAINT_LATENT).expand(2, 4))


def test_denoiser_and_cfg_feed_the_concat_channels_after_the_scaled_input():
    seen = []

    def unet(x_in, timesteps, context, y=None):
        seen.append(x_in)
        return x_in[:, :4]

    concat_pos, concat_neg = torch.full((1, 5, 2, 2), 7.0), torch.full((1, 5, 2, 2), -7.0)
    guided = CFGDenoiser(Denoiser(unet, EpsPrediction()), Conditioning(POSITIVE.context, concat=concat_pos),
                         Conditioning(NEGATIVE.context, concat=concat_neg), 3.0)
    x = torch.ones(2, 4, 2, 2)
    guided(x, torch.tensor(1.0))
    assert seen[0].shape == (4, 9, 2, 2)
    assert torch.allclose(seen[0][:, :4], x.repeat(2, 1, 1, 1) / math.sqrt(2))  # calculate_input at sigma 1
    assert torch.equal(seen[0][:2, 4:], concat_pos.expand(2, 5, 2, 2))  # cond rows first
    assert torch.equal(seen[0][2:, 4:], concat_neg.expand(2, 5, 2, 2))
    seen.clear()  # entries batch only when they agree on having a concat (ComfyUI's can_concat of c_concat)
    CFGDenoiser(Denoiser(unet, EpsPrediction()), Conditioning(POSITIVE.context, concat=concat_pos), NEGATIVE,
                3.0)(x, torch.tensor(1.0))
    assert sorted(t.shape[1] for t in seen) == [4, 9]
    seen.clear()  # an entry's concat is cut to its area, as the latent (CONDNoiseShape.process_cond)
    concat = torch.arange(20.0).reshape(1, 5, 2, 2)
    entry = Conditioning(POSITIVE.context, concat=concat, area=(1, 2, 1, 0))
    CFGDenoiser(Denoiser(unet, EpsPrediction()), entry, None, 1.0)(x, torch.tensor(1.0))
    assert torch.equal(seen[0][:, 4:], concat[:, :, 1:2, :].expand(2, 5, 1, 2))


def test_cfg_pp_sees_the_unblended_unconditional_prediction_through_the_mask():
    """ComfyUI's post-CFG hook stores the unconditional prediction before KSamplerX0Inpaint blends."""
    model = CFGDenoiser(Denoiser(mixing_unet, EpsPrediction()), POSITIVE, NEGATIVE, 4.0)
    latent = torch.zeros(1, 4, 2, 2)
    wrapped = InpaintDenoiser(model, latent, torch.zeros_like(latent), torch.zeros(1, 4, 2, 2))
    wrapped.keep_uncond = True
    out = wrapped(torch.ones(1, 4, 2, 2), torch.tensor(1.0))
    assert torch.equal(out, latent)  # all kept
    assert wrapped.last_uncond_denoised.abs().max() > 0.1 and model.keep_uncond


@pytest.mark.parametrize("name", ["euler", "euler_ancestral", "dpmpp_2m_sde", "seeds_2", "uni_pc"])
def test_flow_models_keep_the_masked_out_latent_too(name):
    """On a flow model the blend noises the latent as (1 - sigma) latent + sigma noise (the model sampling's
    noise_scaling, as ComfyUI's CONST); samplers stepping in VE coordinates see the blended model too."""

    def flow_unet(x_in, timesteps, context, y=None):  # a velocity
        return 0.5 * x_in + 0.1 * x_in.mean(dim=(2, 3), keepdim=True) + context.mean()

    model = Denoiser(flow_unet, FluxFlowMatching(1.15))
    latent = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    mask = hole_mask()
    keep = latent_noise_mask(mask, latent.shape) == 0
    out = sample(model, latent, POSITIVE, NEGATIVE, 3.0, name, "simple", 5, seed=7, denoise_mask=mask,
                 family="flux")
    assert (out - latent)[keep].abs().max() < MASKED_OUT_TOLERANCE.get(name, 1e-5)
    assert (out - latent)[~keep].abs().max() > 0.1
