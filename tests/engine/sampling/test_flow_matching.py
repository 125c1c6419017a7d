"""Rectified-flow sampling (FLUX, SD3) against independent references: ComfyUI's formulas re-derived here in
float64 Python, diffusers' FlowMatchEulerDiscreteScheduler, and the exact flow of Gaussian data.

Tolerances: our sigma tables are float32 as ComfyUI's, so schedules match a float64 derivation to 1e-5
relative (1e-7 absolute near 0); samplers run in float64 against float64 hand-worked steps to 1e-10.
"""

import inspect
import math
import re

import mpmath
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from engine.sampling.flow import FLOW_REFUSED_SAMPLERS
from engine.sampling.guidance import Conditioning
from engine.sampling.model_sampling import (
    Denoiser,
    FlowMatching,
    FluxFlowMatching,
    flux_shift_for,
    max_denoise,
)
from engine.sampling.noise import default_noise_sampler, prepare_noise
from engine.sampling.registry import SAMPLERS
from engine.sampling.sample import ksampler_sigmas, sample
from engine.sampling.schedulers import SCHEDULERS, calculate_sigmas

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # diffusers vs NumPy 2, not ours

FLUX_SHIFTS = [1.15, flux_shift_for(768, 1344)]


# ---- ComfyUI's model samplings, re-derived in float64 -------------------------------------------------


def flux_sigma(shift: float, t: float) -> float:
    """ModelSamplingFlux.sigma: flux_time_shift(shift, 1, t) = e^shift / (e^shift + 1/t - 1)."""
    return math.exp(shift) / (math.exp(shift) + (1 / t - 1)) if t > 0 else 0.0


def sd3_sigma(shift: float, t: float) -> float:
    """ModelSamplingDiscreteFlow.sigma at timestep t * multiplier: time_snr_shift(shift, t)."""
    return shift * t / (1 + (shift - 1) * t)


class Reference:
    """A ComfyUI flow model sampling as plain floats: table, timestep(sigma) and sigma(timestep)."""

    def __init__(self, kind: str, shift: float, multiplier: float = 1000.0):
        self.kind, self.shift, self.multiplier = kind, shift, multiplier
        count = 10000 if kind == "flux" else 1000
        self.table = [self.shift_time((i + 1) / count) for i in range(count)]

    def shift_time(self, t: float) -> float:
        return flux_sigma(self.shift, t) if self.kind == "flux" else sd3_sigma(self.shift, t)

    def timestep(self, sigma: float) -> float:
        return sigma if self.kind == "flux" else sigma * self.multiplier

    def sigma(self, timestep: float) -> float:
        return self.shift_time(timestep if self.kind == "flux" else timestep / self.multiplier)


def _ours(kind: str, shift: float):
    return FluxFlowMatching(shift) if kind == "flux" else FlowMatching(shift)


def beta_quantile(p: float, a: float, b: float) -> float:
    if p <= 0 or p >= 1:
        return float(p)
    return float(mpmath.findroot(lambda x: mpmath.betainc(a, b, 0, x, regularized=True) - p, (0, 1),
                                 solver="bisect", tol=1e-30, maxsteps=200))


def comfy_schedule(name: str, ref: Reference, steps: int) -> list[float]:
    """ComfyUI's comfy/samplers.py schedulers (and k-diffusion's) for a flow model sampling."""
    table, n = ref.table, len(ref.table)
    smin, smax = table[0], table[-1]
    if name == "simple":
        return [table[-(1 + int(x * n / steps))] for x in range(steps)] + [0.0]
    if name in ("normal", "sgm_uniform"):
        start, end = ref.timestep(smax), ref.timestep(smin)
        count = steps + 1 if name == "sgm_uniform" else steps
        ts = [start + (end - start) * k / (count - 1) for k in range(count)]
        return [ref.sigma(t) for t in (ts[:-1] if name == "sgm_uniform" else ts)] + [0.0]
    if name == "karras":
        lo, hi = smin ** (1 / 7), smax ** (1 / 7)
        return [(hi + k / (steps - 1) * (lo - hi)) ** 7 for k in range(steps)] + [0.0]
    if name == "exponential":
        return [math.exp(math.log(smax) + k / (steps - 1) * (math.log(smin) - math.log(smax)))
                for k in range(steps)] + [0.0]
    if name == "ddim_uniform":
        stride = n // steps
        return [table[x] for x in range(1, n, stride)][::-1] + [0.0]
    if name == "beta":
        out, last = [], None
        for k in range(steps):
            t = int(np.rint(beta_quantile(1 - k / steps, 0.6, 0.6) * (n - 1)))
            if t != last:
                out.append(table[t])
            last = t
        return out + [0.0]
    if name == "kl_optimal":
        return [math.tan(k / (steps - 1) * math.atan(smin) + (1 - k / (steps - 1)) * math.atan(smax))
                for k in range(steps)] + [0.0]
    if name == "linear_quadratic":
        linear_steps, threshold = steps // 2, 0.025
        linear = [i * threshold / linear_steps for i in range(linear_steps)]
        diff = linear_steps - threshold * steps
        quad_steps = steps - linear_steps
        q = diff / (linear_steps * quad_steps ** 2)
        lin = threshold / linear_steps - 2 * diff / quad_steps ** 2
        quadratic = [q * i ** 2 + lin * i + q * linear_steps ** 2 for i in range(linear_steps, steps)]
        return [(1.0 - s) * smax for s in linear + quadratic + [1.0]]
    if name == "smoothstep":  # stable-diffusion.cpp: table index round(smoothstep(1 - i/n) * t_max)
        return [table[round((1 - k / steps) ** 2 * (3 - 2 * (1 - k / steps)) * (n - 1))]
                for k in range(steps)] + [0.0]
    if name == "lcm":  # stable-diffusion.cpp: skipping-step indices on a 50-step grid
        stride = n // 50
        return [table[(50 - (k * 50) // steps) * stride - 1] for k in range(steps)] + [0.0]
    raise KeyError(name)


# ---- model samplings ----------------------------------------------------------------------------------


def test_flux_shift_follows_comfyui_and_diffusers_token_count_line():
    assert flux_shift_for(1024, 1024) == pytest.approx(1.15, abs=1e-12)
    assert flux_shift_for(256, 256) == pytest.approx(0.5, abs=1e-12)
    assert flux_shift_for(768, 1344) == pytest.approx(0.5 + 0.65 * (768 * 1344 / 256 - 256) / 3840, abs=1e-12)
    for width, height in ((1024, 1024), (768, 1344), (512, 512), (2048, 1024)):
        seq_len = (width // 16) * (height // 16)  # FluxPipeline's packed 2x2 latent tokens
        assert flux_shift_for(width, height) == pytest.approx(calculate_shift(seq_len), abs=1e-12)
    assert flux_shift_for(1024, 1024, base_shift=0.3, max_shift=0.9) == pytest.approx(0.9, abs=1e-12)
    with pytest.raises(ValueError, match="positive pixels"):
        flux_shift_for(0, 512)


@pytest.mark.parametrize("shift", FLUX_SHIFTS + [0.5, 3.0])
def test_flux_table_is_flux_time_shift_of_t_over_10000(shift):
    ms, ref = FluxFlowMatching(shift), Reference("flux", shift)
    assert len(ms.sigmas) == 10000 and ms.sigmas.dtype == torch.float32
    assert float(ms.sigma_max) == 1.0  # max_denoise compares the first sigma with this
    assert float(ms.sigma_min) == pytest.approx(math.exp(shift) / (math.exp(shift) + 9999), rel=1e-6)
    assert np.allclose(ms.sigmas.double().numpy(), ref.table, rtol=1e-6, atol=0)
    sigma = torch.tensor([0.02, 0.5, 0.97])
    assert torch.equal(ms.timestep(sigma), sigma)  # FLUX multiplies by 1000 itself
    assert torch.allclose(ms.t_to_sigma(ms.sigma_to_t(sigma)), sigma, rtol=1e-6)
    assert ms.percent_to_sigma(0.0) == 1.0 and ms.percent_to_sigma(1.0) == 0.0
    assert ms.percent_to_sigma(0.3) == pytest.approx(flux_sigma(shift, 0.7), rel=1e-12)


@pytest.mark.parametrize("shift, multiplier", [(3.0, 1000.0), (1.0, 1.0), (2.5, 1.0)])
def test_discrete_flow_table_is_comfyui_model_sampling_discrete_flow(shift, multiplier):
    ms, ref = FlowMatching(shift, multiplier), Reference("sd3", shift, multiplier)
    assert len(ms.sigmas) == 1000 and float(ms.sigma_max) == 1.0
    assert np.allclose(ms.sigmas.double().numpy(), ref.table, rtol=1e-6, atol=0)
    sigma = torch.tensor([0.1, 0.6])
    assert torch.allclose(ms.timestep(sigma), sigma * multiplier)
    assert torch.allclose(ms.t_to_sigma(sigma * multiplier), torch.tensor([ref.sigma(v * multiplier)
                                                                           for v in (0.1, 0.6)]))
    assert ms.percent_to_sigma(0.25) == pytest.approx(sd3_sigma(shift, 0.75), rel=1e-12)


def test_denoiser_feeds_flux_the_sigma_and_returns_x_minus_sigma_v():
    seen = {}

    def velocity_net(x_in, timesteps, context, y=None):
        seen["x_in"], seen["timesteps"] = x_in, timesteps
        return 2 * x_in

    model = Denoiser(velocity_net, FluxFlowMatching())
    x, sigma = torch.randn(2, 3, 4, 4), torch.tensor([0.75, 0.25])
    out = model(x, sigma)
    assert torch.equal(seen["x_in"], x) and torch.equal(seen["timesteps"], sigma)
    assert torch.allclose(out, x - 2 * x * sigma.view(2, 1, 1, 1))


# ---- schedulers ---------------------------------------------------------------------------------------


COMFY_SCHEDULERS = ["simple", "normal", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta",
                    "kl_optimal", "linear_quadratic", "smoothstep", "lcm"]


@pytest.mark.parametrize("steps", [4, 9, 20])
@pytest.mark.parametrize("kind, shift", [("flux", s) for s in FLUX_SHIFTS] + [("sd3", 3.0)])
@pytest.mark.parametrize("name", COMFY_SCHEDULERS)
def test_flow_schedules_equal_comfyui_for_the_same_model_sampling(name, kind, shift, steps):
    ours = calculate_sigmas(name, _ours(kind, shift), steps).double().numpy()
    reference = comfy_schedule(name, Reference(kind, shift), steps)
    assert len(ours) == len(reference)
    assert np.allclose(ours, reference, rtol=1e-5, atol=1e-7), (name, ours, reference)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_scheduler_gives_flow_sigmas_in_0_1_ending_at_0_or_refuses(name):
    ms = FluxFlowMatching(1.15)
    if name in ("ays", "ays_sdxl", "gits"):
        with pytest.raises(ValueError, match=f"'{name.split('_')[0]}'.*rectified-flow"):
            calculate_sigmas(name, ms, 10)
        return
    sigmas = calculate_sigmas(name, ms, 10)
    assert float(sigmas[-1]) == 0.0 and bool((sigmas >= 0).all()) and bool((sigmas <= 1).all())
    assert bool((sigmas[:-1] > sigmas[1:]).all())


@pytest.mark.parametrize("steps", [4, 8, 20, 25])
@pytest.mark.parametrize("width, height", [(1024, 1024), (768, 1344), (512, 512)])
def test_flux_simple_schedule_equals_flux_pipeline_when_steps_divide_the_table(width, height, steps):
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096, time_shift_type="exponential")
    mu = calculate_shift((width // 16) * (height // 16))
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)  # as FluxPipeline
    ours = calculate_sigmas("simple", FluxFlowMatching(flux_shift_for(width, height)), steps)
    assert torch.allclose(ours, scheduler.sigmas, rtol=1e-6, atol=1e-7)


def test_flux_simple_schedule_differs_from_flux_pipeline_where_steps_do_not_divide_10000():
    """ComfyUI's simple scheduler truncates int(i * 10000 / steps): t is 1 - i/steps only approximately."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 7, 7), mu=1.15)
    difference = (calculate_sigmas("simple", FluxFlowMatching(1.15), 7) - scheduler.sigmas).abs().max()
    assert 1e-5 < float(difference) < 2e-4


@pytest.mark.parametrize("steps", [4, 7, 28])
def test_sd3_normal_schedule_equals_diffusers_default_and_simple_its_linspace_sigmas(steps):
    default = FlowMatchEulerDiscreteScheduler(shift=3.0)
    default.set_timesteps(steps)  # linspace of the shifted training timesteps, shifted again: as normal
    assert torch.allclose(calculate_sigmas("normal", FlowMatching(3.0), steps), default.sigmas, rtol=1e-6,
                          atol=1e-7)
    if 1000 % steps == 0:
        pipeline = FlowMatchEulerDiscreteScheduler(shift=3.0)
        pipeline.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps))
        assert torch.allclose(calculate_sigmas("simple", FlowMatching(3.0), steps), pipeline.sigmas,
                              rtol=1e-6, atol=1e-7)


# ---- samplers: the FLUX Euler job against diffusers ------------------------------------------------------


class LinearVelocityNet:
    """A toy velocity network v = W x + sigma b + c over channels (what FLUX's transformer computes)."""

    def __init__(self, channels: int = 4, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(channels, channels, generator=g) * 0.3
        self.bias = torch.randn(channels, 1, 1, generator=g)
        self.const = torch.randn(channels, 1, 1, generator=g) * 0.5

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        sigma = sigma.reshape(-1, 1, 1, 1).to(x.dtype)
        return torch.einsum("oc,bchw->bohw", self.weight.to(x.dtype), x) + sigma * self.bias + self.const

    def __call__(self, x_in, timesteps, context, y=None):
        return self.velocity(x_in, timesteps)  # FLUX: timestep = sigma


def _relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("steps", [4])
def test_flux_euler_job_matches_diffusers_flow_match_euler_loop(steps):
    width = height = 256
    shift = flux_shift_for(width, height)
    net = LinearVelocityNet()
    latent = torch.zeros(1, 4, height // 8, width // 8)
    positive = Conditioning(torch.zeros(1, 3, 8))
    ours = sample(Denoiser(net, FluxFlowMatching(shift)), latent, positive, None, cfg=1.0, sampler="euler",
                  scheduler="simple", steps=steps, seed=42)

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True,
                                                time_shift_type="exponential")
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=calculate_shift(16 * 16))
    x = prepare_noise(latent, 42)  # at sigma 1 the flow sample is the noise itself
    for t in scheduler.timesteps:
        x = scheduler.step(net.velocity(x, t / 1000 * torch.ones(1)), t, x).prev_sample
    assert _relative_l2(ours, x) <= 1e-5


def test_max_denoise_holds_for_flux_from_sigma_1_only():
    ms = FluxFlowMatching(1.15)
    full = ksampler_sigmas(ms, "simple", 10)
    partial = ksampler_sigmas(ms, "simple", 10, denoise=0.6)
    assert max_denoise(ms, full) and not max_denoise(ms, partial)
    noise, latent = torch.randn(1, 4, 4, 4), torch.randn(1, 4, 4, 4)
    assert torch.equal(ms.noise_scaling(full[0], noise, latent, max_denoise=True), noise)
    s = float(partial[0])
    assert torch.allclose(ms.noise_scaling(partial[0], noise, latent, max_denoise=False),
                          s * noise + (1 - s) * latent)


# ---- samplers: every sampler on a flow model -----------------------------------------------------------


class GaussianFlow:
    """Exact denoiser of Gaussian data N(m, s^2) under rectified flow x = (1 - sigma) x0 + sigma noise.

    Along the probability-flow ODE z = (x - (1 - sigma) m) / sqrt((1 - sigma)^2 s^2 + sigma^2) is constant,
    so noise n at sigma 1 flows to m + s n at sigma 0.
    """

    def __init__(self, mean: float = 0.5, std: float = 0.8):
        self.mean, self.std = mean, std
        self.model_sampling = FluxFlowMatching(1.15)
        self.sigmas_seen: list[float] = []

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **extra) -> torch.Tensor:
        self.sigmas_seen.append(float(torch.as_tensor(sigma).flatten()[0]))
        s = torch.as_tensor(sigma, dtype=x.dtype).reshape(-1, *([1] * (x.ndim - 1)))
        alpha = 1 - s
        gain = alpha * self.std ** 2 / (alpha ** 2 * self.std ** 2 + s ** 2)
        return self.mean + gain * (x - alpha * self.mean)


STOCHASTIC = {  # sampler -> options that make it stochastic
    "euler_a": {}, "dpm2_a": {}, "dpm++2s_a": {}, "dpm++sde": {}, "dpm++2m_sde": {}, "dpm++2m_sde_bt": {},
    "dpm++2m_sde_heun": {}, "dpm++3m_sde": {}, "er_sde": {}, "ddpm": {}, "euler_a_cfg_pp": {}, "lcm": {},
    "res_multistep_ancestral": {}, "ddim_trailing": {"eta": 1.0}, "res_2s": {"eta": 1.0},
    "dpmpp_sde_gpu": {}, "dpmpp_2m_sde_gpu": {}, "dpmpp_2m_sde_heun_gpu": {}, "dpmpp_3m_sde_gpu": {},
    "dpmpp_2s_ancestral_cfg_pp": {}, "res_multistep_ancestral_cfg_pp": {}, "seeds_2": {}, "seeds_3": {},
    "exp_heun_2_x0_sde": {}, "sa_solver": {}, "sa_solver_pece": {},
}
ODE_SAMPLERS = sorted(set(SAMPLERS) - set(FLOW_REFUSED_SAMPLERS))


def _options(name: str, x: torch.Tensor, seed: int) -> dict:
    """The sampler's stochastic options plus a seeded noise sampler where it takes one."""
    options = dict(STOCHASTIC.get(name, {}))
    if "noise_sampler" in inspect.signature(SAMPLERS[name]).parameters:
        options["noise_sampler"] = default_noise_sampler(x, seed)
    return options


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_every_sampler_runs_three_flux_steps_or_refuses_clearly(name):
    toy = GaussianFlow()
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    sigmas = calculate_sigmas("simple", toy.model_sampling, 3)
    if name in FLOW_REFUSED_SAMPLERS:
        with pytest.raises(ValueError, match=f"sampler '{re.escape(name)}' cannot sample a rectified-flow"):
            SAMPLERS[name](toy, x, sigmas)
        return
    out = SAMPLERS[name](toy, x, sigmas, **_options(name, x, 5))
    assert out.shape == x.shape and bool(torch.isfinite(out).all())
    assert all(0 < s <= 1 for s in toy.sigmas_seen)


def _gaussian_run(name: str) -> tuple[GaussianFlow, torch.Tensor, torch.Tensor, torch.Tensor]:
    """400 simple-schedule steps from 20000 pure-noise samples (the flow sample at sigma 1 is the noise)."""
    toy = GaussianFlow()
    noise = torch.randn(20000, 1, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    sigmas = calculate_sigmas("simple", toy.model_sampling, 400).double()
    out = SAMPLERS[name](toy, noise.clone(), sigmas, **_options(name, noise, 9))
    return toy, noise, sigmas, out


@pytest.mark.parametrize("name", sorted(set(ODE_SAMPLERS) - set(STOCHASTIC)))
def test_deterministic_samplers_follow_the_exact_flow_of_gaussian_data(name):
    """Noise n at sigma 1 flows to (1 - s) m + sqrt((1 - s)^2 std^2 + s^2) n at s.

    Within 0.03 at 400 steps (first-order Euler: 0.018)."""
    toy, noise, sigmas, out = _gaussian_run(name)
    end = float(sigmas[-2]) if name in ("dpm_fast", "dpm_adaptive") else 0.0  # these stop at sigma_min
    exact = (1 - end) * toy.mean + ((1 - end) ** 2 * toy.std ** 2 + end ** 2) ** 0.5 * noise
    assert float((out - exact).abs().max()) < 0.03


@pytest.mark.parametrize("name", sorted(STOCHASTIC))
def test_stochastic_samplers_reproduce_the_gaussian_data_law_on_flow(name):
    """Mean within 0.015 (standard error 0.006), std within 0.02 (first-order steps shrink it ~0.013 here).

    lcm returns the denoiser's posterior mean at its last step, exact only for consistency models, so
    only its mean is checked."""
    toy, _, _, out = _gaussian_run(name)
    assert abs(float(out.mean()) - toy.mean) < 0.015
    if name != "lcm":
        assert abs(float(out.std()) - toy.std) < 0.02


# ---- samplers: hand-worked single steps (ComfyUI's CONST formulas) -------------------------------------


class AffineFlowDenoiser:
    """x0 = a x + b sigma + c, elementwise: a denoiser whose every evaluation the test can redo by hand."""

    a, b, c = 0.3, -0.4, 0.2

    def __init__(self):
        self.model_sampling = FluxFlowMatching(1.15)
        self.sigmas_seen: list[float] = []

    def __call__(self, x, sigma, **extra):
        self.sigmas_seen.append(float(torch.as_tensor(sigma).flatten()[0]))
        return self.a * x + self.b * torch.as_tensor(sigma, dtype=x.dtype).reshape(-1, 1) + self.c

    def by_hand(self, x: float, sigma: float) -> float:
        return self.a * x + self.b * sigma + self.c


X0, Z0 = 0.7, -1.3  # the sample and the injected noise, one element


def _one_step(name: str, sigma: float, sigma_next: float, **options) -> tuple[float, list[float]]:
    model = AffineFlowDenoiser()
    x = torch.full((1, 1), X0, dtype=torch.float64)
    sigmas = torch.tensor([sigma, sigma_next], dtype=torch.float64)
    out = SAMPLERS[name](model, x, sigmas, noise_sampler=lambda s, t: torch.full_like(x, Z0), **options)
    return float(out), model.sigmas_seen


def rf_ancestral(x: float, sigma: float, sigma_next: float, eta: float, stage_x0: float) -> float:
    """ComfyUI's RF ancestral step: data-prediction step to sigma_down with stage_x0, rescale, renoise."""
    sigma_down = sigma_next * (1 + (sigma_next / sigma - 1) * eta)
    alpha_next, alpha_down = 1 - sigma_next, 1 - sigma_down
    x = sigma_down / sigma * x + (1 - sigma_down / sigma) * stage_x0
    renoise = math.sqrt(sigma_next ** 2 - sigma_down ** 2 * alpha_next ** 2 / alpha_down ** 2)
    return alpha_next / alpha_down * x + Z0 * renoise


@pytest.mark.parametrize("eta", [1.0, 0.5])
@pytest.mark.parametrize("name", ["euler_a", "res_multistep_ancestral"])
def test_euler_ancestral_takes_comfyui_rectified_flow_step(name, eta):
    model = AffineFlowDenoiser()
    expected = rf_ancestral(X0, 0.8, 0.5, eta, model.by_hand(X0, 0.8))
    ours, _ = _one_step(name, 0.8, 0.5, eta=eta)
    assert ours == pytest.approx(expected, abs=1e-12)


def test_dpm2_ancestral_takes_comfyui_rectified_flow_step():
    model, sigma, sigma_next, eta = AffineFlowDenoiser(), 0.8, 0.5, 1.0
    sigma_down = sigma_next * (1 + (sigma_next / sigma - 1) * eta)
    sigma_mid = math.sqrt(sigma * sigma_down)
    d = (X0 - model.by_hand(X0, sigma)) / sigma
    x_2 = X0 + d * (sigma_mid - sigma)
    d_2 = (x_2 - model.by_hand(x_2, sigma_mid)) / sigma_mid
    x = X0 + d_2 * (sigma_down - sigma)
    alpha_next, alpha_down = 1 - sigma_next, 1 - sigma_down
    expected = alpha_next / alpha_down * x + Z0 * math.sqrt(
        sigma_next ** 2 - sigma_down ** 2 * alpha_next ** 2 / alpha_down ** 2)
    ours, seen = _one_step("dpm2_a", sigma, sigma_next, eta=eta)
    assert seen == pytest.approx([sigma, sigma_mid], abs=1e-15)
    assert ours == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("sigma", [0.8, 1.0])
def test_dpmpp_2s_ancestral_takes_comfyui_rectified_flow_step_with_log_snr_midpoint(sigma):
    model, sigma_next = AffineFlowDenoiser(), 0.5
    sigma_down = sigma_next * sigma_next / sigma  # eta 1
    if sigma == 1.0:
        sigma_s = 0.9999  # ComfyUI's stand-in where log((1 - s) / s) is -inf
    else:
        lam, lam_down = math.log((1 - sigma) / sigma), math.log((1 - sigma_down) / sigma_down)
        sigma_s = 1 / (math.exp((lam + lam_down) / 2) + 1)
    u = sigma_s / sigma * X0 + (1 - sigma_s / sigma) * model.by_hand(X0, sigma)
    expected = rf_ancestral(X0, sigma, sigma_next, 1.0, model.by_hand(u, sigma_s))
    ours, seen = _one_step("dpm++2s_a", sigma, sigma_next)
    assert seen == pytest.approx([sigma, sigma_s], abs=1e-15)
    assert ours == pytest.approx(expected, abs=1e-12)


def _half_log_snr(sigma: float) -> float:
    return math.log((1 - sigma) / sigma)


@pytest.mark.parametrize("name", ["dpm++2m_sde", "dpm++3m_sde"])
def test_sde_samplers_take_comfyui_half_log_snr_first_step(name):
    """ComfyUI sample_dpmpp_2m_sde / 3m_sde on CONST, first step (no history): lambda = log(alpha/sigma)."""
    model, sigma, sigma_next, eta = AffineFlowDenoiser(), 0.8, 0.5, 1.0
    h = _half_log_snr(sigma_next) - _half_log_snr(sigma)
    alpha_next = sigma_next * math.exp(_half_log_snr(sigma_next))
    expected = (sigma_next / sigma * math.exp(-h * eta) * X0
                + alpha_next * -math.expm1(-h * (eta + 1)) * model.by_hand(X0, sigma)
                + Z0 * sigma_next * math.sqrt(-math.expm1(-2 * h * eta)))
    ours, _ = _one_step(name, sigma, sigma_next)
    assert ours == pytest.approx(expected, abs=1e-12)


def test_euler_ancestral_cfg_pp_takes_comfyui_half_log_snr_step():
    """ComfyUI sample_euler_ancestral_cfg_pp on CONST (unguided: the uncond prediction is the prediction)."""
    model, sigma, sigma_next, eta = AffineFlowDenoiser(), 0.8, 0.5, 1.0
    alpha_s, alpha_t = 1 - sigma, 1 - sigma_next
    x0 = model.by_hand(X0, sigma)
    d = (X0 - alpha_s * x0) / sigma
    ve_from, ve_to = sigma / alpha_s, sigma_next / alpha_t
    sigma_up = min(ve_to, eta * math.sqrt(ve_to ** 2 * (ve_from ** 2 - ve_to ** 2) / ve_from ** 2))
    sigma_down = alpha_t * math.sqrt(ve_to ** 2 - sigma_up ** 2)
    expected = alpha_t * x0 + sigma_down * d + alpha_t * Z0 * sigma_up
    ours, _ = _one_step("euler_a_cfg_pp", sigma, sigma_next, eta=eta)
    assert ours == pytest.approx(expected, abs=1e-12)


def test_er_sde_takes_comfyui_half_log_snr_first_step():
    model, sigma, sigma_next = AffineFlowDenoiser(), 0.8, 0.5
    lam_s, lam_t = sigma / (1 - sigma), sigma_next / (1 - sigma_next)  # er_lambda = sigma / alpha

    def scaler(v):
        return v * (math.exp(v ** 0.3) + 10.0)

    r = scaler(lam_t) / scaler(lam_s)
    alpha_s, alpha_t = 1 - sigma, 1 - sigma_next
    expected = (alpha_t / alpha_s * r * X0 + alpha_t * (1 - r) * model.by_hand(X0, sigma)
                + alpha_t * Z0 * math.sqrt(lam_t ** 2 - lam_s ** 2 * r ** 2))
    ours, _ = _one_step("er_sde", sigma, sigma_next)
    assert ours == pytest.approx(expected, abs=1e-12)


def test_sde_samplers_start_pure_noise_at_comfyui_offset_sigma():
    """offset_first_sigma_for_snr: a first sigma of 1 is evaluated at percent_to_sigma(1e-4)."""
    _, seen = _one_step("dpm++2m_sde", 1.0, 0.5)
    assert seen[0] == pytest.approx(flux_sigma(1.15, 1 - 1e-4), abs=1e-12) and seen[0] < 1.0


@pytest.mark.parametrize("sigma", [1.0, 0.8])
def test_ddim_on_flow_is_the_flow_euler_step(sigma):
    model, sigma_next = AffineFlowDenoiser(), 0.5
    x0 = model.by_hand(X0, sigma)
    ddim, _ = _one_step("ddim_trailing", sigma, sigma_next)
    euler, _ = _one_step("euler", sigma, sigma_next)
    assert euler == pytest.approx(X0 + (X0 - x0) / sigma * (sigma_next - sigma), abs=1e-12)
    if sigma < 1.0:  # from sigma 1 DDIM (VE coordinates) is evaluated at the offset sigma
        assert ddim == pytest.approx(euler, abs=1e-12)


def test_refused_options_name_the_sampler_and_the_option():
    with pytest.raises(ValueError, match="sampler 'euler' with s_churn=0.5"):
        _one_step("euler", 0.8, 0.5, s_churn=0.5)
    with pytest.raises(ValueError, match="sampler 'dpm_fast' with eta=1.0"):
        _one_step("dpm_fast", 0.8, 0.5, eta=1.0)
