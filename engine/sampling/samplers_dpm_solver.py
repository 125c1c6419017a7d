"""DPM-Solver-fast and DPM-Solver-12/23 adaptive (Lu et al. 2022, arXiv:2206.00927), as k-diffusion.

They choose their own steps between the schedule's smallest non-zero sigma and its first sigma, so they
ignore the intermediate sigmas (as ComfyUI's dpm_fast / dpm_adaptive do) and end at that smallest sigma.
The callback fires once per model evaluation round ("i" counts rounds).
"""

import math

import torch

from .flow import refuse_option_on_flow
from .noise import NoiseSampler, default_noise_sampler
from .samplers import Callback, get_ancestral_step


def _sigma(t: torch.Tensor) -> torch.Tensor:
    """sigma = exp(-t)."""
    return t.neg().exp()


class _DPMSolver:
    """First- to third-order DPM-Solver steps in t = -log sigma on a k-diffusion denoiser."""

    def __init__(self, model, extra_args: dict, callback: Callback):
        self.model, self.extra_args, self.callback = model, extra_args, callback
        self.nfe = 0

    def eps(self, cache: dict, key: str, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if key not in cache:
            sigma = t.neg().exp()
            cache[key] = (x - self.model(x, sigma * x.new_ones([x.shape[0]]), **self.extra_args)) / sigma
            self.nfe += 1
        return cache[key]

    def step(self, order: int, x, t, t_next, cache: dict, r1: float | None = None):
        """DPM-Solver-1/2/3 (Lu et al. 2022, Algorithms 1-2) from t to t_next."""
        h = t_next - t
        sigma = _sigma
        eps = self.eps(cache, "eps", x, t)
        if order == 1:
            return x - sigma(t_next) * h.expm1() * eps
        if order == 2:
            r1 = 1 / 2 if r1 is None else r1
            s1 = t + r1 * h
            u1 = x - sigma(s1) * (r1 * h).expm1() * eps
            eps_r1 = self.eps(cache, "eps_r1", u1, s1)
            return x - sigma(t_next) * h.expm1() * eps - sigma(t_next) / (2 * r1) * h.expm1() * (eps_r1 - eps)
        r1, r2 = 1 / 3, 2 / 3
        s1, s2 = t + r1 * h, t + r2 * h
        u1 = x - sigma(s1) * (r1 * h).expm1() * eps
        eps_r1 = self.eps(cache, "eps_r1", u1, s1)
        u2 = x - sigma(s2) * (r2 * h).expm1() * eps \
            - sigma(s2) * (r2 / r1) * ((r2 * h).expm1() / (r2 * h) - 1) * (eps_r1 - eps)
        eps_r2 = self.eps(cache, "eps_r2", u2, s2)
        return x - sigma(t_next) * h.expm1() * eps - sigma(t_next) / r2 * (h.expm1() / h - 1) * (eps_r2 - eps)

    def report(self, i: int, x, t, cache: dict) -> None:
        if self.callback is not None:
            sigma = t.neg().exp()
            denoised = x - sigma * cache["eps"]
            self.callback({"x": x, "i": i, "sigma": sigma, "sigma_hat": sigma, "denoised": denoised})


def _sigma_range(sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positive = sigmas[sigmas > 0]
    if len(positive) == 0:
        raise ValueError("dpm_fast / dpm_adaptive need at least one sigma > 0")
    return positive.min().double(), sigmas[0].double()


@torch.no_grad()
def sample_dpm_fast(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, eta=0.0,
                    s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """DPM-Solver-fast: orders 3,3,...,2,1 with uniform log-sigma steps, len(sigmas) - 1 evaluations."""
    refuse_option_on_flow(model, "dpm_fast", "eta", eta)
    if len(sigmas) <= 1:
        return x
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    sigma_min, sigma_max = _sigma_range(sigmas)
    solver, nfe = _DPMSolver(model, extra_args, callback), len(sigmas) - 1
    t_start, t_end = -sigma_max.log(), -sigma_min.log()
    m = math.floor(nfe / 3) + 1
    ts = torch.linspace(float(t_start), float(t_end), m + 1, dtype=torch.float64)
    orders = [3] * (m - 2) + [2, 1] if nfe % 3 == 0 else [3] * (m - 1) + [nfe % 3]
    for i, order in enumerate(orders):
        cache, t, t_next = {}, ts[i], ts[i + 1]
        sigma_up = 0.0
        if eta:
            sigma_down, sigma_up = get_ancestral_step(t.neg().exp(), t_next.neg().exp(), eta)
            t_next = torch.minimum(t_end, -sigma_down.log())
            sigma_up = float((ts[i + 1].neg().exp() ** 2 - t_next.neg().exp() ** 2) ** 0.5)
        solver.eps(cache, "eps", x, t)
        solver.report(i, x, t, cache)
        x = solver.step(order, x, t, t_next, cache)
        if sigma_up:
            x = x + sigma_up * s_noise * noise_sampler(t.neg().exp(), ts[i + 1].neg().exp())
    return x


@torch.no_grad()
def sample_dpm_adaptive(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, order=3,
                        rtol=0.05, atol=0.0078, h_init=0.05, pcoeff=0.0, icoeff=1.0, dcoeff=0.0,
                        accept_safety=0.81):
    """DPM-Solver-12/23 with PID step-size control on the embedded lower-order error estimate."""
    if len(sigmas) <= 1:
        return x
    if order not in (2, 3):
        raise ValueError(f"dpm_adaptive order must be 2 or 3; got {order}")
    extra_args = {} if extra_args is None else extra_args
    sigma_min, sigma_max = _sigma_range(sigmas)
    solver = _DPMSolver(model, extra_args, callback)
    s, t_end = -sigma_max.log(), -sigma_min.log()
    h = h_init
    b1, b2, b3 = (pcoeff + icoeff + dcoeff) / order, -(pcoeff + 2 * dcoeff) / order, dcoeff / order
    errors, x_prev, step = [], x, 0
    while s < t_end - 1e-5:
        cache = {}
        t = torch.minimum(t_end, s + h)
        solver.eps(cache, "eps", x, s)
        x_low = solver.step(order - 1, x, s, t, cache, r1=1 / 3 if order == 3 else None)
        x_high = solver.step(order, x, s, t, cache)
        delta = torch.maximum(torch.tensor(atol), rtol * torch.maximum(x_low.abs(), x_prev.abs()))
        error = float(torch.linalg.norm((x_low - x_high) / delta)) / x.numel() ** 0.5
        inv_error = 1 / (error + 1e-8)
        errors = [inv_error] * 3 if not errors else [inv_error] + errors[1:]
        factor = 1 + math.atan(errors[0] ** b1 * errors[1] ** b2 * errors[2] ** b3 - 1)  # limited PID factor
        if factor >= accept_safety:
            errors = [errors[0], errors[0], errors[1]]
            solver.report(step, x, s, cache)
            x_prev, x, s = x_low, x_high, t
        h *= factor
        step += 1
    return x
