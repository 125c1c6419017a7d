"""ComfyUI's custom-sampling nodes, with its names, input order and widget ranges: the KSampler taken apart.

A sampling job is assembled from four links: NOISE (RandomNoise, DisableNoise), GUIDER (CFGGuider,
BasicGuider: the model and its conditioning), SAMPLER (KSamplerSelect) and SIGMAS (BasicScheduler and the
other schedulers, split and flipped by the sigma nodes); SamplerCustomAdvanced runs them on a latent.
SamplerCustom takes the model, noise seed and conditioning directly. Both return the sampled latent and the
last step's denoised x0 ("denoised_output"). The sampling itself is engine/sampling/sample.py's
`sample_sigmas`, the second half of the KSampler, so the same seed and settings give the KSampler's latent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.graph.spec import (
    NodeType,
    Output,
    RunContext,
    bool_input,
    float_input,
    int_input,
    link_input,
    seed_input,
)
from engine.models.bundles import DiffusionModel, require
from engine.sampling import schedulers
from engine.sampling.guidance import CFGDenoiser, Conditioning
from engine.sampling.noise import EmptyNoise, SeededNoise, prepare_noise
from engine.sampling.registry import SamplerChoice, uses_random_inpaint_noise
from engine.sampling.sample import ksampler_sigmas, sample_sigmas
from nodes.sampling import (
    MAX_STEPS,
    inpaint_channels,
    latent_output,
    model_samples,
    model_space,
    noise_mask_of,
    sampler_input,
    scheduler_input,
    step_reporter,
    with_inpaint_channels,
)

SIGMA_LIMIT = 5000.0
SD_SIGMA_MAX = 14.614642  # ComfyUI's defaults for the explicit schedulers: SD1's sigma range
SD_SIGMA_MIN = 0.0291675
TURBO_TIMESTEPS = 10  # SDTurboScheduler picks from timesteps 999, 899, ..., 99


@dataclass(frozen=True)
class Guider:
    """A GUIDER link value (ComfyUI's CFGGuider): the model, its CONDITIONING, and the cfg scale.

    `negative` None is BasicGuider: one conditioning, cfg 1, no unconditional pass.
    """

    model: DiffusionModel
    positive: list
    negative: list | None
    cfg: float

    def denoiser(self, width: int, height: int,
                 check_interrupt: Callable[[], None] | None = None) -> CFGDenoiser:
        """The guided denoiser (x, sigma) -> x0 for a width x height pixel image."""
        cond = self.model.guidance_conditioning(self.positive, width, height)
        uncond = (None if self.negative is None
                  else self.model.guidance_conditioning(self.negative, width, height))
        return CFGDenoiser(self.model.denoiser(), cond, uncond, self.cfg, check_interrupt=check_interrupt)


class InpaintingModel:
    """A MODEL seen by a guider for one job on an inpainting UNet: its guidance_conditioning gives every
    entry the UNet's extra channels for the job's latent and noise mask (nodes/sampling.py); everything else
    is the model's."""

    def __init__(self, model: DiffusionModel, latent: torch.Tensor, noise_mask: torch.Tensor | None):
        self.model, self.latent, self.noise_mask = model, latent, noise_mask

    def guidance_conditioning(self, conditioning: list, width: int, height: int) -> list[Conditioning]:
        entries = self.model.guidance_conditioning(conditioning, width, height)
        return with_inpaint_channels(self.model, conditioning, entries, self.latent, self.noise_mask)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def require_link(value: Any, kind: str, expected: type | tuple[type, ...], made_by: str) -> Any:
    """`value` when it is an `expected`; a clear error naming the nodes that make a `kind` otherwise."""
    if isinstance(value, expected):
        return value
    raise ValueError(f"expected a {kind} input (from {made_by}), got {type(value).__name__}")


def require_sigmas(sigmas: Any) -> torch.Tensor:
    """A SIGMAS link value: a 1-D tensor of noise levels."""
    if not isinstance(sigmas, torch.Tensor) or sigmas.ndim != 1:
        shown = tuple(sigmas.shape) if isinstance(sigmas, torch.Tensor) else type(sigmas).__name__
        raise ValueError(f"expected SIGMAS (a 1-D tensor of noise levels, from BasicScheduler or another "
                         f"scheduler node), got {shown}")
    return sigmas


def run_custom_sampler(ctx: RunContext, noise: Any, guider: Any, sampler: Any, sigmas: Any,
                       latent_image: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """SamplerCustomAdvanced: (output, denoised_output) LATENTs; denoised_output is the last step's x0, or the
    output when no step reported one (ComfyUI's semantics)."""
    noise = require_link(noise, "NOISE", (SeededNoise, EmptyNoise), "RandomNoise or DisableNoise")
    guider = require_link(guider, "GUIDER", Guider, "CFGGuider or BasicGuider")
    sampler = require_link(sampler, "SAMPLER", SamplerChoice, "KSamplerSelect")
    sigmas = require_sigmas(sigmas)
    model = guider.model
    samples = model_samples(model, latent_image)
    if len(sigmas) == 0:  # nothing to do: ComfyUI hands the latent back
        out = {**latent_image, "samples": samples}
        return out, out
    latent, noise_mask = model_space(model, samples), noise_mask_of(latent_image)
    if inpaint_channels(model):
        guider = dataclasses.replace(guider, model=InpaintingModel(model, latent, noise_mask))
    guided = guider.denoiser(samples.shape[3] * 8, samples.shape[2] * 8, ctx.check_interrupt)
    report = step_reporter(ctx, model)
    last: dict[str, torch.Tensor] = {}

    def on_step(info: dict) -> None:
        last["denoised"] = info["denoised"]
        report(info)

    noise_values = noise.generate(samples, latent_image.get("batch_index"))
    inpaint_noise = None
    if noise_mask is not None and uses_random_inpaint_noise(sampler.name):
        inpaint_noise = prepare_noise(samples, noise.seed + 1)
    result = sample_sigmas(guided, latent, noise_values, sigmas.float(), sampler.function, noise.seed,
                           callback=on_step, denoise_mask=noise_mask, inpaint_noise=inpaint_noise)
    out = latent_output(model, latent_image, result)
    denoised = latent_output(model, latent_image, last["denoised"]) if last else out
    return out, denoised


class RandomNoise(NodeType):
    category = "sampling/noise"
    description = "Seeded Gaussian noise for SamplerCustomAdvanced (the KSampler's noise for the same seed)."
    inputs = (seed_input("noise_seed", 0),)
    outputs = (Output("NOISE", "NOISE"),)

    def run(self, ctx: RunContext, noise_seed: int) -> tuple:
        return (SeededNoise(noise_seed),)


class DisableNoise(NodeType):
    category = "sampling/noise"
    description = "No initial noise: sampling starts from the latent as it is."
    outputs = (Output("NOISE", "NOISE"),)

    def run(self, ctx: RunContext) -> tuple:
        return (EmptyNoise(),)


class KSamplerSelect(NodeType):
    category = "sampling/samplers"
    description = "Picks a sampler by name, any the KSampler accepts."
    inputs = (sampler_input(),)
    outputs = (Output("SAMPLER", "SAMPLER"),)

    def run(self, ctx: RunContext, sampler_name: str) -> tuple:
        return (SamplerChoice(sampler_name),)


class BasicScheduler(NodeType):
    category = "sampling/schedulers"
    description = ("The model's sigmas for `steps` steps of a named scheduler; denoise < 1 keeps the last "
                   "steps of int(steps / denoise), as the KSampler does.")
    inputs = (link_input("model", "MODEL"),
              scheduler_input(),
              int_input("steps", 20, min=1, max=MAX_STEPS),
              float_input("denoise", 1.0, min=0.0, max=1.0, step=0.01))
    outputs = (Output("SIGMAS", "SIGMAS"),)

    def run(self, ctx: RunContext, model: Any, scheduler: str, steps: int, denoise: float) -> tuple:
        model = require(model, "MODEL", DiffusionModel)
        return (ksampler_sigmas(model.model_sampling, scheduler, steps, denoise, family=model.latent_format),)


def sigma_range_inputs() -> tuple:
    return (int_input("steps", 20, min=1, max=MAX_STEPS),
            float_input("sigma_max", SD_SIGMA_MAX, min=0.0, max=SIGMA_LIMIT, step=0.01),
            float_input("sigma_min", SD_SIGMA_MIN, min=0.0, max=SIGMA_LIMIT, step=0.01))


class KarrasScheduler(NodeType):
    category = "sampling/schedulers"
    description = "Karras et al. (2022) sigmas from sigma_max to sigma_min, uniform in sigma^(1/rho)."
    inputs = (*sigma_range_inputs(), float_input("rho", 7.0, min=0.0, max=100.0, step=0.01))
    outputs = (Output("SIGMAS", "SIGMAS"),)

    def run(self, ctx: RunContext, steps: int, sigma_max: float, sigma_min: float, rho: float) -> tuple:
        if rho <= 0:
            raise ValueError(f"rho must be > 0; got {rho}")
        return (schedulers.karras_sigmas(steps, sigma_min, sigma_max, rho),)


class ExponentialScheduler(NodeType):
    category = "sampling/schedulers"
    description = "Sigmas from sigma_max to sigma_min, uniform in log sigma."
    inputs = sigma_range_inputs()
    outputs = (Output("SIGMAS", "SIGMAS"),)

    def run(self, ctx: RunContext, steps: int, sigma_max: float, sigma_min: float) -> tuple:
        if sigma_min <= 0 or sigma_max <= 0:
            raise ValueError(f"the exponential schedule needs sigma_min and sigma_max > 0; got {sigma_min} "
                             f"and {sigma_max}")
        return (schedulers.exponential_sigmas(steps, sigma_min, sigma_max),)


class BetaSamplingScheduler(NodeType):
    category = "sampling/schedulers"
    description = "The model's timesteps at Beta(alpha, beta) quantiles (Lee et al. 2024)."
    inputs = (link_input("model", "MODEL"),
              int_input("steps", 20, min=1, max=MAX_STEPS),
              float_input("alpha", 0.6, min=0.0, max=50.0, step=0.01),
              float_input("beta", 0.6, min=0.0, max=50.0, step=0.01))
    outputs = (Output("SIGMAS", "SIGMAS"),)

    def run(self, ctx: RunContext, model: Any, steps: int, alpha: float, beta: float) -> tuple:
        if alpha <= 0 or beta <= 0:
            raise ValueError(f"the Beta distribution needs alpha and beta > 0; got {alpha} and {beta}")
        model = require(model, "MODEL", DiffusionModel)
        return (schedulers.beta(model.model_sampling, steps, alpha, beta),)


class SDTurboScheduler(NodeType):
    category = "sampling/schedulers"
    description = ("SD-Turbo's sigmas: the model's sigmas at timesteps 999, 899, ..., 99, starting "
                   "10 - int(10 x denoise) steps in, `steps` of them (fewer when they run out), then 0.")
    inputs = (link_input("model", "MODEL"),
              int_input("steps", 1, min=1, max=TURBO_TIMESTEPS),
              float_input("denoise", 1.0, min=0.0, max=1.0, step=0.01))
    outputs = (Output("SIGMAS", "SIGMAS"),)

    def run(self, ctx: RunContext, model: Any, steps: int, denoise: float) -> tuple:
        model = require(model, "MODEL", DiffusionModel)
        start = TURBO_TIMESTEPS - int(TURBO_TIMESTEPS * denoise)
        timesteps = (torch.arange(TURBO_TIMESTEPS, 0, -1) * 100 - 1)[start:start + steps]  # 999, 899, ...
        sigmas = model.model_sampling.t_to_sigma(timesteps.float())
        return (torch.cat([sigmas, sigmas.new_zeros(1)]),)


class SplitSigmas(NodeType):
    category = "sampling/sigmas"
    description = "Splits the sigmas at `step`: high_sigmas are steps 0..step, low_sigmas step..end (shared)."
    inputs = (link_input("sigmas", "SIGMAS"), int_input("step", 0, min=0, max=MAX_STEPS))
    outputs = (Output("high_sigmas", "SIGMAS"), Output("low_sigmas", "SIGMAS"))

    def run(self, ctx: RunContext, sigmas: Any, step: int) -> tuple:
        sigmas = require_sigmas(sigmas)
        return sigmas[:step + 1], sigmas[step:]


class SplitSigmasDenoise(NodeType):
    category = "sampling/sigmas"
    description = "Splits the sigmas so that low_sigmas holds the last `denoise` fraction of the steps."
    inputs = (link_input("sigmas", "SIGMAS"), float_input("denoise", 1.0, min=0.0, max=1.0, step=0.01))
    outputs = (Output("high_sigmas", "SIGMAS"), Output("low_sigmas", "SIGMAS"))

    def run(self, ctx: RunContext, sigmas: Any, denoise: float) -> tuple:
        sigmas = require_sigmas(sigmas)
        low_steps = round(max(len(sigmas) - 1, 0) * denoise)
        return sigmas[:-low_steps] if low_steps else sigmas[:0], sigmas[-(low_steps + 1):]


class FlipSigmas(NodeType):
    category = "sampling/sigmas"
    description = "The sigmas in reverse order (for unsampling); a leading 0 becomes 0.0001."
    inputs = (link_input("sigmas", "SIGMAS"),)
    outputs = (Output("SIGMAS", "SIGMAS"),)

    def run(self, ctx: RunContext, sigmas: Any) -> tuple:
        flipped = require_sigmas(sigmas).flip(0)
        if len(flipped) and flipped[0] == 0:
            flipped[0] = 0.0001
        return (flipped,)


class CFGGuider(NodeType):
    display_name = "CFG Guider"
    category = "sampling/guiders"
    description = "Classifier-free guidance: the model between the positive and negative conditioning."
    inputs = (link_input("model", "MODEL"),
              link_input("positive", "CONDITIONING"),
              link_input("negative", "CONDITIONING"),
              float_input("cfg", 8.0, min=0.0, max=100.0, step=0.1))
    outputs = (Output("GUIDER", "GUIDER"),)

    def run(self, ctx: RunContext, model: Any, positive: Any, negative: Any, cfg: float) -> tuple:
        return (Guider(require(model, "MODEL", DiffusionModel), positive, negative, cfg),)


class BasicGuider(NodeType):
    display_name = "Basic Guider"
    category = "sampling/guiders"
    description = "The model on one conditioning, no guidance (cfg 1): for FLUX and other distilled models."
    inputs = (link_input("model", "MODEL"), link_input("conditioning", "CONDITIONING"))
    outputs = (Output("GUIDER", "GUIDER"),)

    def run(self, ctx: RunContext, model: Any, conditioning: Any) -> tuple:
        return (Guider(require(model, "MODEL", DiffusionModel), conditioning, None, 1.0),)


class SamplerCustomAdvanced(NodeType):
    category = "sampling/custom_sampling"
    description = ("Samples the latent with the given noise, guider, sampler and sigmas; denoised_output is "
                   "the last step's prediction of the clean latent.")
    inputs = (link_input("noise", "NOISE"),
              link_input("guider", "GUIDER"),
              link_input("sampler", "SAMPLER"),
              link_input("sigmas", "SIGMAS"),
              link_input("latent_image", "LATENT"))
    outputs = (Output("output", "LATENT"), Output("denoised_output", "LATENT"))

    def run(self, ctx: RunContext, noise: Any, guider: Any, sampler: Any, sigmas: Any,
            latent_image: Any) -> tuple:
        return run_custom_sampler(ctx, noise, guider, sampler, sigmas, latent_image)


class SamplerCustom(NodeType):
    category = "sampling/custom_sampling"
    description = ("Samples the latent with classifier-free guidance over the given sampler and sigmas; "
                   "denoised_output is the last step's prediction of the clean latent.")
    inputs = (link_input("model", "MODEL"),
              bool_input("add_noise", True),
              seed_input("noise_seed", 0),
              float_input("cfg", 8.0, min=0.0, max=100.0, step=0.1),
              link_input("positive", "CONDITIONING"),
              link_input("negative", "CONDITIONING"),
              link_input("sampler", "SAMPLER"),
              link_input("sigmas", "SIGMAS"),
              link_input("latent_image", "LATENT"))
    outputs = (Output("output", "LATENT"), Output("denoised_output", "LATENT"))

    def run(self, ctx: RunContext, model: Any, add_noise: bool, noise_seed: int, cfg: float, positive: Any,
            negative: Any, sampler: Any, sigmas: Any, latent_image: Any) -> tuple:
        noise = SeededNoise(noise_seed) if add_noise else EmptyNoise(noise_seed)
        guider = Guider(require(model, "MODEL", DiffusionModel), positive, negative, cfg)
        return run_custom_sampler(ctx, noise, guider, sampler, sigmas, latent_image)


NODE_TYPES = (SamplerCustom, SamplerCustomAdvanced, RandomNoise, DisableNoise, KSamplerSelect, BasicScheduler,
              KarrasScheduler, ExponentialScheduler, BetaSamplingScheduler, SDTurboScheduler, SplitSigmas,
              SplitSigmasDenoise, FlipSigmas, CFGGuider, BasicGuider)
