"""How the samplers serve rectified-flow models (FLUX, SD3: model_sampling.RectifiedFlow), as ComfyUI does.

A flow sample at sigma is x = (1 - sigma) x0 + sigma noise, so the data scale is alpha = 1 - sigma, and
the same sample in k-diffusion (VE) coordinates is x / alpha at sigma_ve = sigma / alpha. The
deterministic ODE dx/dsigma = (x - x0) / sigma has the same form in both, so every ODE sampler runs on flow
sigmas unchanged. What depends on alpha is noise: the samplers serve flow models in one of four ways.

- Unchanged (ComfyUI's versions do the same on CONST models): euler (and ComfyUI's ddim, which is euler),
  heun, heunpp2, dpm2, dpm++2m, ipndm, ipndm_v, lms, deis, uni_pc, uni_pc_bh2 (ComfyUI's UniPC takes flow
  sigmas for VE ones), res_multistep, res_2s (eta 0), euler_ge, dpm_adaptive, dpm_fast (eta 0), lcm (it
  renoises with the model's own noise_scaling), and the CFG++ samplers dpmpp_2m_cfg_pp,
  res_multistep_cfg_pp and gradient_estimation_cfg_pp.
- The rectified-flow ancestral step (ComfyUI's sample_euler_ancestral_RF and siblings): euler_a, dpm2_a,
  dpm++2s_a, dpmpp_2s_ancestral_cfg_pp, and res_multistep_ancestral(_cfg_pp) / res_2s with eta > 0 (where
  ComfyUI's res_multistep samplers add VE noise to flow samples). Step deterministically to
  sigma_down = sigma_next (1 + (sigma_next / sigma - 1) eta), then x = (alpha_next / alpha_down) x +
  noise * sqrt(sigma_next^2 - sigma_down^2 alpha_next^2 / alpha_down^2). dpm++2s_a and its CFG++ version
  take their midpoint in half-log-SNR log(alpha / sigma) there; the CFG++ one adds its guidance times
  alpha_next.
- In VE coordinates (`run_in_ve_coordinates`), which is exactly ComfyUI's half-log-SNR form of these
  samplers on CONST models: dpm++sde, dpm++2m_sde (and _heun, _bt), dpm++3m_sde, er_sde, euler_cfg_pp,
  euler_a_cfg_pp, seeds_2, seeds_3, exp_heun_2_x0(_sde), sa_solver(_pece). The same serves ddpm and
  ddim_trailing, whose DDPM/DDIM formulas assume a VP model
  (ComfyUI runs its ddpm on flow sigmas as if they were VE ones, which is wrong; its ddim is euler, and
  ours in VE coordinates at eta 0 is the same flow Euler step). As ComfyUI's offset_first_sigma_for_snr,
  a first sigma of 1 (infinite sigma_ve) becomes percent_to_sigma(1e-4); ComfyUI skips that offset for
  its cfg_pp samplers only, a difference below 1e-4 in the first step's sigma.
- Refused, with the reason (FLOW_REFUSED_SAMPLERS): tcd, dpm++2mv2.

Options refused on flow models for the same reason (they add VE noise a flow sample cannot hold):
s_churn > 0 in euler / heun / heunpp2 / dpm2, eta > 0 in dpm_fast.
"""

from collections.abc import Callable

import torch

from .model_sampling import RectifiedFlow

FLOW_REFUSED_SAMPLERS: dict[str, str] = {
    "tcd": "Trajectory Consistency Distillation's strategic stochastic sampling steps along the DDPM "
           "timestep table of TCD-distilled SD/SDXL models; it has no rectified-flow form (ComfyUI has no "
           "tcd sampler)",
    "dpm++2mv2": "its x0 coefficient uses the mean of the last two log-sigma steps, which is consistent only "
                 "where successive steps are nearly equal; flow schedules run linearly into sigma 0, where "
                 "they never are (on Gaussian data of std 0.8 it ends up to 0.86 off the exact flow, at 100 "
                 "steps as at 30; ComfyUI has no such sampler)",
}


def model_sampling_of(model) -> object | None:
    """The model sampling a denoiser carries (Denoiser, CFGDenoiser), or None for a bare function."""
    return getattr(model, "model_sampling", None)


def is_flow(model) -> bool:
    """True when `model` denoises a rectified-flow model (sigmas in [0, 1], x = (1 - s) x0 + s noise)."""
    return isinstance(model_sampling_of(model), RectifiedFlow)


def refuse_on_flow(name: str, model) -> None:
    """Raise for a sampler in FLOW_REFUSED_SAMPLERS when `model` is a flow model."""
    if is_flow(model):
        usable = "euler, euler_a, heun, dpm++2m, dpm++2m_sde, uni_pc, ..."
        raise ValueError(f"sampler '{name}' cannot sample a rectified-flow model: "
                         f"{FLOW_REFUSED_SAMPLERS[name]}; use another sampler ({usable})")


def refuse_option_on_flow(model, sampler: str, option: str, value: float) -> None:
    """Raise when a VE-noise option (s_churn, eta) is set on a flow model."""
    if value and is_flow(model):
        raise ValueError(f"sampler '{sampler}' with {option}={value} adds variance-exploding noise, which "
                         f"a rectified-flow sample cannot hold; use {option}=0 with a flow model")


def flow_ancestral_step(sigma: torch.Tensor, sigma_next: torch.Tensor,
                        eta: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rectified-flow ancestral split of a step (ComfyUI's *_ancestral_RF): (sigma_down, rescale, sigma_up).

    Step deterministically to sigma_down, then x = rescale * x + sigma_up * noise lands on sigma_next
    with the flow's data scale 1 - sigma_next.
    """
    sigma_down = sigma_next * (1 + (sigma_next / sigma - 1) * eta)
    alpha_next, alpha_down = 1 - sigma_next, 1 - sigma_down
    sigma_up = (sigma_next ** 2 - sigma_down ** 2 * alpha_next ** 2 / alpha_down ** 2).clamp(min=0) ** 0.5
    return sigma_down, alpha_next / alpha_down, sigma_up


def offset_first_sigma(sigmas: torch.Tensor, model_sampling: RectifiedFlow) -> torch.Tensor:
    """A first sigma of 1 (pure noise, infinite log-SNR) moved to percent_to_sigma(1e-4), as ComfyUI."""
    if len(sigmas) > 1 and float(sigmas[0]) >= 1.0:
        sigmas = sigmas.clone()
        sigmas[0] = model_sampling.percent_to_sigma(1e-4)
    return sigmas


class _FlowAsVE:
    """A flow denoiser seen in VE coordinates: (x_ve, sigma_ve) -> x0, with x = x_ve / (1 + sigma_ve)."""

    model_sampling = None  # the wrapped sampler must not dispatch on flow again

    def __init__(self, model):
        self.model = model

    def __call__(self, x_ve: torch.Tensor, sigma_ve: torch.Tensor, **extra_args) -> torch.Tensor:
        sigma_ve = torch.as_tensor(sigma_ve, dtype=torch.float64)
        alpha = (1 / (1 + sigma_ve)).to(x_ve.dtype)  # (B,)
        sigma = (sigma_ve / (1 + sigma_ve)).to(x_ve.dtype)
        return self.model(x_ve * alpha.reshape(alpha.shape + (1,) * (x_ve.ndim - alpha.ndim)), sigma,
                          **extra_args)

    @property
    def keep_uncond(self) -> bool:  # CFG++ (guidance.py): forwarded to the guided denoiser
        return self.model.keep_uncond

    @keep_uncond.setter
    def keep_uncond(self, value: bool) -> None:
        self.model.keep_uncond = value

    @property
    def last_uncond_denoised(self) -> torch.Tensor:
        return self.model.last_uncond_denoised  # x0 is the same in both coordinates


def run_in_ve_coordinates(sampler: Callable, model, x: torch.Tensor, sigmas: torch.Tensor, extra_args=None,
                          callback=None, disable=None, **options) -> torch.Tensor:
    """Run a k-diffusion (VE) sampler on a flow model: x_ve = x / (1 - sigma), sigma_ve = sigma / (1 - sigma).

    This is ComfyUI's half-log-SNR treatment of CONST models: lambda = log((1 - sigma) / sigma) =
    -log sigma_ve. The callback sees flow x and sigma.
    """
    sigmas = offset_first_sigma(sigmas, model_sampling_of(model))
    flow_sigmas = sigmas.double()
    sigmas_ve = flow_sigmas / (1 - flow_sigmas)  # 0 stays 0

    def on_step(info: dict) -> None:
        scale = 1 / (1 + torch.as_tensor(info["sigma"], dtype=torch.float64))
        callback({**info, "x": info["x"] * scale.to(info["x"].dtype), "sigma": info["sigma"] * scale,
                  "sigma_hat": info["sigma_hat"] / (1 + info["sigma_hat"])})

    x_ve = x / (1 - flow_sigmas[0]).to(x.dtype)
    x_ve = sampler(_FlowAsVE(model), x_ve, sigmas_ve, extra_args, None if callback is None else on_step,
                   disable, **options)
    return x_ve * (1 - flow_sigmas[-1]).to(x.dtype)
