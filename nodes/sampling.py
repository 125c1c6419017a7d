"""Sampler nodes with ComfyUI's names and input order: KSampler and KSamplerAdvanced.

Both are thin wrappers over engine/sampling/sample.py: the latent is scaled into the model's space, sampled
with classifier-free guidance, and scaled back to the raw LATENT space. Progress is reported every step, and
a preview as the workflow's settings["preview"] asks (engine/previews.py: TAESD or latent-to-RGB).
"""

from __future__ import annotations

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


def run_sampler(ctx: RunContext, model: Any, latent_image: Any, positive: Any, negative: Any, cfg: float,
                sampler_name: str, scheduler: str, steps: int, seed: int, denoise: float = 1.0,
                add_noise: bool = True, start_step: int | None = None, end_step: int | None = None,
                return_with_leftover_noise: bool = False) -> dict[str, torch.Tensor]:
    """One KSampler(Advanced) run on ComfyUI types; returns the LATENT dict."""
    model = require(model, "MODEL", DiffusionModel)
    samples = latent_samples(latent_image)
    height, width = samples.shape[2] * 8, samples.shape[3] * 8
    device = model.torch_device
    cond = model.guidance_conditioning(positive, width, height)
    uncond = model.guidance_conditioning(negative, width, height)
    previewer = make_previewer(getattr(ctx.workflow, "settings", None), model.latent_format, ctx.settings)

    def on_step(info: dict) -> None:
        ctx.report_progress(info["i"] + 1, info["total"])
        image = previewer(info["i"], info["total"], info["denoised"]) if previewer is not None else None
        if image is not None:
            ctx.report_preview(image)

    result = sample(model.denoiser(), model.process_in(samples.float().to(device)), cond, uncond, cfg,
                    sampler_name, scheduler, steps, seed, denoise=denoise, add_noise=add_noise,
                    start_step=start_step, end_step=end_step,
                    return_with_leftover_noise=return_with_leftover_noise, callback=on_step,
                    check_interrupt=ctx.check_interrupt, family=model.latent_format)
    return {**latent_image, "samples": model.process_out(result).cpu()}


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
