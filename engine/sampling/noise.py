"""Seeded noise: the initial latent noise (as ComfyUI's prepare_noise) and the per-step noise samplers.

As ComfyUI: the initial noise is drawn on the CPU from a `torch.Generator` seeded with the job seed (the same
on every device); the step noise of ancestral samplers on the latent's device (default_noise_sampler), and
that of the DPM++ SDE samplers from a torchsde Brownian tree (BrownianTreeNoiseSampler), so a seed gives
ComfyUI's image on the same device.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

NoiseSampler = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (sigma, sigma_next) -> noise like x


def prepare_noise(latent: torch.Tensor, seed: int, batch_index: Sequence[int] | None = None) -> torch.Tensor:
    """Initial noise exactly as ComfyUI's comfy.sample.prepare_noise: one CPU randn over the whole batch.

    ComfyUI seeds the global CPU generator (`torch.manual_seed(seed)`) and draws with it; a fresh
    `torch.Generator().manual_seed(seed)` yields the same stream without touching global state. With a
    LATENT's `batch_index` (LatentFromBatch, RepeatLatentBatch), item k gets the batch_index[k]-th of
    max(batch_index) + 1 single-item draws, so an item keeps the noise it had in its original batch.
    """
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    if batch_index is None:
        return torch.randn(latent.shape, dtype=latent.dtype, layout=latent.layout, generator=generator,
                           device="cpu")
    if len(batch_index) != latent.shape[0] or min(batch_index) < 0:
        raise ValueError(f"batch_index must give a non-negative index per latent item ({latent.shape[0]}); "
                         f"got {list(batch_index)}")
    item_shape = (1, *latent.shape[1:])
    draws = [torch.randn(item_shape, dtype=latent.dtype, layout=latent.layout, generator=generator,
                         device="cpu") for _ in range(max(batch_index) + 1)]
    return torch.cat([draws[int(k)] for k in batch_index])


@dataclass(frozen=True)
class SeededNoise:
    """The NOISE of ComfyUI's RandomNoise node: `prepare_noise` with this seed, also the step-noise seed."""

    seed: int

    def generate(self, latent: torch.Tensor, batch_index: Sequence[int] | None = None) -> torch.Tensor:
        return prepare_noise(latent, self.seed, batch_index)


@dataclass(frozen=True)
class EmptyNoise:
    """The NOISE of ComfyUI's DisableNoise node: zeros, so sampling starts from the latent itself.

    `seed` still seeds the step noise of ancestral and SDE samplers (0 for DisableNoise, the node's seed for
    SamplerCustom with add_noise off, as in ComfyUI).
    """

    seed: int = 0

    def generate(self, latent: torch.Tensor, batch_index: Sequence[int] | None = None) -> torch.Tensor:
        return torch.zeros(latent.shape, dtype=latent.dtype, layout=latent.layout, device="cpu")


def step_noise_seed(seed: int, device: torch.device) -> int:
    """The seed of ComfyUI's step-noise generator on `device`: the job seed on an accelerator, seed + 1 on
    the CPU (where the seed itself would repeat the initial noise, which is drawn on the CPU; ComfyUI PR
    #11528)."""
    return (int(seed) + 1) % 2 ** 64 if torch.device(device).type == "cpu" else int(seed)


def default_noise_sampler(x: torch.Tensor, seed: int | None = None) -> NoiseSampler:
    """ComfyUI's default_noise_sampler: Gaussian noise like x (its dtype, layout and device) for ancestral
    and other stochastic steps, from a generator on x's device seeded with `step_noise_seed`.

    Without a seed the draws come from torch's global generator of that device (as ComfyUI).
    """
    generator = None
    if seed is not None:
        generator = torch.Generator(device=x.device).manual_seed(step_noise_seed(seed, x.device))

    def sample(sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
        return torch.randn(x.shape, dtype=x.dtype, layout=x.layout, device=x.device, generator=generator)

    return sample


class BrownianTreeNoiseSampler:
    """ComfyUI's BrownianTreeNoiseSampler (k-diffusion's, over torchsde's BrownianTree): the step noise of
    the DPM++ SDE samplers, normalised increments of one Brownian path over [sigma_min, sigma_max].

    The tree starts at W(sigma_min) = 0 (zeros like x) and is seeded by `seed` (torchsde's `entropy`; a
    random one from torch's global generator when None). `cpu=True` keeps the tree on the CPU (ComfyUI's
    dpmpp_*_sde), False on x's device (the `_gpu` samplers). A call (sigma, sigma_next) returns
    (W(sigma_next) - W(sigma)) / sqrt(|sigma_next - sigma|) on sigma's device and dtype, the sign
    following the direction of the step.
    """

    def __init__(self, x: torch.Tensor, sigma_min, sigma_max, seed: int | None = None, cpu: bool = True):
        import torchsde  # imported here: only the SDE samplers need it

        t0, t1 = torch.as_tensor(sigma_min), torch.as_tensor(sigma_max)
        self.sign = 1 if t0 < t1 else -1
        t0, t1 = (t0, t1) if t0 < t1 else (t1, t0)
        w0 = torch.zeros_like(x)
        if seed is None:
            seed = int(torch.randint(0, 2 ** 63 - 1, ()).item())
        self.cpu = cpu
        if cpu:
            t0, w0, t1 = t0.detach().cpu(), w0.detach().cpu(), t1.detach().cpu()
        self.tree = torchsde.BrownianTree(t0, w0, t1, entropy=int(seed))

    def __call__(self, sigma, sigma_next) -> torch.Tensor:
        t0, t1 = torch.as_tensor(sigma), torch.as_tensor(sigma_next)
        lo, hi, sign = (t0, t1, 1) if t0 < t1 else (t1, t0, -1)
        device, dtype = lo.device, lo.dtype
        if self.cpu:
            lo, hi = lo.detach().cpu().float(), hi.detach().cpu().float()
        w = self.tree(lo, hi).to(device=device, dtype=dtype) * (self.sign * sign)
        return w / (t1 - t0).abs().sqrt()


def brownian_tree_noise_sampler(x: torch.Tensor, sigmas: torch.Tensor, seed: int | None,
                                cpu: bool = True) -> BrownianTreeNoiseSampler:
    """The Brownian tree ComfyUI's DPM++ SDE samplers build for these sigmas: over [smallest non-zero sigma,
    largest sigma]."""
    return BrownianTreeNoiseSampler(x, sigmas[sigmas > 0].min(), sigmas.max(), seed=seed, cpu=cpu)
