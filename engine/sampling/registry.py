"""The sampler registry: every accepted name (stable-diffusion.cpp's and ComfyUI's) to its function.

Every sampler serves rectified-flow models (FLUX, SD3) too, except those in flow.FLOW_REFUSED_SAMPLERS
(tcd, dpm++2mv2), which raise a ValueError naming the sampler and the reason when given a flow model.
"""

from collections.abc import Callable
from dataclasses import dataclass

from . import samplers as single
from . import samplers_dpm_solver as dpm_solver
from . import samplers_multistep as multi
from . import samplers_sde as sde

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
    "lms": multi.sample_lms,
    "ddpm": single.sample_ddpm,
    "deis": multi.sample_deis,
    "uni_pc": multi.sample_uni_pc,
    "uni_pc_bh2": multi.sample_uni_pc_bh2,
    "res_multistep_ancestral": multi.sample_res_multistep_ancestral,
    "dpm_fast": dpm_solver.sample_dpm_fast,
    "dpm_adaptive": dpm_solver.sample_dpm_adaptive,
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
    "dpmpp_sde_gpu": "dpm++sde",
    "dpmpp_2m_sde": "dpm++2m_sde",
    "dpmpp_2m_sde_gpu": "dpm++2m_sde",
    "dpmpp_2m_sde_heun": "dpm++2m_sde_heun",
    "dpmpp_2m_sde_heun_gpu": "dpm++2m_sde_heun",
    "dpmpp_3m_sde": "dpm++3m_sde",
    "dpmpp_3m_sde_gpu": "dpm++3m_sde",
    "ddim": "ddim_trailing",
    "euler_ancestral_cfg_pp": "euler_a_cfg_pp",
    "gradient_estimation": "euler_ge",
}


def resolve_sampler(name: str) -> Sampler:
    """The sampler function for `name` (case-insensitive; sd.cpp and ComfyUI spellings)."""
    key = name.strip().lower()
    key = SAMPLER_ALIASES.get(key, key)
    if key not in SAMPLERS:
        accepted = ", ".join(list(SAMPLERS) + list(SAMPLER_ALIASES))
        raise ValueError(f"unknown sampler '{name}'; accepted: {accepted}")
    return SAMPLERS[key]


@dataclass(frozen=True)
class SamplerChoice:
    """A SAMPLER link value (ComfyUI's KSAMPLER object): one registered sampler, checked when chosen."""

    name: str  # any name resolve_sampler accepts

    def __post_init__(self) -> None:
        resolve_sampler(self.name)

    @property
    def function(self) -> Sampler:
        return resolve_sampler(self.name)
