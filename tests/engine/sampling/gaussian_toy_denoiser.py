"""Shared toys for the sampling tests: the exact denoiser of Gaussian data, and diffusers drivers."""

import math

import torch

from engine.sampling.model_sampling import EpsPrediction

DATA_MEAN, DATA_STD = 0.5, 0.5


class GaussianDenoiser:
    """Exact denoiser, data N(m, s^2): D(x, sigma) = (s^2 x + sigma^2 m) / (s^2 + sigma^2)."""

    def __init__(self, mean: float = DATA_MEAN, std: float = DATA_STD):
        self.mean, self.std = mean, std
        self.model_sampling = EpsPrediction()
        self.calls = 0

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **extra) -> torch.Tensor:
        self.calls += 1
        sigma = torch.as_tensor(sigma, dtype=x.dtype).reshape(-1, *([1] * (x.ndim - 1)))
        return (self.std ** 2 * x + sigma ** 2 * self.mean) / (self.std ** 2 + sigma ** 2)

    def eps(self, x_k: torch.Tensor, sigma: float) -> torch.Tensor:
        """Noise prediction a diffusers scheduler expects, from the k-diffusion sample x_k at sigma."""
        if sigma == 0:
            return torch.zeros_like(x_k)
        return (x_k - self(x_k, torch.tensor(sigma, dtype=x_k.dtype))) / sigma

    def ode_solution(self, x_start: torch.Tensor, sigma_start: float) -> torch.Tensor:
        """Exact probability-flow ODE solution at sigma 0 from x_start at sigma_start."""
        return self.mean + (x_start - self.mean) * self.std / math.sqrt(self.std ** 2 + sigma_start ** 2)


def sigma_from_scale(scheduler, t, like: torch.Tensor) -> float:
    """Recover the sigma a k-style diffusers scheduler uses at t from its input scale 1/sqrt(sigma^2+1)."""
    scale = float(scheduler.scale_model_input(torch.ones_like(like[:1]), t).flatten()[0])
    return math.sqrt(max(1.0 / scale ** 2 - 1.0, 0.0))


def run_k_scheduler(scheduler, toy: GaussianDenoiser, x: torch.Tensor, generator=None) -> torch.Tensor:
    """Drive a k-diffusion-style diffusers scheduler (samples in k space) with the toy denoiser."""
    for t in scheduler.timesteps:
        sigma = sigma_from_scale(scheduler, t, x)
        extra = {} if generator is None else {"generator": generator}
        x = scheduler.step(toy.eps(x, sigma), t, x, **extra).prev_sample
    return x


def alphas_sigma(scheduler, t) -> float:
    """k-diffusion sigma of a VP diffusers scheduler's integer timestep t."""
    alpha = float(scheduler.alphas_cumprod[int(t)])
    return math.sqrt((1 - alpha) / alpha)


def run_vp_scheduler(scheduler, toy: GaussianDenoiser, x_k: torch.Tensor, sigmas: list[float],
                     step_kwargs=lambda i: {}) -> torch.Tensor:
    """Drive a VP diffusers scheduler from the k-space sample x_k at sigmas[0]; returns the k-space result."""
    x = x_k / math.sqrt(1 + sigmas[0] ** 2)
    for i, t in enumerate(scheduler.timesteps):
        sigma = sigmas[i]
        eps = toy.eps(x * math.sqrt(1 + sigma ** 2), sigma)
        x = scheduler.step(eps, t, x, **step_kwargs(i)).prev_sample
    return x * math.sqrt(1 + sigmas[len(scheduler.timesteps)] ** 2)
