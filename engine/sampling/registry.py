"""The sampler registry: every accepted name (stable-diffusion.cpp's and ComfyUI's) to its function.

ComfyUI's `_gpu` SDE samplers are their own entries: the same steps with the Brownian tree of their step
noise on the latent's device (BROWNIAN_TREE_ON_CPU). Every sampler serves rectified-flow models (FLUX, SD3)
too, except those in flow.FLOW_REFUSED_SAMPLERS (tcd, dpm++2mv2), which raise a ValueError naming the
sampler and the reason when given a flow model.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import samplers as single
from . import samplers_dpm_solver as dpm_solver
from . import samplers_multistep as multi
from . import samplers_sa_solver as sa
from . import samplers_sde as sde
from . import samplers_unipc as unipc
from .noise import NoiseSampler, brownian_tree_noise_sampler, default_noise_sampler

Sampler = Callable[..., object]  # sample_x(model, x, sigmas, extra_args, callback, disable, **knobs)

# Canonical names follow stable-diffusion.cpp where it has the sampler, ComfyUI otherwise.
SAMPLERS: dict[str, Sampler] = {
    "euler": single.sample_euler,
    "euler_a": single.sample_euler_ancestral,
    "heun": single.sample_heun,
    "heunpp2": single.sample_heunpp2,
    "dpm2": single.sample_dpm_2,
    "dpm2_a": single.sample_dpm_2_ancestral,
    "dpm++2s_a": single.sample_dpmpp_2s_ancestral,
    "dpm++2m": multi.sample_dpmpp_2m,
    "dpm++2mv2": multi.sample_dpmpp_2m_v2,
    "ipndm": multi.sample_ipndm,
    "ipndm_v": multi.sample_ipndm_v,
    "lcm": single.sample_lcm,
    "ddim_trailing": single.sample_ddim,
    "tcd": single.sample_tcd,
    "res_multistep": multi.sample_res_multistep,
    "res_2s": single.sample_res_2s,
    "er_sde": sde.sample_er_sde,
    "euler_cfg_pp": single.sample_euler_cfg_pp,
    "euler_a_cfg_pp": single.sample_euler_ancestral_cfg_pp,
    "euler_ge": single.sample_gradient_estimation,
    "dpm++2m_sde": sde.sample_dpmpp_2m_sde,
    "dpm++2m_sde_bt": sde.sample_dpmpp_2m_sde,
    "dpm++2m_sde_heun": sde.sample_dpmpp_2m_sde_heun,
    "dpm++sde": sde.sample_dpmpp_sde,
    "dpm++3m_sde": sde.sample_dpmpp_3m_sde,
    "dpmpp_sde_gpu": sde.sample_dpmpp_sde_gpu,
    "dpmpp_2m_sde_gpu": sde.sample_dpmpp_2m_sde_gpu,
    "dpmpp_2m_sde_heun_gpu": sde.sample_dpmpp_2m_sde_heun_gpu,
    "dpmpp_3m_sde_gpu": sde.sample_dpmpp_3m_sde_gpu,
    "lms": multi.sample_lms,
    "ddpm": single.sample_ddpm,
    "deis": multi.sample_deis,
    "uni_pc": unipc.sample_uni_pc,
    "uni_pc_bh2": unipc.sample_uni_pc_bh2,
    "res_multistep_ancestral": multi.sample_res_multistep_ancestral,
    "dpm_fast": dpm_solver.sample_dpm_fast,
    "dpm_adaptive": dpm_solver.sample_dpm_adaptive,
    "ddim": single.sample_euler,
    "dpmpp_2s_ancestral_cfg_pp": single.sample_dpmpp_2s_ancestral_cfg_pp,
    "dpmpp_2m_cfg_pp": multi.sample_dpmpp_2m_cfg_pp,
    "res_multistep_cfg_pp": multi.sample_res_multistep_cfg_pp,
    "res_multistep_ancestral_cfg_pp": multi.sample_res_multistep_ancestral_cfg_pp,
    "gradient_estimation_cfg_pp": single.sample_gradient_estimation_cfg_pp,
    "seeds_2": sde.sample_seeds_2,
    "seeds_3": sde.sample_seeds_3,
    "exp_heun_2_x0": sde.sample_exp_heun_2_x0,
    "exp_heun_2_x0_sde": sde.sample_exp_heun_2_x0_sde,
    "sa_solver": sa.sample_sa_solver,
    "sa_solver_pece": sa.sample_sa_solver_pece,
}

# ComfyUI spellings (its KSampler's sampler_name values) for the same functions.
SAMPLER_ALIASES: dict[str, str] = {
    "euler_ancestral": "euler_a",
    "dpm_2": "dpm2",
    "dpm_2_ancestral": "dpm2_a",
    "dpm_2_a": "dpm2_a",
    "dpmpp_2s_ancestral": "dpm++2s_a",
    "dpmpp_2m": "dpm++2m",
    "dpmpp_2m_v2": "dpm++2mv2",
    "dpmpp_sde": "dpm++sde",
    "dpmpp_2m_sde": "dpm++2m_sde",
    "dpmpp_2m_sde_heun": "dpm++2m_sde_heun",
    "dpmpp_3m_sde": "dpm++3m_sde",
    "euler_ancestral_cfg_pp": "euler_a_cfg_pp",
    "gradient_estimation": "euler_ge",
}


# ComfyUI's "ddim" is its euler sampler with inpainting noise drawn afresh (RANDOM_INPAINT_NOISE); sd.cpp's
# ddim_trailing is DDIM itself (the same steps at eta 0, with its own eta).

# The samplers ComfyUI's KSampler gives steps + 1 sigmas less the second-to-last one (its
# DISCARD_PENULTIMATE_SIGMA_SAMPLERS: dpm_2, dpm_2_ancestral, uni_pc, uni_pc_bh2), by canonical name; their
# aliases follow. Only the KSampler path applies it (sample.ksampler_sigmas), not BasicScheduler.
DISCARD_PENULTIMATE_SIGMA: frozenset[str] = frozenset({"dpm2", "dpm2_a", "uni_pc", "uni_pc_bh2"})

# The samplers whose step noise is ComfyUI's Brownian tree, by function: True keeps the tree on the CPU
# (dpmpp_sde, dpmpp_2m_sde(_heun), dpmpp_3m_sde), False on the latent's device (their _gpu names). Every
# other sampler with a noise_sampler gets the seeded Gaussian default_noise_sampler.
BROWNIAN_TREE_ON_CPU: dict[Sampler, bool] = {
    sde.sample_dpmpp_sde: True,
    sde.sample_dpmpp_2m_sde: True,
    sde.sample_dpmpp_2m_sde_heun: True,
    sde.sample_dpmpp_3m_sde: True,
    sde.sample_dpmpp_sde_gpu: False,
    sde.sample_dpmpp_2m_sde_gpu: False,
    sde.sample_dpmpp_2m_sde_heun_gpu: False,
    sde.sample_dpmpp_3m_sde_gpu: False,
}


# The samplers whose noise-mask blend uses fresh noise, a CPU draw seeded with seed + 1 (ComfyUI's
# inpaint_options "random"), instead of the job's initial noise.
RANDOM_INPAINT_NOISE: frozenset[str] = frozenset({"ddim"})

# The samplers that end a schedule ending at sigma 0 at another sigma, which the KSampler un-scales the result
# at (ComfyUI's UniPC changes the last sigma of its schedule to 0.001 in place).
FINAL_SIGMA: dict[Sampler, float] = {unipc.sample_uni_pc: unipc.UNIPC_FINAL_SIGMA,
                                     unipc.sample_uni_pc_bh2: unipc.UNIPC_FINAL_SIGMA}


def canonical_sampler_name(name: str) -> str:
    """The registry key for `name` (case-insensitive; sd.cpp and ComfyUI spellings)."""
    key = name.strip().lower()
    key = SAMPLER_ALIASES.get(key, key)
    if key not in SAMPLERS:
        accepted = ", ".join(list(SAMPLERS) + list(SAMPLER_ALIASES))
        raise ValueError(f"unknown sampler '{name}'; accepted: {accepted}")
    return key


def resolve_sampler(name: str) -> Sampler:
    """The sampler function for `name` (case-insensitive; sd.cpp and ComfyUI spellings)."""
    return SAMPLERS[canonical_sampler_name(name)]


def discards_penultimate_sigma(name: str) -> bool:
    """Whether ComfyUI's KSampler drops the second-to-last of steps + 1 sigmas for sampler `name`."""
    return canonical_sampler_name(name) in DISCARD_PENULTIMATE_SIGMA


def uses_random_inpaint_noise(name: str) -> bool:
    """Whether sampler `name` blends its noise mask with fresh noise (ComfyUI's ddim)."""
    return canonical_sampler_name(name) in RANDOM_INPAINT_NOISE


def final_sigma(sampler: Sampler, sigmas: torch.Tensor) -> torch.Tensor:
    """The sigma a run of `sampler` over `sigmas` ends at: sigmas[-1], or the sampler's own end for 0."""
    if sampler in FINAL_SIGMA and float(sigmas[-1]) == 0:
        return torch.full_like(sigmas[-1], FINAL_SIGMA[sampler])
    return sigmas[-1]


def step_noise_sampler(sampler: Sampler, x: torch.Tensor, sigmas: torch.Tensor, seed: int | None,
                       flow: bool = False) -> NoiseSampler:
    """The seeded step noise ComfyUI gives `sampler` sampling x over `sigmas`: its Brownian tree for the
    DPM++ SDE samplers, default_noise_sampler (the latent's device generator) for every other one.

    `flow`: the model is a rectified-flow one, which the SDE samplers step in VE coordinates (flow.py); the
    tree is ComfyUI's, over the flow sigmas, and is asked at the flow sigma of each VE one.
    """
    if sampler not in BROWNIAN_TREE_ON_CPU:
        return default_noise_sampler(x, seed)
    tree = brownian_tree_noise_sampler(x, sigmas, seed, cpu=BROWNIAN_TREE_ON_CPU[sampler])
    if not flow:
        return tree

    def at_flow_sigmas(sigma_ve: torch.Tensor, sigma_ve_next: torch.Tensor) -> torch.Tensor:
        sigma, sigma_next = (s / (1 + s) for s in (sigma_ve, sigma_ve_next))
        return tree(sigma.to(sigmas.dtype), sigma_next.to(sigmas.dtype)).to(x.dtype)

    return at_flow_sigmas


@dataclass(frozen=True)
class SamplerChoice:
    """A SAMPLER link value (ComfyUI's KSAMPLER object): one registered sampler, checked when chosen."""

    name: str  # any name resolve_sampler accepts

    def __post_init__(self) -> None:
        resolve_sampler(self.name)

    @property
    def function(self) -> Sampler:
        return resolve_sampler(self.name)
