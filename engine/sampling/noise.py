"""Seeded noise: the initial latent noise (as ComfyUI's prepare_noise) and the per-step noise samplers.

All noise is drawn on the CPU from a `torch.Generator` seeded with the job seed, then moved to the
sample's device, so a seed gives the same image whatever device runs the model.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

NoiseSampler = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (sigma, sigma_next) -> noise like x


def prepare_noise(latent: torch.Tensor, seed: int) -> torch.Tensor:
    """Initial noise exactly as ComfyUI's comfy.sample.prepare_noise: one CPU randn over the whole batch.

    ComfyUI seeds the global CPU generator (`torch.manual_seed(seed)`) and draws with it; a fresh
    `torch.Generator().manual_seed(seed)` yields the same stream without touching global state.
    """
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    return torch.randn(latent.shape, dtype=latent.dtype, layout=latent.layout, generator=generator,
                       device="cpu")


@dataclass(frozen=True)
class SeededNoise:
    """The NOISE of ComfyUI's RandomNoise node: `prepare_noise` with this seed, also the step-noise seed."""

    seed: int

    def generate(self, latent: torch.Tensor) -> torch.Tensor:
        return prepare_noise(latent, self.seed)


@dataclass(frozen=True)
class EmptyNoise:
    """The NOISE of ComfyUI's DisableNoise node: zeros, so sampling starts from the latent itself.

    `seed` still seeds the step noise of ancestral and SDE samplers (0 for DisableNoise, the node's seed for
    SamplerCustom with add_noise off, as in ComfyUI).
    """

    seed: int = 0

    def generate(self, latent: torch.Tensor) -> torch.Tensor:
        return torch.zeros(latent.shape, dtype=latent.dtype, layout=latent.layout, device="cpu")


def default_noise_sampler(x: torch.Tensor, seed: int | None = None) -> NoiseSampler:
    """Gaussian noise like x for ancestral and SDE steps, from a CPU generator seeded with `seed`.

    The stream uses `seed + 1` so that the first step's noise is not the initial noise again (ComfyUI
    seeds its step sampler with the job seed; on the CPU that repeats the initial noise). SDE samplers use
    this sampler too: torchsde's Brownian tree is not a dependency, so SDE noise is independent per step
    rather than a Brownian path (results differ from ComfyUI's BrownianTreeNoiseSampler, the law matches).
    """
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed((int(seed) + 1) % 2 ** 64)

    def sample(sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape, dtype=torch.float32, generator=generator, device="cpu")
        return noise.to(device=x.device, dtype=x.dtype)

    return sample
