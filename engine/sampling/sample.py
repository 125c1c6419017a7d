"""The KSampler / KSamplerAdvanced job: sigmas, initial noise, guidance, sampler, progress; and its second
half, `sample_sigmas`, which the custom-sampling nodes (given sigmas, noise and guider) run directly.

Semantics follow ComfyUI (nodes.common_ksampler, comfy.samplers.KSampler): `denoise < 1` computes
`int(steps / denoise)` sigmas and keeps the last `steps + 1`; `start_step` / `end_step` slice them;
the noise is scaled into the latent by the model's `noise_scaling` (sqrt(1 + sigma^2) when starting
from the model's sigma_max, sigma otherwise). The latent is in the model's space (already multiplied
by the VAE scale factor). A noise mask (the LATENT's "noise_mask") keeps the latent where it is 0
(inpaint.InpaintDenoiser, ComfyUI's KSamplerX0Inpaint).
"""

import inspect
from collections.abc import Callable

import torch

from .flow import is_flow
from .guidance import CFGDenoiser, Conditioning
from .inpaint import InpaintDenoiser, latent_noise_mask
from .model_sampling import Denoiser, max_denoise
from .noise import prepare_noise
from .preview import latent_to_rgb
from .registry import (
    Sampler,
    discards_penultimate_sigma,
    final_sigma,
    resolve_sampler,
    step_noise_sampler,
    uses_random_inpaint_noise,
)
from .schedulers import calculate_sigmas


def ksampler_sigmas(model_sampling, scheduler: str, steps: int, denoise: float = 1.0,
                    start_step: int | None = None, end_step: int | None = None,
                    return_with_leftover_noise: bool = False, family: str | None = None,
                    custom_sigmas=None, sampler: str | None = None) -> torch.Tensor:
    """The sigmas a KSampler(Advanced) runs; empty when there is nothing to do (denoise 0, start >= end).

    With `sampler` named, the samplers of registry.DISCARD_PENULTIMATE_SIGMA get ComfyUI's KSampler rule:
    the schedule of n + 1 steps less its second-to-last sigma wherever n steps are asked. BasicScheduler
    (no sampler) gets the plain schedule, as in ComfyUI.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    if not 0.0 <= denoise <= 1.0:
        raise ValueError(f"denoise must be in [0, 1]; got {denoise}")
    for label, value in (("start_step", start_step), ("end_step", end_step)):
        if value is not None and value < 0:
            raise ValueError(f"{label} must be >= 0; got {value}")
    if denoise <= 0.0:
        return torch.zeros(0)
    discard = sampler is not None and discards_penultimate_sigma(sampler)

    def schedule(n: int) -> torch.Tensor:
        if not discard:
            return calculate_sigmas(scheduler, model_sampling, n, family, custom_sigmas)
        longer = calculate_sigmas(scheduler, model_sampling, n + 1, family, custom_sigmas)
        return torch.cat([longer[:-2], longer[-1:]])

    if denoise > 0.9999:
        sigmas = schedule(steps)
    else:
        sigmas = schedule(int(steps / denoise))[-(steps + 1):]
    if end_step is not None and end_step < len(sigmas) - 1:
        sigmas = sigmas[:end_step + 1].clone()
        if not return_with_leftover_noise:
            sigmas[-1] = 0.0
    if start_step is not None:
        sigmas = sigmas[start_step:] if start_step < len(sigmas) - 1 else torch.zeros(0)
    return sigmas


def sample(model: Denoiser, latent: torch.Tensor, positive: Conditioning, negative: Conditioning | None,
           cfg: float, sampler: str, scheduler: str, steps: int, seed: int, denoise: float = 1.0,
           add_noise: bool = True, start_step: int | None = None, end_step: int | None = None,
           return_with_leftover_noise: bool = False, callback: Callable[[dict], None] | None = None,
           check_interrupt: Callable[[], None] | None = None,
           preview: Callable[[int, object], None] | None = None, family: str = "sd1",
           custom_sigmas=None, sampler_options: dict | None = None,
           denoise_mask: torch.Tensor | None = None, batch_index: list[int] | None = None) -> torch.Tensor:
    """Run one KSampler(Advanced) job on a (B, C, H, W) model-space latent; returns the sampled latent.

    `callback(info)` gets the sampler's per-step dict plus "total"; `check_interrupt()` runs before every
    model call (raise from it to abort within one step); `preview(step, rgb)` gets an (H, W, 3) uint8
    projection of the step's denoised latent for `family`. `denoise_mask` (the LATENT's noise_mask, any
    size): sample only where it is 1. `batch_index` (the LATENT's): the items' places in the noise draws.
    """
    sampler_fn = resolve_sampler(sampler)
    sigmas = ksampler_sigmas(model.model_sampling, scheduler, steps, denoise, start_step, end_step,
                             return_with_leftover_noise, family, custom_sigmas, sampler=sampler)
    if len(sigmas) < 2:
        return latent.clone()
    noise = prepare_noise(latent, seed, batch_index) if add_noise else torch.zeros_like(latent)
    random_blend = denoise_mask is not None and uses_random_inpaint_noise(sampler)
    inpaint_noise = prepare_noise(latent, seed + 1) if random_blend else None
    guided = CFGDenoiser(model, positive, negative, cfg, check_interrupt=check_interrupt)
    return sample_sigmas(guided, latent, noise, sigmas, sampler_fn, seed, callback=callback, preview=preview,
                         family=family, sampler_options=sampler_options, denoise_mask=denoise_mask,
                         inpaint_noise=inpaint_noise)


def sample_sigmas(model: CFGDenoiser, latent: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor,
                  sampler: Sampler, seed: int, callback: Callable[[dict], None] | None = None,
                  preview: Callable[[int, object], None] | None = None, family: str = "sd1",
                  sampler_options: dict | None = None, denoise_mask: torch.Tensor | None = None,
                  inpaint_noise: torch.Tensor | None = None) -> torch.Tensor:
    """Sample a (B, C, H, W) model-space latent over the given sigmas, as ComfyUI's KSAMPLER.sample.

    The latent is noised to sigmas[0] by the model sampling's `noise_scaling` (`noise` is unit Gaussian, or
    zeros for none), the guided denoiser `model` is stepped by `sampler`, and the result un-scaled at the
    sigma the run ends at (registry.final_sigma). `seed` seeds the per-step noise of ancestral and SDE
    samplers as ComfyUI's KSAMPLER does (registry.step_noise_sampler). Empty sigmas return the latent; a
    single sigma returns the latent noised to it, without a model call (as ComfyUI). `callback`, `preview`
    and `family` as for `sample`. `denoise_mask` (B', 1, H, W) at any size: the latent is kept where it is
    0, by blending the latent noised with `inpaint_noise` (default: `noise`) into every model call.
    """
    if len(sigmas) == 0:
        return latent.clone()
    model_sampling = model.model_sampling
    sigmas = sigmas.to(latent.device)
    noise = noise.to(latent.device)
    x = model_sampling.noise_scaling(sigmas[0], noise, latent, max_denoise(model_sampling, sigmas))
    if len(sigmas) == 1:
        return model_sampling.inverse_noise_scaling(sigmas[-1], x)
    if denoise_mask is not None:
        blend_noise = noise if inpaint_noise is None else inpaint_noise.to(latent.device)
        model = InpaintDenoiser(model, latent, blend_noise,
                                latent_noise_mask(denoise_mask, latent.shape).to(latent.device))
    total = len(sigmas) - 1

    def on_step(info: dict) -> None:
        if callback is not None:
            callback({**info, "total": total})
        if preview is not None:
            preview(info["i"], latent_to_rgb(info["denoised"], family))

    options = dict(sampler_options or {})
    if "noise_sampler" in inspect.signature(sampler).parameters and "noise_sampler" not in options:
        options["noise_sampler"] = step_noise_sampler(sampler, x, sigmas, seed, flow=is_flow(model))
    samples = sampler(model, x, sigmas, extra_args={}, callback=on_step, disable=True, **options)
    return model_sampling.inverse_noise_scaling(final_sigma(sampler, sigmas), samples)
