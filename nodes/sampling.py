"""Sampler nodes with ComfyUI's names and input order: KSampler and KSamplerAdvanced.

Both are thin wrappers over engine/sampling/sample.py: the latent is scaled into the model's space, sampled
with classifier-free guidance, and scaled back to the raw LATENT space. Progress is reported every step, and
a preview as the workflow's settings["preview"] asks (engine/previews.py: TAESD or latent-to-RGB). The
helpers for those parts are shared with the custom-sampling nodes (nodes/custom_sampling.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.graph.spec import (
    NodeType,
    Output,
    RunContext,
    combo_input,
    float_input,
    int_input,
    link_input,
    seed_input,
)
from engine.models.bundles import DiffusionModel, require
from engine.previews import make_previewer
from engine.sampling.registry import SAMPLER_ALIASES, SAMPLERS
from engine.sampling.sample import sample
from engine.sampling.schedulers import SCHEDULERS
from nodes.latent import latent_samples

SAMPLER_NAMES = tuple(SAMPLERS) + tuple(name for name in SAMPLER_ALIASES if name not in SAMPLERS)
SCHEDULER_NAMES = tuple(SCHEDULERS)
MAX_STEPS = 10000


def model_samples(model: DiffusionModel, latent_image: Any) -> torch.Tensor:
    """The LATENT's raw samples (float32) for `model`: an empty (all-zero) latent of another channel count
    takes the model's (ComfyUI's fix_empty_latent_channels), any other mismatch is an error."""
    samples = latent_samples(latent_image).float()
    channels = model.latent_channels
    if samples.shape[1] != channels:
        if bool(samples.any()):
            raise ValueError(f"the latent has {samples.shape[1]} channels but this {model.family} model "
                             f"samples {channels}; use a latent made for it (EmptyLatentImage: 4, "
                             f"EmptySD3LatentImage: 16) or the model's own VAE")
        samples = samples.new_zeros(samples.shape[0], channels, *samples.shape[2:])
    return samples


def model_space(model: DiffusionModel, samples: torch.Tensor) -> torch.Tensor:
    """Raw samples -> the model's space on its device; the empty latent stays zero, unshifted (as ComfyUI)."""
    samples = samples.to(model.torch_device)
    return model.process_in(samples) if bool(samples.any()) else samples


def step_reporter(ctx: RunContext, model: DiffusionModel) -> Callable[[dict], None]:
    """The per-step callback of a sampler node: progress every step, a preview as the settings ask."""
    previewer = make_previewer(getattr(ctx.workflow, "settings", None), model.latent_format, ctx.settings)

    def on_step(info: dict) -> None:
        ctx.report_progress(info["i"] + 1, info["total"])
        image = previewer(info["i"], info["total"], info["denoised"]) if previewer is not None else None
        if image is not None:
            ctx.report_preview(image)

    return on_step


def latent_output(model: DiffusionModel, latent_image: Any, result: torch.Tensor) -> dict[str, Any]:
    """A model-space result as the LATENT dict (raw space, on the CPU), keeping the input's other keys."""
    return {**latent_image, "samples": model.process_out(result).cpu()}


def run_sampler(ctx: RunContext, model: Any, latent_image: Any, positive: Any, negative: Any, cfg: float,
                sampler_name: str, scheduler: str, steps: int, seed: int, denoise: float = 1.0,
                add_noise: bool = True, start_step: int | None = None, end_step: int | None = None,
                return_with_leftover_noise: bool = False) -> dict[str, torch.Tensor]:
    """One KSampler(Advanced) run on ComfyUI types; returns the LATENT dict."""
    model = require(model, "MODEL", DiffusionModel)
    samples = model_samples(model, latent_image)
    height, width = samples.shape[2] * 8, samples.shape[3] * 8
    cond = model.guidance_conditioning(positive, width, height)
    uncond = model.guidance_conditioning(negative, width, height)
    with model.holding_sampler_state(samples, positive, negative):
        result = sample(model.denoiser(), model_space(model, samples), cond, uncond, cfg, sampler_name,
                        scheduler, steps, seed, denoise=denoise, add_noise=add_noise, start_step=start_step,
                        end_step=end_step, return_with_leftover_noise=return_with_leftover_noise,
                        callback=step_reporter(ctx, model), check_interrupt=ctx.check_interrupt,
                        family=model.latent_format)
    return latent_output(model, latent_image, result)


class KSampler(NodeType):
    display_name = "KSampler"
    category = "sampling"
    description = "Denoises the latent with the model, guided by the positive and negative conditioning."
    inputs = (link_input("model", "MODEL"),
              seed_input("seed", 0),
              int_input("steps", 20, min=1, max=MAX_STEPS),
              float_input("cfg", 8.0, min=0.0, max=100.0, step=0.1),
              combo_input("sampler_name", SAMPLER_NAMES, "euler"),
              combo_input("scheduler", SCHEDULER_NAMES, "normal"),
              link_input("positive", "CONDITIONING"),
              link_input("negative", "CONDITIONING"),
              link_input("latent_image", "LATENT"),
              float_input("denoise", 1.0, min=0.0, max=1.0, step=0.01))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, model: Any, seed: int, steps: int, cfg: float, sampler_name: str,
            scheduler: str, positive: Any, negative: Any, latent_image: Any, denoise: float) -> tuple:
        return (run_sampler(ctx, model, latent_image, positive, negative, cfg, sampler_name, scheduler, steps,
                            seed, denoise=denoise),)


class KSamplerAdvanced(NodeType):
    display_name = "KSampler (Advanced)"
    category = "sampling"
    description = ("KSampler over a range of steps: start_at_step..end_at_step of `steps`, optionally "
                   "without adding noise or keeping the leftover noise (for refiner hand-offs).")
    inputs = (link_input("model", "MODEL"),
              combo_input("add_noise", ("enable", "disable"), "enable"),
              seed_input("noise_seed", 0),
              int_input("steps", 20, min=1, max=MAX_STEPS),
              float_input("cfg", 8.0, min=0.0, max=100.0, step=0.1),
              combo_input("sampler_name", SAMPLER_NAMES, "euler"),
              combo_input("scheduler", SCHEDULER_NAMES, "normal"),
              link_input("positive", "CONDITIONING"),
              link_input("negative", "CONDITIONING"),
              link_input("latent_image", "LATENT"),
              int_input("start_at_step", 0, min=0, max=MAX_STEPS),
              int_input("end_at_step", MAX_STEPS, min=0, max=MAX_STEPS),
              combo_input("return_with_leftover_noise", ("disable", "enable"), "disable"))
    outputs = (Output("LATENT", "LATENT"),)

    def run(self, ctx: RunContext, model: Any, add_noise: str, noise_seed: int, steps: int, cfg: float,
            sampler_name: str, scheduler: str, positive: Any, negative: Any, latent_image: Any,
            start_at_step: int, end_at_step: int, return_with_leftover_noise: str) -> tuple:
        return (run_sampler(ctx, model, latent_image, positive, negative, cfg, sampler_name, scheduler, steps,
                            noise_seed, add_noise=add_noise == "enable", start_step=start_at_step,
                            end_step=end_at_step,
                            return_with_leftover_noise=return_with_leftover_noise == "enable"),)


NODE_TYPES = (KSampler, KSamplerAdvanced)
