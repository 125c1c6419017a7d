"""Single-step samplers in the k-diffusion convention (Karras et al. 2022).

`model(x, sigma, **extra_args)` returns the denoised x0; `sigmas` descend to 0. Each sampler calls
`callback({"x", "i", "sigma", "sigma_hat", "denoised"})` once per step. Ancestral and stochastic ones
draw noise from `noise_sampler(sigma, sigma_next)` (see noise.py); without one they use an unseeded
Gaussian sampler. Multistep and SDE samplers live in samplers_multistep.py and samplers_sde.py, UniPC and
SA-Solver in their own files; the name registry in registry.py. The CFG++ samplers (Chung et al. 2024)
follow the unconditional prediction, which a guided denoiser keeps for them (guidance.py, `uncond_source`).
How each one serves rectified-flow models (FLUX, SD3) is in flow.py.
"""

import math
from collections.abc import Callable

import torch

from .flow import (
    flow_ancestral_step,
    is_flow,
    refuse_on_flow,
    refuse_option_on_flow,
    run_in_ve_coordinates,
)
from .noise import NoiseSampler, default_noise_sampler

Callback = Callable[[dict], None] | None


def append_dims(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Append trailing singleton dims so a per-batch tensor broadcasts: (B,) -> (B, 1, 1, 1)."""
    return t[(...,) + (None,) * (ndim - t.ndim)]


def to_d(x: torch.Tensor, sigma: torch.Tensor, denoised: torch.Tensor) -> torch.Tensor:
    """Karras ODE derivative dx/dsigma = (x - D(x, sigma)) / sigma."""
    return (x - denoised) / append_dims(torch.as_tensor(sigma, dtype=x.dtype, device=x.device), x.ndim)


def get_ancestral_step(sigma_from: torch.Tensor, sigma_to: torch.Tensor,
                       eta: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a step into the deterministic target sigma_down and the fresh noise sigma_up."""
    if not eta:
        return sigma_to, torch.zeros_like(torch.as_tensor(sigma_to))
    variance = sigma_to ** 2 * (sigma_from ** 2 - sigma_to ** 2) / sigma_from ** 2
    sigma_up = torch.minimum(torch.as_tensor(sigma_to), eta * variance ** 0.5)
    sigma_down = (sigma_to ** 2 - sigma_up ** 2) ** 0.5
    return sigma_down, sigma_up


def ancestral_split(model, sigma: torch.Tensor, sigma_next: torch.Tensor,
                    eta: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sigma_down, rescale, sigma_up): step to sigma_down, then x = rescale * x + sigma_up * noise.

    k-diffusion's split (rescale 1) for VE models, the rectified-flow one for flow models (flow.py).
    """
    if is_flow(model):
        return flow_ancestral_step(sigma, sigma_next, eta)
    sigma_down, sigma_up = get_ancestral_step(sigma, sigma_next, eta)
    return sigma_down, torch.ones_like(torch.as_tensor(sigma_next)), sigma_up


def _midpoint_sigma(model, sigma: torch.Tensor, sigma_down: torch.Tensor) -> torch.Tensor:
    """DPM-Solver++(2S)'s stage sigma: halfway in -log sigma (VE) or in log((1 - s) / s) (flow, ComfyUI)."""
    if not is_flow(model):
        return (sigma * sigma_down) ** 0.5
    if sigma == 1.0:
        return torch.full_like(sigma, 0.9999)  # log-SNR is -inf at pure noise; ComfyUI's stand-in
    half_log_snr = ((1 - sigma) / sigma).log().lerp(((1 - sigma_down) / sigma_down).log(), 0.5)
    return 1 / (half_log_snr.exp() + 1)


def _churn(x, sigma, n_steps, s_churn, s_tmin, s_tmax, s_noise, noise_sampler):
    """Karras et al. (2022) Algorithm 2 lines 4-6: raise sigma by gamma and add matching noise."""
    gamma = min(s_churn / n_steps, 2 ** 0.5 - 1) if s_churn > 0 and s_tmin <= sigma <= s_tmax else 0.0
    sigma_hat = sigma * (gamma + 1)
    if gamma > 0:
        x = x + noise_sampler(sigma, sigma_hat) * s_noise * (sigma_hat ** 2 - sigma ** 2) ** 0.5
    return x, sigma_hat


def uncond_source(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """For CFG++: ask a guided denoiser to keep its unconditional prediction (see guidance.py)."""
    if hasattr(model, "keep_uncond"):
        model.keep_uncond = True
        return lambda denoised: model.last_uncond_denoised
    return lambda denoised: denoised


@torch.no_grad()
def sample_euler(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, s_churn=0.0,
                 s_tmin=0.0, s_tmax=float("inf"), s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """Euler steps, Algorithm 2 of Karras et al. (2022) (with optional churn)."""
    refuse_option_on_flow(model, "euler", "s_churn", s_churn)
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        x, sigma_hat = _churn(x, sigmas[i], len(sigmas) - 1, s_churn, s_tmin, s_tmax, s_noise, noise_sampler)
        denoised = model(x, sigma_hat * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigma_hat, "denoised": denoised})
        x = x + to_d(x, sigma_hat, denoised) * (sigmas[i + 1] - sigma_hat)
    return x


@torch.no_grad()
def sample_euler_ancestral(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                           eta=1.0, s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """Ancestral sampling with Euler steps (k-diffusion; Song et al. 2021); the RF split on flow models."""
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        sigma_down, rescale, sigma_up = ancestral_split(model, sigmas[i], sigmas[i + 1], eta=eta)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        x = x + to_d(x, sigmas[i], denoised) * (sigma_down - sigmas[i])
        if sigmas[i + 1] > 0:
            x = rescale * x + noise_sampler(sigmas[i], sigmas[i + 1]) * s_noise * sigma_up
    return x


@torch.no_grad()
def sample_heun(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, s_churn=0.0,
                s_tmin=0.0, s_tmax=float("inf"), s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """Heun's second-order method, Algorithm 2 of Karras et al. (2022)."""
    refuse_option_on_flow(model, "heun", "s_churn", s_churn)
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        x, sigma_hat = _churn(x, sigmas[i], len(sigmas) - 1, s_churn, s_tmin, s_tmax, s_noise, noise_sampler)
        denoised = model(x, sigma_hat * s_in, **extra_args)
        d = to_d(x, sigma_hat, denoised)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigma_hat, "denoised": denoised})
        dt = sigmas[i + 1] - sigma_hat
        if sigmas[i + 1] == 0:
            x = x + d * dt  # Euler step to sigma 0
        else:
            x_2 = x + d * dt
            d_2 = to_d(x_2, sigmas[i + 1], model(x_2, sigmas[i + 1] * s_in, **extra_args))
            x = x + (d + d_2) / 2 * dt
    return x


@torch.no_grad()
def sample_heunpp2(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, s_churn=0.0,
                   s_tmin=0.0, s_tmax=float("inf"), s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """Heun++ (ComfyUI heunpp2): Heun with a third evaluation, weights proportional to sigma."""
    refuse_option_on_flow(model, "heunpp2", "s_churn", s_churn)
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    s_end = sigmas[-1]
    for i in range(len(sigmas) - 1):
        x, sigma_hat = _churn(x, sigmas[i], len(sigmas) - 1, s_churn, s_tmin, s_tmax, s_noise, noise_sampler)
        denoised = model(x, sigma_hat * s_in, **extra_args)
        d = to_d(x, sigma_hat, denoised)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigma_hat, "denoised": denoised})
        dt = sigmas[i + 1] - sigma_hat
        if sigmas[i + 1] == s_end:
            x = x + d * dt
            continue
        x_2 = x + d * dt
        d_2 = to_d(x_2, sigmas[i + 1], model(x_2, sigmas[i + 1] * s_in, **extra_args))
        if sigmas[i + 2] == s_end:
            w2 = sigmas[i + 1] / (2 * sigmas[0])
            x = x + (d * (1 - w2) + d_2 * w2) * dt
        else:
            x_3 = x_2 + d_2 * (sigmas[i + 2] - sigmas[i + 1])
            d_3 = to_d(x_3, sigmas[i + 2], model(x_3, sigmas[i + 2] * s_in, **extra_args))
            w2, w3 = sigmas[i + 1] / (3 * sigmas[0]), sigmas[i + 2] / (3 * sigmas[0])
            x = x + ((1 - w2 - w3) * d + w2 * d_2 + w3 * d_3) * dt
    return x


@torch.no_grad()
def sample_dpm_2(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, s_churn=0.0,
                 s_tmin=0.0, s_tmax=float("inf"), s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """DPM-Solver-2 (Lu et al. 2022) midpoint in log sigma, in the Karras et al. (2022) framework."""
    refuse_option_on_flow(model, "dpm2", "s_churn", s_churn)
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        x, sigma_hat = _churn(x, sigmas[i], len(sigmas) - 1, s_churn, s_tmin, s_tmax, s_noise, noise_sampler)
        denoised = model(x, sigma_hat * s_in, **extra_args)
        d = to_d(x, sigma_hat, denoised)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigma_hat, "denoised": denoised})
        if sigmas[i + 1] == 0:
            x = x + d * (sigmas[i + 1] - sigma_hat)
        else:
            sigma_mid = sigma_hat.log().lerp(sigmas[i + 1].log(), 0.5).exp()
            x_2 = x + d * (sigma_mid - sigma_hat)
            d_2 = to_d(x_2, sigma_mid, model(x_2, sigma_mid * s_in, **extra_args))
            x = x + d_2 * (sigmas[i + 1] - sigma_hat)
    return x


@torch.no_grad()
def sample_dpm_2_ancestral(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                           eta=1.0, s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """Ancestral sampling with DPM-Solver-2 steps (Lu et al. 2022; k-diffusion); RF split on flow."""
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        sigma_down, rescale, sigma_up = ancestral_split(model, sigmas[i], sigmas[i + 1], eta=eta)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        d = to_d(x, sigmas[i], denoised)
        if sigma_down == 0:
            x = x + d * (sigma_down - sigmas[i])
        else:
            sigma_mid = sigmas[i].log().lerp(sigma_down.log(), 0.5).exp()
            x_2 = x + d * (sigma_mid - sigmas[i])
            d_2 = to_d(x_2, sigma_mid, model(x_2, sigma_mid * s_in, **extra_args))
            x = x + d_2 * (sigma_down - sigmas[i])
            x = rescale * x + noise_sampler(sigmas[i], sigmas[i + 1]) * s_noise * sigma_up
    return x


@torch.no_grad()
def sample_dpmpp_2s_ancestral(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                              eta=1.0, s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """Ancestral sampling with DPM-Solver++(2S) steps (Lu et al. 2022b, Algorithm 1); RF split on flow."""
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        sigma_down, rescale, sigma_up = ancestral_split(model, sigmas[i], sigmas[i + 1], eta=eta)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        if sigma_down == 0:
            x = denoised
        else:  # data-prediction steps x_s = (s / sigma) x + (1 - s / sigma) x0 to the stage, then sigma_down
            sigma_s = _midpoint_sigma(model, sigmas[i], sigma_down)
            x_2 = (sigma_s / sigmas[i]) * x + (1 - sigma_s / sigmas[i]) * denoised
            denoised_2 = model(x_2, sigma_s * s_in, **extra_args)
            x = (sigma_down / sigmas[i]) * x + (1 - sigma_down / sigmas[i]) * denoised_2
        if sigmas[i + 1] > 0:
            x = rescale * x + noise_sampler(sigmas[i], sigmas[i + 1]) * s_noise * sigma_up
    return x


@torch.no_grad()
def sample_euler_cfg_pp(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None):
    """Euler with CFG++ (Chung et al. 2024): renoise along the unconditional prediction."""
    if is_flow(model):
        return run_in_ve_coordinates(sample_euler_cfg_pp, model, x, sigmas, extra_args, callback, disable)
    extra_args = {} if extra_args is None else extra_args
    uncond_of = uncond_source(model)
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        x = denoised + to_d(x, sigmas[i], uncond_of(denoised)) * sigmas[i + 1]
    return x


@torch.no_grad()
def sample_euler_ancestral_cfg_pp(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                                  eta=1.0, s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """Ancestral Euler with CFG++ (Chung et al. 2024)."""
    if is_flow(model):
        return run_in_ve_coordinates(sample_euler_ancestral_cfg_pp, model, x, sigmas, extra_args, callback,
                                     disable, eta=eta, s_noise=s_noise, noise_sampler=noise_sampler)
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    uncond_of = uncond_source(model)
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        sigma_down, sigma_up = get_ancestral_step(sigmas[i], sigmas[i + 1], eta=eta)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        x = denoised + to_d(x, sigmas[i], uncond_of(denoised)) * sigma_down
        if sigmas[i + 1] > 0:
            x = x + noise_sampler(sigmas[i], sigmas[i + 1]) * s_noise * sigma_up
    return x


@torch.no_grad()
def sample_gradient_estimation(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                               ge_gamma=2.0, cfg_pp=False):
    """Gradient estimation (Permenter & Yuan 2024, "Interpreting and Improving Diffusion Models ...")."""
    extra_args = {} if extra_args is None else extra_args
    uncond_of = uncond_source(model) if cfg_pp else None
    s_in = x.new_ones([x.shape[0]])
    old_d = None
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        d = to_d(x, sigmas[i], uncond_of(denoised) if cfg_pp else denoised)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        dt = sigmas[i + 1] - sigmas[i]
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            x = denoised + d * sigmas[i + 1] if cfg_pp else x + d * dt
            if old_d is not None:
                x = x + (ge_gamma - 1) * (d - old_d) * dt  # d_bar = gamma d + (1 - gamma) d_prev
        old_d = d
    return x


@torch.no_grad()
def sample_lcm(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
               noise_sampler: NoiseSampler | None = None):
    """Latent Consistency Model multistep sampling (Luo et al. 2023, Algorithm 1)."""
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    model_sampling = getattr(model, "model_sampling", None)
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        x = denoised
        if sigmas[i + 1] > 0:
            noise = noise_sampler(sigmas[i], sigmas[i + 1])
            x = x + sigmas[i + 1] * noise if model_sampling is None else \
                model_sampling.noise_scaling(sigmas[i + 1], noise, x)
    return x


@torch.no_grad()
def sample_ddpm(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                noise_sampler: NoiseSampler | None = None):
    """DDPM ancestral sampling (Ho et al. 2020, Algorithm 2) on k-diffusion sigmas."""
    if is_flow(model):
        return run_in_ve_coordinates(sample_ddpm, model, x, sigmas, extra_args, callback, disable,
                                     noise_sampler=noise_sampler)
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        denoised = model(x, sigma * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigma, "sigma_hat": sigma, "denoised": denoised})
        alpha_cumprod, alpha_cumprod_prev = 1 / (sigma ** 2 + 1), 1 / (sigma_next ** 2 + 1)
        alpha = alpha_cumprod / alpha_cumprod_prev
        eps = (x - denoised) / sigma
        x_vp = x / (1.0 + sigma ** 2) ** 0.5  # VP sample sqrt(abar) x0 + sqrt(1 - abar) eps
        mu = (x_vp - (1 - alpha) * eps / (1 - alpha_cumprod) ** 0.5) / alpha ** 0.5
        if sigma_next > 0:
            posterior_std = ((1 - alpha) * (1 - alpha_cumprod_prev) / (1 - alpha_cumprod)) ** 0.5
            mu = mu + posterior_std * noise_sampler(sigma, sigma_next)
        x = mu * (1.0 + sigma_next ** 2) ** 0.5
    return x


@torch.no_grad()
def sample_ddim(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, eta=0.0,
                noise_sampler: NoiseSampler | None = None):
    """DDIM (Song et al. 2021, eq. 12) on k-diffusion sigmas; trailing spacing comes from the schedule."""
    if is_flow(model):
        return run_in_ve_coordinates(sample_ddim, model, x, sigmas, extra_args, callback, disable, eta=eta,
                                     noise_sampler=noise_sampler)
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        denoised = model(x, sigma * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigma, "sigma_hat": sigma, "denoised": denoised})
        eps = (x - denoised) / sigma
        alpha_t, alpha_prev = 1 / (sigma ** 2 + 1), 1 / (sigma_next ** 2 + 1)
        std = eta * ((1 - alpha_prev) / (1 - alpha_t) * (1 - alpha_t / alpha_prev)) ** 0.5
        x = denoised + ((1 - alpha_prev - std ** 2) / alpha_prev) ** 0.5 * eps
        if eta > 0 and sigma_next > 0:
            x = x + std / alpha_prev ** 0.5 * noise_sampler(sigma, sigma_next)
    return x


@torch.no_grad()
def sample_tcd(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, eta=0.3,
               noise_sampler: NoiseSampler | None = None):
    """Strategic stochastic sampling of TCD (Zheng et al. 2024, Algorithm 4); eta is their gamma."""
    refuse_on_flow("tcd", model)
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    model_sampling = getattr(model, "model_sampling", None)
    if model_sampling is None:
        raise ValueError("the tcd sampler needs a denoiser with a model_sampling (timestep table)")
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        denoised = model(x, sigma * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigma, "sigma_hat": sigma, "denoised": denoised})
        t_prev = float(model_sampling.sigma_to_t(sigma_next, quantize=True)) if sigma_next > 0 else 0.0
        sigma_s = model_sampling.t_to_sigma(math.floor((1 - eta) * t_prev)).to(x)
        x = denoised + sigma_s * (x - denoised) / sigma  # x_s = x0 + sigma_s eps
        if eta > 0 and sigma_next > 0:
            x = x + (sigma_next ** 2 - sigma_s ** 2).clamp(min=0) ** 0.5 * noise_sampler(sigma, sigma_next)
    return x


def _phi1(t: torch.Tensor) -> torch.Tensor:
    return torch.expm1(t) / t


def _phi2(t: torch.Tensor) -> torch.Tensor:
    return (_phi1(t) - 1.0) / t


@torch.no_grad()
def sample_res_2s(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, eta=0.0,
                  s_noise=1.0, noise_sampler: NoiseSampler | None = None, c2=0.5):
    """RES two-stage exponential integrator (Zhang et al. 2023, "Improved Order Analysis ...")."""
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        sigma_down, rescale, sigma_up = ancestral_split(model, sigmas[i], sigmas[i + 1], eta=eta)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        if sigma_down == 0:
            x = denoised
        else:
            h = sigmas[i].log() - sigma_down.log()  # step in t = -log sigma
            x_2 = x + h * c2 * _phi1(-h * c2) * (denoised - x)
            denoised_2 = model(x_2, (sigmas[i].log() - h * c2).exp() * s_in, **extra_args)
            b2 = _phi2(-h) / c2
            b1 = _phi1(-h) - b2
            x = x + h * (b1 * (denoised - x) + b2 * (denoised_2 - x))
        if sigmas[i + 1] > 0 and sigma_up > 0:
            x = rescale * x + noise_sampler(sigmas[i], sigmas[i + 1]) * s_noise * sigma_up
    return x


@torch.no_grad()
def sample_dpmpp_2s_ancestral_cfg_pp(model, x, sigmas, extra_args=None, callback: Callback = None,
                                     disable=None, eta=1.0, s_noise=1.0,
                                     noise_sampler: NoiseSampler | None = None):
    """DPM-Solver++(2S) ancestral (Lu et al. 2022b) with CFG++ (Chung et al. 2024), as ComfyUI: both stages
    step along the unconditional prediction, then the step's guidance (denoised - uncond) is added, scaled by
    the data scale at sigma_next (1 - sigma_next on flow models, 1 otherwise); the RF split on flow models."""
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    uncond_of = uncond_source(model)
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        uncond = uncond_of(denoised)
        guidance = denoised - uncond
        sigma_down, rescale, sigma_up = ancestral_split(model, sigmas[i], sigmas[i + 1], eta=eta)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        if sigma_down == 0:
            x = x + to_d(x, sigmas[i], uncond) * (sigma_down - sigmas[i])
        else:  # both stages x_s = (s / sigma) x + (1 - s / sigma) uncond, the second with the stage's uncond
            sigma_s = _midpoint_sigma(model, sigmas[i], sigma_down)
            x_2 = (sigma_s / sigmas[i]) * x + (1 - sigma_s / sigmas[i]) * uncond
            uncond_2 = uncond_of(model(x_2, sigma_s * s_in, **extra_args))
            x = (sigma_down / sigmas[i]) * x + (1 - sigma_down / sigmas[i]) * uncond_2
        if sigmas[i + 1] > 0:
            x = rescale * x + noise_sampler(sigmas[i], sigmas[i + 1]) * s_noise * sigma_up
        x = x + (1 - sigmas[i + 1] if is_flow(model) else 1) * guidance
    return x


@torch.no_grad()
def sample_gradient_estimation_cfg_pp(model, x, sigmas, extra_args=None, callback: Callback = None,
                                      disable=None, ge_gamma=2.0):
    """Gradient estimation (Permenter & Yuan 2024) with CFG++ (Chung et al. 2024): the Euler step renoises
    along the unconditional prediction, whose derivative also feeds the gradient estimate (ComfyUI)."""
    return sample_gradient_estimation(model, x, sigmas, extra_args, callback, disable, ge_gamma, cfg_pp=True)
