"""Stochastic (SDE) samplers. Same conventions as samplers.py.

As in ComfyUI, the DPM++ SDE samplers draw their step noise from a torchsde Brownian tree over the run's
sigmas (noise.BrownianTreeNoiseSampler; registry.step_noise_sampler builds the seeded one, on the CPU or,
for the `_gpu` samplers, on the latent's device); ER-SDE draws independent Gaussians
(noise.default_noise_sampler).
On rectified-flow models they run in VE coordinates (flow.py), ComfyUI's half-log-SNR form.
"""

import torch

from .flow import is_flow, run_in_ve_coordinates
from .noise import NoiseSampler, brownian_tree_noise_sampler, default_noise_sampler
from .samplers import Callback, get_ancestral_step


@torch.no_grad()
def sample_dpmpp_sde(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, eta=1.0,
                     s_noise=1.0, noise_sampler: NoiseSampler | None = None, r=1 / 2):
    """DPM-Solver++ (stochastic), the two-stage SDE variant of k-diffusion (Lu et al. 2022b)."""
    if is_flow(model):
        return run_in_ve_coordinates(sample_dpmpp_sde, model, x, sigmas, extra_args, callback, disable,
                                     eta=eta, s_noise=s_noise, noise_sampler=noise_sampler, r=r)
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = brownian_tree_noise_sampler(x, sigmas, None) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        if sigmas[i + 1] == 0:
            x = denoised
            continue
        t, t_next = -sigmas[i].log(), -sigmas[i + 1].log()  # t = -log sigma
        s = t + (t_next - t) * r
        sigma_s = (-s).exp()
        sigma_down, sigma_up = get_ancestral_step(sigmas[i], sigma_s, eta)  # stage 1 to sigma_s
        x_2 = (sigma_down / sigmas[i]) * x - torch.expm1(sigma_down.log() - sigmas[i].log()) * denoised
        x_2 = x_2 + noise_sampler(sigmas[i], sigma_s) * s_noise * sigma_up
        denoised_2 = model(x_2, sigma_s * s_in, **extra_args)
        sigma_down, sigma_up = get_ancestral_step(sigmas[i], sigmas[i + 1], eta)  # stage 2 to sigma_next
        fac = 1 / (2 * r)
        denoised_d = (1 - fac) * denoised + fac * denoised_2
        x = (sigma_down / sigmas[i]) * x - torch.expm1(sigma_down.log() - sigmas[i].log()) * denoised_d
        x = x + noise_sampler(sigmas[i], sigmas[i + 1]) * s_noise * sigma_up
    return x


@torch.no_grad()
def sample_dpmpp_2m_sde(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, eta=1.0,
                        s_noise=1.0, noise_sampler: NoiseSampler | None = None, solver_type="midpoint"):
    """DPM-Solver++(2M) SDE (Lu et al. 2022b), midpoint or heun second-order correction."""
    if solver_type not in {"heun", "midpoint"}:
        raise ValueError(f"solver_type must be 'heun' or 'midpoint'; got '{solver_type}'")
    if is_flow(model):
        return run_in_ve_coordinates(sample_dpmpp_2m_sde, model, x, sigmas, extra_args, callback, disable,
                                     eta=eta, s_noise=s_noise, noise_sampler=noise_sampler,
                                     solver_type=solver_type)
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = brownian_tree_noise_sampler(x, sigmas, None) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    old_denoised, h_last, h = None, None, None
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            h = sigmas[i].log() - sigmas[i + 1].log()
            eta_h = eta * h
            x = sigmas[i + 1] / sigmas[i] * (-eta_h).exp() * x - torch.expm1(-h - eta_h) * denoised
            if old_denoised is not None:
                r = h_last / h
                if solver_type == "heun":
                    coeff = -torch.expm1(-h - eta_h) / (-h - eta_h) + 1
                else:
                    coeff = -0.5 * torch.expm1(-h - eta_h)
                x = x + coeff * (1 / r) * (denoised - old_denoised)
            if eta:
                x = x + noise_sampler(sigmas[i], sigmas[i + 1]) * sigmas[i + 1] * \
                    (-torch.expm1(-2 * eta_h)).sqrt() * s_noise
        old_denoised, h_last = denoised, h
    return x


@torch.no_grad()
def sample_dpmpp_2m_sde_heun(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                             eta=1.0, s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """DPM-Solver++(2M) SDE with the heun correction (Lu et al. 2022b)."""
    return sample_dpmpp_2m_sde(model, x, sigmas, extra_args, callback, disable, eta, s_noise, noise_sampler,
                               solver_type="heun")


@torch.no_grad()
def sample_dpmpp_3m_sde(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, eta=1.0,
                        s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """DPM-Solver++(3M) SDE (Lu et al. 2022b; k-diffusion's third-order multistep SDE)."""
    if is_flow(model):
        return run_in_ve_coordinates(sample_dpmpp_3m_sde, model, x, sigmas, extra_args, callback, disable,
                                     eta=eta, s_noise=s_noise, noise_sampler=noise_sampler)
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = brownian_tree_noise_sampler(x, sigmas, None) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    denoised_1, denoised_2, h, h_1, h_2 = None, None, None, None, None
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            h = sigmas[i].log() - sigmas[i + 1].log()
            h_eta = h * (eta + 1)
            x = torch.exp(-h_eta) * x - torch.expm1(-h_eta) * denoised
            phi_2 = torch.expm1(-h_eta) / h_eta + 1
            if h_2 is not None:
                r0, r1 = h_1 / h, h_2 / h
                d1_0, d1_1 = (denoised - denoised_1) / r0, (denoised_1 - denoised_2) / r1
                d1 = d1_0 + (d1_0 - d1_1) * r0 / (r0 + r1)
                d2 = (d1_0 - d1_1) / (r0 + r1)
                x = x + phi_2 * d1 - (phi_2 / h_eta - 0.5) * d2
            elif h_1 is not None:
                x = x + phi_2 * (denoised - denoised_1) / (h_1 / h)
            if eta:
                x = x + noise_sampler(sigmas[i], sigmas[i + 1]) * sigmas[i + 1] * \
                    (-torch.expm1(-2 * h * eta)).sqrt() * s_noise
        denoised_1, denoised_2 = denoised, denoised_1
        h_1, h_2 = h, h_1
    return x


@torch.no_grad()
def sample_dpmpp_sde_gpu(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, eta=1.0,
                         s_noise=1.0, noise_sampler: NoiseSampler | None = None, r=1 / 2):
    """sample_dpmpp_sde whose Brownian tree lives on the latent's device (ComfyUI's dpmpp_sde_gpu)."""
    return sample_dpmpp_sde(model, x, sigmas, extra_args, callback, disable, eta, s_noise, noise_sampler, r)


@torch.no_grad()
def sample_dpmpp_2m_sde_gpu(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                            eta=1.0, s_noise=1.0, noise_sampler: NoiseSampler | None = None,
                            solver_type="midpoint"):
    """sample_dpmpp_2m_sde whose Brownian tree lives on the latent's device (ComfyUI's dpmpp_2m_sde_gpu)."""
    return sample_dpmpp_2m_sde(model, x, sigmas, extra_args, callback, disable, eta, s_noise, noise_sampler,
                               solver_type)


@torch.no_grad()
def sample_dpmpp_2m_sde_heun_gpu(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                                 eta=1.0, s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """sample_dpmpp_2m_sde_heun whose Brownian tree lives on the latent's device (ComfyUI's _gpu name)."""
    return sample_dpmpp_2m_sde(model, x, sigmas, extra_args, callback, disable, eta, s_noise, noise_sampler,
                               solver_type="heun")


@torch.no_grad()
def sample_dpmpp_3m_sde_gpu(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                            eta=1.0, s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """sample_dpmpp_3m_sde whose Brownian tree lives on the latent's device (ComfyUI's dpmpp_3m_sde_gpu)."""
    return sample_dpmpp_3m_sde(model, x, sigmas, extra_args, callback, disable, eta, s_noise, noise_sampler)


def _er_sde_noise_scaler(x: torch.Tensor) -> torch.Tensor:
    """The default noise scale function of ER-SDE-Solver (Cui et al. 2023, eq. 21)."""
    return x * ((x ** 0.3).exp() + 10.0)


@torch.no_grad()
def sample_er_sde(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, s_noise=1.0,
                  noise_sampler: NoiseSampler | None = None, max_stage=3):
    """Extended reverse-time SDE solver, up to third order (Cui et al. 2023, arXiv:2309.06169)."""
    if is_flow(model):
        return run_in_ve_coordinates(sample_er_sde, model, x, sigmas, extra_args, callback, disable,
                                     s_noise=s_noise, noise_sampler=noise_sampler, max_stage=max_stage)
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    points = torch.arange(200, dtype=torch.float64)  # for the numerical integrals of stages 2-3
    lambdas = sigmas.double().cpu()  # ER-SDE lambda = sigma for a VE (k-diffusion) model
    old_denoised, old_denoised_d = None, None
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        stage = min(max_stage, i + 1)
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            lam_s, lam_t = lambdas[i], lambdas[i + 1]
            r = float(_er_sde_noise_scaler(lam_t) / _er_sde_noise_scaler(lam_s))
            x = r * x + (1 - r) * denoised
            if stage >= 2:
                dt = lam_t - lam_s
                step = -dt / len(points)
                positions = lam_t + points * step
                scaled = _er_sde_noise_scaler(positions)
                s = torch.sum(1 / scaled) * step
                denoised_d = (denoised - old_denoised) / float(lam_s - lambdas[i - 1])
                x = x + float(dt + s * _er_sde_noise_scaler(lam_t)) * denoised_d
                if stage >= 3:
                    s_u = torch.sum((positions - lam_s) / scaled) * step
                    denoised_u = (denoised_d - old_denoised_d) / float((lam_s - lambdas[i - 2]) / 2)
                    x = x + float((dt ** 2) / 2 + s_u * _er_sde_noise_scaler(lam_t)) * denoised_u
                old_denoised_d = denoised_d
            if s_noise > 0:
                noise_std = float((lam_t ** 2 - lam_s ** 2 * r ** 2).clamp(min=0).sqrt())
                x = x + noise_sampler(sigmas[i], sigmas[i + 1]) * s_noise * noise_std
        old_denoised = denoised
    return x


def _h_phi_2(h: torch.Tensor) -> torch.Tensor:
    """h phi_2(h) = (e^h - 1 - h) / h of exponential integrators."""
    return (torch.expm1(h) - h) / h


@torch.no_grad()
def sample_seeds_2(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, eta=1.0,
                   s_noise=1.0, noise_sampler: NoiseSampler | None = None, r=0.5, solver_type="phi_1"):
    """SEEDS-2 (Gonzalez et al. 2023, "SEEDS: Exponential SDE Solvers for Fast High-Quality Sampling from
    Diffusion Models"), data prediction in log-SNR time with a stage at r h; as ComfyUI's seeds_2, whose
    solver_type phi_2 gives the exponential Heun method at r = 1 (exp_heun_2_x0). The two noise draws of a
    step are the increments of one Brownian path over its two segments."""
    if solver_type not in ("phi_1", "phi_2"):
        raise ValueError(f"solver_type must be 'phi_1' or 'phi_2'; got '{solver_type}'")
    if is_flow(model):
        return run_in_ve_coordinates(sample_seeds_2, model, x, sigmas, extra_args, callback, disable, eta=eta,
                                     s_noise=s_noise, noise_sampler=noise_sampler, r=r,
                                     solver_type=solver_type)
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    inject_noise = eta > 0 and s_noise > 0
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        if sigmas[i + 1] == 0:
            x = denoised
            continue
        lambda_s, lambda_t = -sigmas[i].log(), -sigmas[i + 1].log()  # lambda = -log sigma
        h = lambda_t - lambda_s
        h_eta = h * (eta + 1)
        sigma_1 = (-torch.lerp(lambda_s, lambda_t, r)).exp()
        x_2 = sigma_1 / sigmas[i] * (-r * h * eta).exp() * x - torch.expm1(-r * h_eta) * denoised
        if inject_noise:
            sde_noise = (-2 * r * h * eta).expm1().neg().sqrt() * noise_sampler(sigmas[i], sigma_1)
            x_2 = x_2 + sde_noise * sigma_1 * s_noise
        denoised_2 = model(x_2, sigma_1 * s_in, **extra_args)
        decay = sigmas[i + 1] / sigmas[i] * (-h * eta).exp()
        if solver_type == "phi_1":
            x = decay * x - torch.expm1(-h_eta) * torch.lerp(denoised, denoised_2, 1 / (2 * r))
        else:
            b2 = _h_phi_2(-h_eta) / r
            x = decay * x - ((torch.expm1(-h_eta) - b2) * denoised + b2 * denoised_2)
        if inject_noise:  # the path's increment over [sigma_1, sigma_next], the first one decayed
            segment = (r - 1) * h * eta
            sde_noise = sde_noise * segment.exp() + \
                (2 * segment).expm1().neg().sqrt() * noise_sampler(sigma_1, sigmas[i + 1])
            x = x + sde_noise * sigmas[i + 1] * s_noise
    return x


@torch.no_grad()
def sample_seeds_3(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, eta=1.0,
                   s_noise=1.0, noise_sampler: NoiseSampler | None = None, r_1=1 / 3, r_2=2 / 3):
    """SEEDS-3 (Gonzalez et al. 2023), data prediction in log-SNR time with stages at r_1 h and r_2 h; as
    ComfyUI's seeds_3."""
    if is_flow(model):
        return run_in_ve_coordinates(sample_seeds_3, model, x, sigmas, extra_args, callback, disable, eta=eta,
                                     s_noise=s_noise, noise_sampler=noise_sampler, r_1=r_1, r_2=r_2)
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    inject_noise = eta > 0 and s_noise > 0
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        if sigmas[i + 1] == 0:
            x = denoised
            continue
        lambda_s, lambda_t = -sigmas[i].log(), -sigmas[i + 1].log()
        h = lambda_t - lambda_s
        h_eta = h * (eta + 1)
        sigma_1 = (-torch.lerp(lambda_s, lambda_t, r_1)).exp()
        sigma_2 = (-torch.lerp(lambda_s, lambda_t, r_2)).exp()
        x_2 = sigma_1 / sigmas[i] * (-r_1 * h * eta).exp() * x - torch.expm1(-r_1 * h_eta) * denoised
        if inject_noise:
            sde_noise = (-2 * r_1 * h * eta).expm1().neg().sqrt() * noise_sampler(sigmas[i], sigma_1)
            x_2 = x_2 + sde_noise * sigma_1 * s_noise
        denoised_2 = model(x_2, sigma_1 * s_in, **extra_args)
        a_2 = r_2 / r_1 * _h_phi_2(-r_2 * h_eta)
        a_1 = torch.expm1(-r_2 * h_eta) - a_2
        x_3 = sigma_2 / sigmas[i] * (-r_2 * h * eta).exp() * x - (a_1 * denoised + a_2 * denoised_2)
        if inject_noise:
            segment = (r_1 - r_2) * h * eta
            sde_noise = sde_noise * segment.exp() + \
                (2 * segment).expm1().neg().sqrt() * noise_sampler(sigma_1, sigma_2)
            x_3 = x_3 + sde_noise * sigma_2 * s_noise
        denoised_3 = model(x_3, sigma_2 * s_in, **extra_args)
        b_3 = _h_phi_2(-h_eta) / r_2
        b_1 = torch.expm1(-h_eta) - b_3
        x = sigmas[i + 1] / sigmas[i] * (-h * eta).exp() * x - (b_1 * denoised + b_3 * denoised_3)
        if inject_noise:
            segment = (r_2 - 1) * h * eta
            sde_noise = sde_noise * segment.exp() + \
                (2 * segment).expm1().neg().sqrt() * noise_sampler(sigma_2, sigmas[i + 1])
            x = x + sde_noise * sigmas[i + 1] * s_noise
    return x


@torch.no_grad()
def sample_exp_heun_2_x0(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None):
    """The exponential Heun method in data prediction and log-SNR time (ComfyUI's exp_heun_2_x0): SEEDS-2
    with its stage at the step's end (r = 1), phi_2 weights, no noise."""
    return sample_seeds_2(model, x, sigmas, extra_args, callback, disable, eta=0.0, s_noise=0.0, r=1.0,
                          solver_type="phi_2")


@torch.no_grad()
def sample_exp_heun_2_x0_sde(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                             eta=1.0, s_noise=1.0, noise_sampler: NoiseSampler | None = None):
    """The stochastic exponential Heun method (ComfyUI's exp_heun_2_x0_sde): SEEDS-2 at r = 1, phi_2."""
    return sample_seeds_2(model, x, sigmas, extra_args, callback, disable, eta=eta, s_noise=s_noise,
                          noise_sampler=noise_sampler, r=1.0, solver_type="phi_2")
