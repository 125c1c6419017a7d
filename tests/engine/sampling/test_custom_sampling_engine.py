"""The engine side of the custom-sampling nodes: `sample_sigmas` (the KSampler's second half), the NOISE and
SAMPLER values, and the guidance strength that FluxGuidance threads through CFGDenoiser and Denoiser."""

import pytest
import torch

from engine.sampling.guidance import CFGDenoiser, Conditioning
from engine.sampling.model_sampling import Denoiser, EpsPrediction, FlowMatching
from engine.sampling.noise import EmptyNoise, SeededNoise, prepare_noise
from engine.sampling.registry import SamplerChoice, resolve_sampler
from engine.sampling.sample import ksampler_sigmas, sample, sample_sigmas


class RecordingModel:
    """A k-diffusion denoiser that records its keyword arguments; x0 = 0.9 x (+ guidance when given)."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, sigma, context=None, y=None, **extra):
        self.calls.append({"batch": x.shape[0], **extra})
        out = 0.9 * x
        if "guidance" in extra:
            out = out + extra["guidance"].reshape(-1, 1, 1, 1)
        return out


def cond(value: float, guidance: float | None = None) -> Conditioning:
    return Conditioning(torch.full((1, 77, 8), value), guidance=guidance)


def test_cfg_batches_guidance_per_side_like_y():
    model = RecordingModel()
    guided = CFGDenoiser(model, cond(1.0, guidance=4.0), cond(0.0, guidance=2.5), cfg_scale=3.0)
    out = guided(torch.zeros(2, 4, 8, 8), torch.tensor(1.0))
    assert torch.equal(model.calls[0]["guidance"], torch.tensor([4.0, 4.0, 2.5, 2.5]))  # (2B,): cond, uncond
    assert torch.allclose(out, torch.full_like(out, 2.5 + 3.0 * (4.0 - 2.5)))


def test_one_sided_guidance_is_used_for_both_sides_and_none_passes_no_guidance_argument():
    model = RecordingModel()
    CFGDenoiser(model, cond(1.0, guidance=3.5), cond(0.0), cfg_scale=2.0)(torch.zeros(1, 4, 8, 8), 1.0)
    CFGDenoiser(model, cond(1.0), cond(0.0, guidance=6.0), cfg_scale=2.0)(torch.zeros(1, 4, 8, 8), 1.0)
    CFGDenoiser(model, cond(1.0, guidance=5.0), None, cfg_scale=1.0)(torch.zeros(3, 4, 8, 8), 1.0)
    CFGDenoiser(model, cond(1.0), cond(0.0), cfg_scale=2.0)(torch.zeros(1, 4, 8, 8), 1.0)
    assert torch.equal(model.calls[0]["guidance"], torch.tensor([3.5, 3.5]))
    assert torch.equal(model.calls[1]["guidance"], torch.tensor([6.0, 6.0]))
    assert torch.equal(model.calls[2]["guidance"], torch.tensor([5.0, 5.0, 5.0]))  # cfg 1: one pass, (B,)
    assert "guidance" not in model.calls[3]


def test_denoiser_forwards_guidance_only_when_given():
    seen = []

    def sd_unet(x, timesteps, context, y=None):  # no guidance input, like the SD UNet
        seen.append("sd")
        return torch.zeros_like(x)

    def flux_net(x, timesteps, context, y=None, guidance=None):
        seen.append(guidance)
        return torch.zeros_like(x)

    x = torch.randn(2, 4, 8, 8)
    Denoiser(sd_unet, EpsPrediction())(x, torch.tensor(1.0), context=torch.zeros(2, 77, 8))
    Denoiser(flux_net, FlowMatching())(x, torch.tensor(0.5), context=torch.zeros(2, 77, 8),
                                       guidance=torch.tensor([3.5, 3.5]))
    assert seen[0] == "sd" and torch.equal(seen[1], torch.tensor([3.5, 3.5]))


def test_sample_sigmas_from_ksampler_sigmas_is_the_ksampler_job():
    model_sampling = EpsPrediction()
    model = Denoiser(lambda x, t, context, y=None: 0.1 * x + context.mean(), model_sampling)
    latent, positive, negative = torch.randn(1, 4, 8, 8), cond(0.5), cond(-0.5)
    for sampler in ("euler", "euler_ancestral", "dpmpp_2m_sde"):
        reference = sample(model, latent, positive, negative, 5.0, sampler, "karras", 4, seed=9, denoise=0.6)
        sigmas = ksampler_sigmas(model_sampling, "karras", 4, denoise=0.6)
        guided = CFGDenoiser(model, positive, negative, 5.0)
        noise = SeededNoise(9).generate(latent)
        ours = sample_sigmas(guided, latent, noise, sigmas, resolve_sampler(sampler), 9)
        assert torch.equal(ours, reference), sampler


def test_sample_sigmas_with_no_or_one_sigma_never_calls_the_model():
    model = RecordingModel()
    model.model_sampling = EpsPrediction()
    latent, noise = torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8)
    euler = resolve_sampler("euler")
    assert torch.equal(sample_sigmas(model, latent, noise, torch.zeros(0), euler, 0), latent)
    noised = sample_sigmas(model, latent, noise, torch.tensor([2.0]), euler, 0)
    assert torch.equal(noised, latent + noise * 2.0)  # ComfyUI noises the latent to its one sigma
    top = model.model_sampling.sigma_max
    from_top = sample_sigmas(model, latent, noise, top.reshape(1), euler, 0)
    assert torch.allclose(from_top, latent + noise * (1 + top ** 2).sqrt())  # at sigma_max: sqrt(1 + s^2)
    assert model.calls == []


def test_noise_values_and_sampler_choice():
    latent = torch.zeros(2, 4, 8, 8)
    assert torch.equal(SeededNoise(5).generate(latent), prepare_noise(latent, 5))
    assert not torch.equal(SeededNoise(5).generate(latent), SeededNoise(6).generate(latent))
    assert torch.equal(EmptyNoise().generate(latent), latent) and EmptyNoise().seed == 0
    assert SamplerChoice("euler_ancestral").function is resolve_sampler("euler_a")
    with pytest.raises(ValueError, match="unknown sampler 'bogus'; accepted:"):
        SamplerChoice("bogus")
