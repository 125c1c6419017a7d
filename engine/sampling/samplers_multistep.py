"""Multistep samplers: reuse the previous steps' predictions instead of extra model calls.

Same conventions as samplers.py (k-diffusion signature, one callback per step).
"""

import math

import numpy as np
import torch

from .flow import refuse_on_flow
from .noise import NoiseSampler, default_noise_sampler
from .samplers import Callback, ancestral_split, to_d, uncond_source

_GAUSS_NODES, _GAUSS_WEIGHTS = np.polynomial.legendre.leggauss(16)


def lagrange_coefficients(nodes: list[float], lower: float, upper: float,
                          warp=lambda s: s) -> list[float]:
    """Integrals over sigma in [lower, upper] of the Lagrange basis on `nodes` (in warp(sigma) space)."""
    sigmas = (upper - lower) / 2 * _GAUSS_NODES + (upper + lower) / 2  # Gauss-Legendre in sigma
    weights = (upper - lower) / 2 * _GAUSS_WEIGHTS
    taus, warped = warp(sigmas), [warp(np.float64(n)) for n in nodes]
    coeffs = []
    for j, tau_j in enumerate(warped):
        basis = np.ones_like(taus)
        for k, tau_k in enumerate(warped):
            if k != j:
                basis *= (taus - tau_k) / (tau_j - tau_k)
        coeffs.append(float(np.sum(weights * basis)))
    return coeffs


@torch.no_grad()
def sample_lms(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, order=4):
    """Linear multistep (Adams-Bashforth with variable steps) on the Karras ODE, as k-diffusion."""
    extra_args = {} if extra_args is None else extra_args
    s_in = x.new_ones([x.shape[0]])
    sigmas_f64 = sigmas.double().cpu().numpy()
    ds = []
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        ds = (ds + [to_d(x, sigmas[i], denoised)])[-order:]
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            nodes = [sigmas_f64[i - j] for j in range(len(ds))]  # newest first
            coeffs = lagrange_coefficients(nodes, sigmas_f64[i], sigmas_f64[i + 1])
            x = x + sum(c * d for c, d in zip(coeffs, reversed(ds), strict=True))
    return x


def _edm_to_vp_time(sigma_min=0.002, sigma_max=80.0, epsilon_s=1e-3):
    """DEIS's map from EDM sigma to the VP-SDE time t in [epsilon_s, 1] (zju-pi diff-sampler, edm2t)."""
    beta_d = 2 * (math.log(sigma_min ** 2 + 1) / epsilon_s - math.log(sigma_max ** 2 + 1)) / (epsilon_s - 1)
    beta_min = math.log(sigma_max ** 2 + 1) - 0.5 * beta_d
    return lambda s: (np.sqrt(beta_min ** 2 + 2 * beta_d * np.log(s ** 2 + 1)) - beta_min) / beta_d


@torch.no_grad()
def sample_deis(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, max_order=3):
    """tAB-DEIS (Zhang & Chen 2023): Adams-Bashforth with Lagrange bases in VP time, integrated over sigma."""
    extra_args = {} if extra_args is None else extra_args
    s_in = x.new_ones([x.shape[0]])
    sigmas_f64, vp_time = sigmas.double().cpu().numpy(), _edm_to_vp_time()
    ds = []
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        ds = (ds + [to_d(x, sigmas[i], denoised)])[-max_order:]
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        if sigmas[i + 1] <= 0 or len(ds) == 1:
            x = x + ds[-1] * (sigmas[i + 1] - sigmas[i])
        else:
            nodes = [sigmas_f64[i - j] for j in range(len(ds))]
            coeffs = lagrange_coefficients(nodes, sigmas_f64[i], sigmas_f64[i + 1], warp=vp_time)
            x = x + sum(c * d for c, d in zip(coeffs, reversed(ds), strict=True))
    return x


# Adams-Bashforth weights of orders 1-4 for equal steps, newest derivative first.
_ADAMS_BASHFORTH = [[1.0], [3 / 2, -1 / 2], [23 / 12, -16 / 12, 5 / 12],
                    [55 / 24, -59 / 24, 37 / 24, -9 / 24]]


@torch.no_grad()
def sample_ipndm(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, max_order=4):
    """Improved PNDM (Zhang & Chen 2023, DEIS paper): fixed Adams-Bashforth weights on the Karras ODE."""
    extra_args = {} if extra_args is None else extra_args
    s_in = x.new_ones([x.shape[0]])
    ds = []
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        ds = (ds + [to_d(x, sigmas[i], denoised)])[-max_order:]
        weights = _ADAMS_BASHFORTH[len(ds) - 1]
        x = x + (sigmas[i + 1] - sigmas[i]) * sum(w * d for w, d in zip(weights, reversed(ds), strict=True))
    return x


def _variable_ab_weights(h: list[float]) -> list[float]:
    """iPNDM-v weights for step sizes h = [h_n, h_n-1, ...] (zju-pi diff-sampler), newest first."""
    order = len(h)
    if order == 1:
        return [1.0]
    h_n, h_1 = h[0], h[1]
    c1, c2 = (2 + h_n / h_1) / 2, -(h_n / h_1) / 2
    if order == 2:
        return [c1, c2]
    h_2 = h[2]
    temp1 = (1 - h_n / (3 * (h_n + h_1)) * (h_n * (h_n + h_1)) / (h_1 * (h_1 + h_2))) / 2
    if order == 3:
        return [c1 + temp1, c2 - (1 + h_1 / h_2) * temp1, temp1 * h_1 / h_2]
    h_3 = h[3]
    ratio = h_1 * (h_1 + h_2) / (h_2 * (h_2 + h_3))
    temp2 = ((1 - h_n / (3 * (h_n + h_1))) / 2
             + (1 - h_n / (2 * (h_n + h_1))) * h_n / (6 * (h_n + h_1 + h_2))) \
        * (h_n * (h_n + h_1) * (h_n + h_1 + h_2)) / (h_1 * (h_1 + h_2) * (h_1 + h_2 + h_3))
    return [c1 + temp1 + temp2,
            c2 - (1 + h_1 / h_2) * temp1 - (1 + h_1 / h_2 + ratio) * temp2,
            temp1 * h_1 / h_2 + (h_1 / h_2 + ratio * (1 + h_2 / h_3)) * temp2,
            -temp2 * ratio * h_1 / h_2]


@torch.no_grad()
def sample_ipndm_v(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, max_order=4):
    """Improved PNDM with variable-step Adams-Bashforth weights (zju-pi diff-sampler, as ComfyUI)."""
    extra_args = {} if extra_args is None else extra_args
    s_in = x.new_ones([x.shape[0]])
    sig = sigmas.double().cpu().tolist()
    ds = []
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        ds = (ds + [to_d(x, sigmas[i], denoised)])[-max_order:]
        steps = [sig[i + 1 - k] - sig[i - k] for k in range(len(ds))]  # h_n, h_n-1, ...
        weights = _variable_ab_weights(steps)
        x = x + (sigmas[i + 1] - sigmas[i]) * sum(w * d for w, d in zip(weights, reversed(ds), strict=True))
    return x


@torch.no_grad()
def sample_dpmpp_2m(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None):
    """DPM-Solver++(2M) (Lu et al. 2022b, Algorithm 2)."""
    extra_args = {} if extra_args is None else extra_args
    s_in = x.new_ones([x.shape[0]])
    old_denoised = None
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            h = sigmas[i].log() - sigmas[i + 1].log()  # step in t = -log sigma
            if old_denoised is None:
                denoised_d = denoised
            else:
                r = (sigmas[i - 1].log() - sigmas[i].log()) / h
                denoised_d = (1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * old_denoised
            x = (sigmas[i + 1] / sigmas[i]) * x - torch.expm1(-h) * denoised_d
        old_denoised = denoised
    return x


@torch.no_grad()
def sample_dpmpp_2m_cfg_pp(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None):
    """DPM-Solver++(2M) (Lu et al. 2022b) with CFG++ (Chung et al. 2024), as ComfyUI: the step leaves from the
    guided prediction along the unconditional one, x = D + e^-h (x - uncond) - (e^-h - 1) / (2r) (D - uncond')
    with uncond' the previous step's unconditional prediction."""
    extra_args = {} if extra_args is None else extra_args
    uncond_of = uncond_source(model)
    s_in = x.new_ones([x.shape[0]])
    old_uncond = None
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        uncond = uncond_of(denoised)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            h = sigmas[i].log() - sigmas[i + 1].log()  # step in t = -log sigma
            mix = -torch.exp(-h) * uncond
            if old_uncond is not None:
                r = (sigmas[i - 1].log() - sigmas[i].log()) / h
                mix = mix - torch.expm1(-h) * (1 / (2 * r)) * (denoised - old_uncond)
            x = denoised + mix + torch.exp(-h) * x
        old_uncond = uncond
    return x


@torch.no_grad()
def sample_dpmpp_2m_v2(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None):
    """DPM-Solver++(2M) v2 of AUTOMATIC1111 discussion 8457, as stable-diffusion.cpp's dpm++2mv2."""
    refuse_on_flow("dpm++2mv2", model)
    extra_args = {} if extra_args is None else extra_args
    s_in = x.new_ones([x.shape[0]])
    old_denoised = None
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        h = sigmas[i].log() - sigmas[i + 1].log() if sigmas[i + 1] > 0 else None
        if old_denoised is None or h is None:
            x = denoised if h is None else (sigmas[i + 1] / sigmas[i]) * x - torch.expm1(-h) * denoised
        else:
            h_last = sigmas[i - 1].log() - sigmas[i].log()
            h_min, h_max = torch.minimum(h_last, h), torch.maximum(h_last, h)
            r = h_max / h_min
            denoised_d = (1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * old_denoised
            x = (sigmas[i + 1] / sigmas[i]) * x - torch.expm1(-(h_max + h_min) / 2) * denoised_d
        old_denoised = denoised
    return x


@torch.no_grad()
def sample_res_multistep(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, eta=0.0,
                         s_noise=1.0, noise_sampler: NoiseSampler | None = None, cfg_pp=False):
    """RES multistep exponential integrator (Zhang et al. 2023, "Improved Order Analysis ..."), as ComfyUI.

    `cfg_pp`: CFG++ (Chung et al. 2024), ComfyUI's res_multistep(_ancestral)_cfg_pp: the steps follow the
    unconditional prediction, the multistep one after adding the guidance denoised - uncond to x.
    """
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    uncond_of = uncond_source(model) if cfg_pp else None
    s_in = x.new_ones([x.shape[0]])
    old_denoised, old_sigma_down = None, None
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        followed = uncond_of(denoised) if cfg_pp else denoised  # the prediction the steps follow
        sigma_down, rescale, sigma_up = ancestral_split(model, sigmas[i], sigmas[i + 1], eta=eta)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        if sigma_down == 0 or old_denoised is None:
            if cfg_pp:
                x = denoised + to_d(x, sigmas[i], followed) * sigma_down
            else:
                x = x + to_d(x, sigmas[i], denoised) * (sigma_down - sigmas[i])
        else:
            h = sigmas[i].log() - sigma_down.log()  # step in t = -log sigma
            c2 = (old_sigma_down.log() - sigmas[i - 1].log()) / h  # previous node at c2 h (c2 < 0)
            phi1 = torch.expm1(-h) / -h
            phi2 = (phi1 - 1.0) / -h
            b1, b2 = torch.nan_to_num(phi1 - phi2 / c2), torch.nan_to_num(phi2 / c2)
            if cfg_pp:
                x = x + (denoised - followed)
            x = (-h).exp() * x + h * (b1 * followed + b2 * old_denoised)
        if sigmas[i + 1] > 0 and sigma_up > 0:
            x = rescale * x + noise_sampler(sigmas[i], sigmas[i + 1]) * s_noise * sigma_up
        old_denoised, old_sigma_down = followed, sigma_down
    return x


@torch.no_grad()
def sample_res_multistep_ancestral(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                                   eta=1.0, s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """RES multistep with ancestral noise (ComfyUI res_multistep_ancestral); the RF split on flow models."""
    return sample_res_multistep(model, x, sigmas, extra_args, callback, disable, eta, s_noise, noise_sampler)


@torch.no_grad()
def sample_res_multistep_cfg_pp(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                                s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """RES multistep with CFG++ (ComfyUI res_multistep_cfg_pp)."""
    return sample_res_multistep(model, x, sigmas, extra_args, callback, disable, 0.0, s_noise, noise_sampler,
                                cfg_pp=True)


@torch.no_grad()
def sample_res_multistep_ancestral_cfg_pp(model, x, sigmas, extra_args=None, callback: Callback = None,
                                          disable=None, eta=1.0, s_noise=1.0,
                                          noise_sampler: NoiseSampler | None = None):
    """RES multistep with ancestral noise and CFG++ (ComfyUI res_multistep_ancestral_cfg_pp)."""
    return sample_res_multistep(model, x, sigmas, extra_args, callback, disable, eta, s_noise, noise_sampler,
                                cfg_pp=True)
