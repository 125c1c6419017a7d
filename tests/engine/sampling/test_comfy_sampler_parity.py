"""ComfyUI parity of the KSampler path's sampler-specific rules (issue 23), against ComfyUI's behaviour
re-derived here from its source (comfy/samplers.py, comfy/k_diffusion/sampling.py) and torchsde itself:

- KSampler.calculate_sigmas: dpm_2, dpm_2_ancestral, uni_pc, uni_pc_bh2 get steps + 1 sigmas less the
  second-to-last (DISCARD_PENULTIMATE_SIGMA_SAMPLERS); BasicScheduler does not.
- default_noise_sampler: a generator on the latent's device, seeded with the seed (+ 1 on the CPU).
- BrownianTreeNoiseSampler over torchsde.BrownianTree(sigma_min, 0, sigma_max, entropy=seed) for the DPM++
  SDE samplers, sigma_min = the smallest non-zero sigma, sigma_max = the largest.
"""

import math

import numpy as np
import pytest
import torch
import torchsde

from engine.sampling.guidance import CFGDenoiser, Conditioning
from engine.sampling.model_sampling import Denoiser, EpsPrediction
from engine.sampling.noise import BrownianTreeNoiseSampler, prepare_noise, step_noise_seed
from engine.sampling.registry import SAMPLERS, discards_penultimate_sigma, step_noise_sampler
from engine.sampling.sample import ksampler_sigmas, sample, sample_sigmas

pytestmark = pytest.mark.filterwarnings("ignore:Should have tb<=t1")  # torchsde on float32 ends, as ComfyUI

DISCARDING = ["dpm_2", "dpm_2_ancestral", "uni_pc", "uni_pc_bh2"]


def sd1_log_sigmas() -> np.ndarray:
    """SD1's 1000 discrete sigmas (scaled-linear betas 0.00085..0.012), float32 as ComfyUI's buffer."""
    betas = np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=np.float64) ** 2
    alphas_cumprod = np.cumprod(1 - betas)
    return np.log(((1 - alphas_cumprod) / alphas_cumprod) ** 0.5).astype(np.float32)


def comfy_normal(n: int) -> np.ndarray:
    """ComfyUI's normal_scheduler on SD1: timesteps linspace(999, 0, n), sigmas log-interpolated, then 0."""
    log_sigmas = sd1_log_sigmas()
    out = []
    for t in np.linspace(999.0, 0.0, n, dtype=np.float32):
        low, high = math.floor(t), math.ceil(t)
        w = t - low
        out.append(math.exp((1 - w) * log_sigmas[low] + w * log_sigmas[high]))
    return np.array(out + [0.0])


def comfy_karras(n: int) -> np.ndarray:
    """k-diffusion get_sigmas_karras (rho 7) between SD1's sigma_min and sigma_max, then 0."""
    log_sigmas = sd1_log_sigmas()
    lo, hi = math.exp(log_sigmas[0]) ** (1 / 7), math.exp(log_sigmas[-1]) ** (1 / 7)
    return np.array([(hi + r * (lo - hi)) ** 7 for r in np.linspace(0, 1, n)] + [0.0])


def drop_penultimate(sigmas: np.ndarray) -> np.ndarray:
    return np.concatenate([sigmas[:-2], sigmas[-1:]])


@pytest.mark.parametrize("scheduler, schedule", [("normal", comfy_normal), ("karras", comfy_karras)])
@pytest.mark.parametrize("sampler", DISCARDING + ["dpm2", "dpm2_a"])
def test_ksampler_drops_the_penultimate_of_steps_plus_one_sigmas(sampler, scheduler, schedule):
    ms = EpsPrediction()
    ours = ksampler_sigmas(ms, scheduler, 4, sampler=sampler).double().numpy()
    assert len(ours) == 5
    np.testing.assert_allclose(ours, drop_penultimate(schedule(5)), rtol=1e-5, atol=1e-6)
    # denoise 0.5: int(4 / 0.5) = 8 steps, computed as 9 less the penultimate, the last 5 kept
    ours = ksampler_sigmas(ms, scheduler, 4, denoise=0.5, sampler=sampler).double().numpy()
    np.testing.assert_allclose(ours, drop_penultimate(schedule(9))[-5:], rtol=1e-5, atol=1e-6)


def test_written_down_karras_sigmas_for_dpm_2():
    """The 4-step karras run of dpm_2 on SD1, written down from the formula: karras(5) is 14.6146, 4.79653,
    1.27410, 0.247950, 0.0291672, 0, and the KSampler drops 0.0291672."""
    expected = [14.614643, 4.796535, 1.274100, 0.2479499, 0.0]
    assert ksampler_sigmas(EpsPrediction(), "karras", 4, sampler="dpm_2").tolist() == pytest.approx(expected,
                                                                                                   rel=1e-4)


@pytest.mark.parametrize("sampler", ["euler", "euler_ancestral", "heun", "dpmpp_2m", "ddim", None])
def test_other_samplers_and_basic_scheduler_keep_the_plain_schedule(sampler):
    ours = ksampler_sigmas(EpsPrediction(), "normal", 4, sampler=sampler).double().numpy()
    np.testing.assert_allclose(ours, comfy_normal(4), rtol=1e-5, atol=1e-6)
    assert discards_penultimate_sigma("DPM_2_A") and not discards_penultimate_sigma("euler")


POSITIVE = Conditioning(torch.full((1, 77, 8), 0.3))
NEGATIVE = Conditioning(torch.full((1, 77, 8), -0.2))


class ToyUnet:
    """An eps-predicting 'network' that records the sigmas (via timesteps) it is asked at."""

    def __call__(self, x_in, timesteps, context, y=None):
        return 0.2 * x_in + context.mean(dim=(1, 2)).reshape(-1, 1, 1, 1)


def test_ksampler_job_runs_dpm_2_on_the_discarding_sigmas():
    seen = []

    class Spy(Denoiser):
        def __call__(self, x, sigma, *args, **kwargs):
            seen.append(float(torch.as_tensor(sigma).flatten()[0]))
            return super().__call__(x, sigma, *args, **kwargs)

    spy = Spy(ToyUnet(), EpsPrediction())
    sample(spy, torch.zeros(1, 4, 8, 8), POSITIVE, NEGATIVE, 5.0, "dpm_2", "karras", 4, seed=1)
    expected = drop_penultimate(comfy_karras(5))
    # dpm_2 evaluates every sigma but the final 0: the last one is the 6-sigma schedule's 4th from the end
    assert min(seen) == pytest.approx(expected[-2], rel=1e-5)
    assert min(seen) != pytest.approx(comfy_karras(4)[-2], rel=1e-3)


class ZeroX0:
    """A guided denoiser predicting x0 = 0 (the model sampling is SD1's)."""

    model_sampling = EpsPrediction()

    def __call__(self, x, sigma, **extra):
        return torch.zeros_like(x)


def test_ancestral_step_noise_is_comfyui_default_noise_sampler_on_the_cpu():
    """euler_ancestral, x0 = 0: x_next = x sigma_down / sigma + noise sigma_up, the noise that of a CPU
    generator seeded 42 + 1 (ComfyUI's default_noise_sampler for a CPU latent)."""
    sigmas = torch.tensor([14.614643, 4.9346094, 0.0])
    latent = torch.zeros(1, 4, 8, 8)
    noise = prepare_noise(latent, 42)
    out = sample_sigmas(ZeroX0(), latent, noise, sigmas[:2], SAMPLERS["euler_a"], seed=42)
    x = noise * math.sqrt(1 + 14.614643 ** 2)
    s, s_next = 14.614643, 4.9346094
    sigma_up = min(s_next, (s_next ** 2 * (s ** 2 - s_next ** 2) / s ** 2) ** 0.5)
    sigma_down = (s_next ** 2 - sigma_up ** 2) ** 0.5
    step_noise = (out - x * sigma_down / s) / sigma_up
    expected = torch.randn(latent.shape, generator=torch.Generator("cpu").manual_seed(43))
    assert torch.allclose(step_noise, expected, atol=1e-4)
    assert not torch.allclose(step_noise, noise, atol=1e-1)  # not the initial noise again


def test_step_noise_seed_is_the_seed_on_an_accelerator_and_seed_plus_one_on_the_cpu():
    assert step_noise_seed(42, torch.device("cpu")) == 43
    assert step_noise_seed(42, torch.device("cuda", 0)) == 42
    assert step_noise_seed(42, "mps") == 42
    x = torch.zeros(2, 4, 3, 3, dtype=torch.float64)
    draw = step_noise_sampler(SAMPLERS["lcm"], x, torch.tensor([1.0, 0.0]), 42)(1.0, 0.5)
    assert draw.dtype == torch.float64  # drawn in the latent's dtype, as ComfyUI
    assert torch.equal(draw, torch.randn(x.shape, dtype=torch.float64,
                                         generator=torch.Generator().manual_seed(43)))


def torchsde_increment(tree, sigma: float, sigma_next: float) -> torch.Tensor:
    """ComfyUI's normalised Brownian increment from sigma down to sigma_next, from torchsde directly."""
    lo, hi = torch.tensor(sigma_next), torch.tensor(sigma)
    return -tree(lo, hi) / abs(sigma_next - sigma) ** 0.5


def test_brownian_tree_first_draws_are_torchsde_with_comfyui_arguments():
    x = torch.zeros(1, 4, 6, 6)
    sigmas = torch.tensor([14.614643, 4.9346094, 0.7086788, 0.0291675, 0.0])
    ours = BrownianTreeNoiseSampler(x, sigmas[sigmas > 0].min(), sigmas.max(), seed=42, cpu=True)
    tree = torchsde.BrownianTree(torch.tensor(0.0291675), torch.zeros(1, 4, 6, 6), torch.tensor(14.614643),
                                 entropy=42)
    for i in range(3):
        expected = torchsde_increment(tree, float(sigmas[i]), float(sigmas[i + 1]))
        assert torch.allclose(ours(sigmas[i], sigmas[i + 1]), expected, atol=1e-5)
    other = BrownianTreeNoiseSampler(x, sigmas[sigmas > 0].min(), sigmas.max(), seed=43, cpu=True)
    assert not torch.allclose(other(sigmas[0], sigmas[1]), torchsde_increment(tree, 14.614643, 4.9346094),
                              atol=1e-1)


def test_registry_gives_the_dpmpp_sde_samplers_the_tree_and_er_sde_gaussians():
    x = torch.zeros(1, 4, 4, 4)
    sigmas = torch.tensor([10.0, 2.0, 0.5, 0.0])
    for name in ("dpm++sde", "dpm++2m_sde", "dpm++2m_sde_heun", "dpm++3m_sde", "dpmpp_2m_sde_gpu"):
        noise = step_noise_sampler(SAMPLERS[name], x, sigmas, 7)
        assert isinstance(noise, BrownianTreeNoiseSampler), name
        assert noise.cpu == (not name.endswith("_gpu"))
    assert not isinstance(step_noise_sampler(SAMPLERS["er_sde"], x, sigmas, 7), BrownianTreeNoiseSampler)


def test_dpmpp_2m_sde_run_is_comfyui_loop_with_torchsde_noise():
    """4 karras steps of dpmpp_2m_sde through sample_sigmas against ComfyUI's loop written out here, its
    noise from torchsde.BrownianTree(sigma_min, 0, sigma_max, entropy=seed) called directly."""
    seed = 42
    guided = CFGDenoiser(Denoiser(ToyUnet(), EpsPrediction()), POSITIVE, NEGATIVE, 5.0)
    sigmas = torch.tensor(comfy_karras(4), dtype=torch.float32)
    latent = torch.zeros(1, 4, 8, 8)
    noise = prepare_noise(latent, seed)
    ours = sample_sigmas(guided, latent, noise, sigmas, SAMPLERS["dpm++2m_sde"], seed)

    tree = torchsde.BrownianTree(sigmas[sigmas > 0].min(), torch.zeros_like(latent), sigmas.max(),
                                 entropy=seed)
    x = noise * torch.sqrt(1.0 + sigmas[0] ** 2)
    s_in = x.new_ones([1])
    old_denoised, h_last = None, None
    for i in range(len(sigmas) - 1):
        denoised = guided(x, sigmas[i] * s_in)
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            lam_s, lam_t = -sigmas[i].log(), -sigmas[i + 1].log()
            h = lam_t - lam_s
            alpha_t = sigmas[i + 1] * lam_t.exp()  # 1 for an eps model
            x = sigmas[i + 1] / sigmas[i] * (-h).exp() * x + alpha_t * (-2 * h).expm1().neg() * denoised
            if old_denoised is not None:
                x = x + 0.5 * alpha_t * (-2 * h).expm1().neg() * (h / h_last) * (denoised - old_denoised)
            increment = -tree(sigmas[i + 1], sigmas[i]) / (sigmas[i] - sigmas[i + 1]).sqrt()
            x = x + increment * sigmas[i + 1] * (-2 * h).expm1().neg().sqrt()
            h_last = h
        old_denoised = denoised
    assert torch.allclose(ours, x, atol=1e-4), (ours - x).abs().max()


def test_batch_index_noise_is_comfyui_prepare_noise_with_noise_inds():
    """ComfyUI draws max(batch_index) + 1 single-item noises from the seed and gives item k the
    batch_index[k]-th: a latent taken out of a batch keeps the noise it had there."""
    latent = torch.zeros(3, 4, 2, 2)
    generator = torch.Generator().manual_seed(9)
    draws = [torch.randn(1, 4, 2, 2, generator=generator) for _ in range(3)]
    assert torch.equal(prepare_noise(latent, 9, [2, 0, 2]), torch.cat([draws[2], draws[0], draws[2]]))
    whole = prepare_noise(torch.zeros(3, 4, 2, 2), 9)
    assert torch.equal(prepare_noise(torch.zeros(1, 4, 2, 2), 9, [1]), whole[1:2])  # its noise in the batch
    assert not torch.equal(prepare_noise(torch.zeros(1, 4, 2, 2), 9), whole[1:2])
    with pytest.raises(ValueError, match="batch_index must give a non-negative index per latent item"):
        prepare_noise(latent, 9, [0, 1])
