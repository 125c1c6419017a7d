"""Sampler nodes with ComfyUI's names and input order: KSampler and KSamplerAdvanced.

Both are thin wrappers over engine/sampling/sample.py: the latent is scaled into the model's space, sampled
with classifier-free guidance, and scaled back to the raw LATENT space. Progress is reported every step, and
a preview as the workflow's settings["preview"] asks (engine/previews.py: TAESD or latent-to-RGB). The
helpers for those parts are shared with the custom-sampling nodes (nodes/custom_sampling.py).

Inpainting as ComfyUI: the LATENT's "noise_mask" keeps the latent where it is 0 (engine/sampling/inpaint.py),
and an inpainting UNet (9 input channels) gets the mask and the masked image's latent as extra channels, from
InpaintModelConditioning's conditioning or else from the noise mask and the latent itself.

Sampler and scheduler lists show each one once: ComfyUI's names in ComfyUI's order, then Sluice's own
(stable-diffusion.cpp's) that ComfyUI lacks. Every other spelling the engine knows (sd.cpp's `dpm++2m`,
`euler_a`, `discrete`, ...) is still accepted in files and on the command line, just not listed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine.graph.spec import (
    COMBO,
    Input,
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
from engine.models.unet import UNetModel
from engine.previews import make_previewer
from engine.sampling.guidance import Conditioning
from engine.sampling.inpaint import INPAINT_CONCAT_CHANNELS, inpaint_concat, latent_noise_mask
from engine.sampling.registry import SAMPLER_ALIASES, SAMPLERS, canonical_sampler_name
from engine.sampling.sample import sample
from engine.sampling.schedulers import SCHEDULERS
from nodes.latent import latent_samples

# ComfyUI's KSampler lists (comfy/samplers.py), in its order; the names Sluice lacks are left out of ours.
COMFY_SAMPLERS = (
    "euler", "euler_cfg_pp", "euler_ancestral", "euler_ancestral_cfg_pp", "heun", "heunpp2", "dpm_2",
    "dpm_2_ancestral", "lms", "dpm_fast", "dpm_adaptive", "dpmpp_2s_ancestral", "dpmpp_2s_ancestral_cfg_pp",
    "dpmpp_sde", "dpmpp_sde_gpu", "dpmpp_2m", "dpmpp_2m_cfg_pp", "dpmpp_2m_sde", "dpmpp_2m_sde_gpu",
    "dpmpp_2m_sde_heun", "dpmpp_2m_sde_heun_gpu", "dpmpp_3m_sde", "dpmpp_3m_sde_gpu", "ddpm", "lcm", "ipndm",
    "ipndm_v", "deis", "res_multistep", "res_multistep_cfg_pp", "res_multistep_ancestral",
    "res_multistep_ancestral_cfg_pp", "gradient_estimation", "gradient_estimation_cfg_pp", "er_sde",
    "seeds_2", "seeds_3", "sa_solver", "sa_solver_pece", "ddim", "uni_pc", "uni_pc_bh2", "exp_heun_2_x0",
    "exp_heun_2_x0_sde")
COMFY_SCHEDULERS = ("normal", "karras", "exponential", "sgm_uniform", "simple", "ddim_uniform", "beta",
                    "linear_quadratic", "kl_optimal")


def listed_names(functions: Mapping[str, Callable], resolve: Callable[[str], str], comfy_names: Iterable[str],
                 aliases: Mapping[str, str]) -> tuple[str, ...]:
    """ComfyUI's names that Sluice has, in ComfyUI's order (all of them, as ComfyUI lists them, also where two
    run one function: its ddim is its euler), then one name for each other function of `functions` (name ->
    function), under a ComfyUI-style alias where there is one, else its own. `resolve` maps any accepted
    spelling to a key of `functions` (ValueError for an unknown one)."""
    listed: list[str] = []
    seen: set[Callable] = set()
    for name in comfy_names:
        try:
            function = functions[resolve(name)]
        except (ValueError, KeyError):
            continue  # a ComfyUI sampler Sluice does not have
        seen.add(function)
        listed.append(name)
    for name, function in functions.items():
        if function not in seen:
            seen.add(function)
            listed.append(next((alias for alias, target in aliases.items() if target == name), name))
    return tuple(listed)


SAMPLER_NAMES = listed_names(SAMPLERS, canonical_sampler_name, COMFY_SAMPLERS, SAMPLER_ALIASES)
SCHEDULER_NAMES = listed_names(SCHEDULERS, str, COMFY_SCHEDULERS, {})
ACCEPTED_SAMPLER_NAMES = tuple(SAMPLERS) + tuple(SAMPLER_ALIASES)
MAX_STEPS = 10000


@dataclass(frozen=True)
class AliasedChoiceInput(Input):
    """A COMBO that lists each choice once and also accepts the other spellings in `aliases`."""

    aliases: tuple[str, ...] = ()  # accepted in files and on the command line, not listed

    def check_value(self, value: Any) -> str | None:
        if isinstance(value, str) and value in self.aliases:
            return None
        return super().check_value(value)


def _aliased_combo(name: str, listed: tuple[str, ...], accepted: Iterable[str], default: str) -> Input:
    return AliasedChoiceInput(name, COMBO, default, choices=listed,
                              aliases=tuple(n for n in accepted if n not in listed))


def sampler_input(name: str = "sampler_name") -> Input:
    return _aliased_combo(name, SAMPLER_NAMES, ACCEPTED_SAMPLER_NAMES, "euler")


def scheduler_input(name: str = "scheduler") -> Input:
    return _aliased_combo(name, SCHEDULER_NAMES, SCHEDULERS, "normal")


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


def noise_mask_of(latent_image: Any) -> torch.Tensor | None:
    """The LATENT's noise mask (B, 1, H, W) at any size, or None."""
    mask = latent_image.get("noise_mask")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise ValueError(f"the LATENT's noise_mask must be a tensor; got {type(mask).__name__}")
    return mask


def inpaint_channels(model: DiffusionModel) -> bool:
    """Whether the model is an inpainting UNet (4 + 5 input channels), which takes extra channels; a UNet of
    another extra channel count is an error."""
    if not isinstance(model.unet, UNetModel):
        return False
    extra = model.unet.config.in_channels - model.latent_channels
    if extra not in (0, INPAINT_CONCAT_CHANNELS):
        raise ValueError(f"this {model.family} UNet takes {model.unet.config.in_channels} input channels; "
                         f"accepted: {model.latent_channels} (a plain model) or "
                         f"{model.latent_channels + INPAINT_CONCAT_CHANNELS} (an inpainting model)")
    return extra == INPAINT_CONCAT_CHANNELS


def with_inpaint_channels(model: DiffusionModel, conditioning: Any, entries: list[Conditioning],
                          latent: torch.Tensor, noise_mask: torch.Tensor | None) -> list[Conditioning]:
    """The sampler `entries` of a CONDITIONING (one per [context, options] pair) with the extra input channels
    of an inpainting UNet (ComfyUI's concat_cond, per entry): the entry's concat_mask and concat_latent_image
    (InpaintModelConditioning) where it has them, else the noise mask and the model-space `latent` being
    sampled. Other models: `entries` as they are."""
    if not inpaint_channels(model):
        return entries
    mask = None if noise_mask is None else latent_noise_mask(noise_mask, latent.shape).to(latent.device)
    out = []
    for entry, (_, options) in zip(entries, conditioning, strict=True):
        concat_latent, concat_mask = options.get("concat_latent_image"), options.get("concat_mask")
        if concat_latent is not None:
            concat_latent = model.process_in(concat_latent.to(latent.device, latent.dtype))
        if concat_mask is not None:
            concat_mask = concat_mask.to(latent.device)
        concat = inpaint_concat(latent.shape, latent, mask, concat_latent, concat_mask)
        out.append(dataclasses.replace(entry, concat=concat))
    return out


def step_reporter(ctx: RunContext, model: DiffusionModel) -> Callable[[dict], None]:
    """The per-step callback of a sampler node: progress every step, a preview as the settings ask."""
    previewer = make_previewer(getattr(ctx.workflow, "settings", None), model.latent_format, ctx.settings,
                               model.source)

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
    latent, noise_mask = model_space(model, samples), noise_mask_of(latent_image)
    height, width = samples.shape[2] * 8, samples.shape[3] * 8
    cond, uncond = (with_inpaint_channels(model, c, model.guidance_conditioning(c, width, height, seed),
                                          latent, noise_mask) for c in (positive, negative))
    with model.holding_sampler_state(samples, positive, negative):
        result = sample(model.denoiser(), latent, cond, uncond, cfg, sampler_name, scheduler, steps, seed,
                        denoise=denoise, add_noise=add_noise, start_step=start_step, end_step=end_step,
                        return_with_leftover_noise=return_with_leftover_noise,
                        callback=step_reporter(ctx, model), check_interrupt=ctx.check_interrupt,
                        family=model.latent_format, denoise_mask=noise_mask,
                        batch_index=latent_image.get("batch_index"))
    return latent_output(model, latent_image, result)


class KSampler(NodeType):
    display_name = "KSampler"
    category = "sampling"
    description = "Denoises the latent with the model, guided by the positive and negative conditioning."
    inputs = (link_input("model", "MODEL"),
              seed_input("seed", 0),
              int_input("steps", 20, min=1, max=MAX_STEPS),
              float_input("cfg", 8.0, min=0.0, max=100.0, step=0.1),
              sampler_input(),
              scheduler_input(),
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
              sampler_input(),
              scheduler_input(),
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
