"""Multistep samplers: reuse the previous steps' predictions instead of extra model calls.

Same conventions as samplers.py (k-diffusion signature, one callback per step).
"""

import math

import numpy as np
import torch

from .flow import refuse_on_flow
from .noise import NoiseSampler, default_noise_sampler
from .samplers import Callback, ancestral_split, to_d

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
                         s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """RES multistep exponential integrator (Zhang et al. 2023, "Improved Order Analysis ..."), as ComfyUI."""
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    old_denoised, old_sigma_down = None, None
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        sigma_down, rescale, sigma_up = ancestral_split(model, sigmas[i], sigmas[i + 1], eta=eta)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        if sigma_down == 0 or old_denoised is None:
            x = x + to_d(x, sigmas[i], denoised) * (sigma_down - sigmas[i])
        else:
            h = sigmas[i].log() - sigma_down.log()  # step in t = -log sigma
            c2 = (old_sigma_down.log() - sigmas[i - 1].log()) / h  # previous node at c2 h (c2 < 0)
            phi1 = torch.expm1(-h) / -h
            phi2 = (phi1 - 1.0) / -h
            b1, b2 = torch.nan_to_num(phi1 - phi2 / c2), torch.nan_to_num(phi2 / c2)
            x = (-h).exp() * x + h * (b1 * denoised + b2 * old_denoised)
        if sigmas[i + 1] > 0 and sigma_up > 0:
            x = rescale * x + noise_sampler(sigmas[i], sigmas[i + 1]) * s_noise * sigma_up
        old_denoised, old_sigma_down = denoised, sigma_down
    return x


@torch.no_grad()
def sample_res_multistep_ancestral(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                                   eta=1.0, s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """RES multistep with ancestral noise (ComfyUI res_multistep_ancestral); the RF split on flow models."""
    return sample_res_multistep(model, x, sigmas, extra_args, callback, disable, eta, s_noise, noise_sampler)


def _unipc_system(h: torch.Tensor, rks: torch.Tensor, order: int, variant: str):
    """UniPC's (h phi_1, B(h), R, b) for data prediction (Zhao et al. 2023, Algorithms 2-3)."""
    hh = -h
    h_phi_1 = torch.expm1(hh)
    h_phi_k = h_phi_1 / hh - 1
    b_h = hh if variant == "bh1" else torch.expm1(hh)
    rows, b, factorial = [], [], 1
    for k in range(1, order + 1):
        rows.append(rks ** (k - 1))
        b.append(h_phi_k * factorial / b_h)
        factorial *= k + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    return h_phi_1, b_h, torch.stack(rows), torch.stack(b)


def _unipc_differences(history, lambdas, lambda_s0, h, order):
    """Scaled differences D1_k = (m_k - m_0) / r_k of the last `order - 1` predictions, and r_k."""
    m0 = history[-1]
    rks = [(lambdas[-(k + 1)] - lambda_s0) / h for k in range(1, order)]
    d1s = [(history[-(k + 1)] - m0) / rk for k, rk in zip(range(1, order), rks, strict=True)]
    return torch.stack(rks + [torch.ones_like(h)]), d1s


@torch.no_grad()
def sample_uni_pc(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, order=3,
                  variant="bh1"):
    """UniPC multistep predictor-corrector (Zhao et al. 2023), data prediction, lower order at the end."""
    extra_args = {} if extra_args is None else extra_args
    s_in = x.new_ones([x.shape[0]])
    lambdas = -sigmas.double().log()  # lambda = -log sigma (inf at sigma 0)
    history, lambda_history = [], []
    x_prev, prev_order = None, 1
    n = len(sigmas) - 1
    for i in range(n):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        if x_prev is not None:  # UniC: correct the point just reached with its own prediction
            h = lambdas[i] - lambda_history[-1]
            rks, d1s = _unipc_differences(history, lambda_history, lambda_history[-1], h, prev_order)
            h_phi_1, b_h, rows, b = _unipc_system(h, rks, prev_order, variant)
            rhos = torch.tensor([0.5], dtype=h.dtype) if prev_order == 1 else torch.linalg.solve(rows, b)
            res = sum(float(r) * d for r, d in zip(rhos[:-1], d1s, strict=True)) + float(rhos[-1]) * \
                (denoised - history[-1])
            x = (sigmas[i] / sigmas[i - 1]) * x_prev - float(h_phi_1) * history[-1] - float(b_h) * res
        history, lambda_history = (history + [denoised])[-order:], (lambda_history + [lambdas[i]])[-order:]
        this_order = min(order, n - i, len(history))
        h = lambdas[i + 1] - lambdas[i]
        rks, d1s = _unipc_differences(history, lambda_history, lambdas[i], h, this_order)
        h_phi_1, b_h, rows, b = _unipc_system(h, rks, this_order, variant)
        x_prev = x
        x = (sigmas[i + 1] / sigmas[i]) * x - float(h_phi_1) * denoised
        if this_order > 1:  # UniP: higher-order predictor terms
            rhos = torch.tensor([0.5], dtype=h.dtype) if this_order == 2 else \
                torch.linalg.solve(rows[:-1, :-1], b[:-1])
            x = x - float(b_h) * sum(float(r) * d for r, d in zip(rhos, d1s, strict=True))
        prev_order = this_order
    return x


@torch.no_grad()
def sample_uni_pc_bh2(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, order=3):
    """UniPC with the B(h) = e^h - 1 variant (Zhao et al. 2023)."""
    return sample_uni_pc(model, x, sigmas, extra_args, callback, disable, order=order, variant="bh2")
