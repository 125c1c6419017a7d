"""SA-Solver: stochastic Adams predictor-corrector (Xue et al. 2023, "SA-Solver: Stochastic Adams Solver for
Fast Sampling of Diffusion Models", NeurIPS), data prediction in lambda = -log sigma, as ComfyUI's sa_solver
and sa_solver_pece.

One step from lambda_s to lambda_t with stochasticity tau (eq. 15 and 18 of the paper):
x_t = (sigma_t / sigma_s) e^(-tau^2 h) x_s + sum_j b_j D_j + sigma_t sqrt(1 - e^(-2 tau^2 h)) noise, where b_j
integrates (1 + tau^2) e^((1 + tau^2)(lambda - lambda_t)) times the Lagrange basis of D_j over the points'
lambdas. tau is 1 for sigmas between the model's sigmas at 20 % and 80 % of sampling, 0 elsewhere
(ComfyUI's default interval). The predictor extrapolates the last `predictor_order` predictions; the corrector
re-integrates the step just taken with the new prediction (order up to `corrector_order`), adding the same
noise again; PECE re-evaluates the model at the corrected point. Orders drop over the last steps when the
schedule ends at 0.
"""

from collections.abc import Callable

import torch

from .flow import is_flow, model_sampling_of, run_in_ve_coordinates
from .noise import NoiseSampler, default_noise_sampler
from .samplers import Callback

TAU_INTERVAL = (0.2, 0.8)  # the fractions of sampling between which tau is 1 (ComfyUI's default)


def exponential_moments(lambda_s: torch.Tensor, lambda_t: torch.Tensor, count: int,
                        tau: float) -> torch.Tensor:
    """J_p = k int_s^t e^(k (lambda - t)) lambda^p d lambda for p < count, k = 1 + tau^2, by parts:
    J_0 = 1 - e^(-k h), J_p = (t^p - s^p e^(-k h)) - (p / k) J_(p-1)."""
    k = 1 + tau ** 2
    decay = (-k * (lambda_t - lambda_s)).exp()
    moments = [1 - decay]
    for p in range(1, count):
        moments.append(lambda_t ** p - lambda_s ** p * decay - (p / k) * moments[-1])
    return torch.stack(moments)


def adams_coefficients(sigma_t: torch.Tensor, lambdas: torch.Tensor, lambda_s: torch.Tensor,
                       lambda_t: torch.Tensor, tau: float, simple_order_2: bool = False,
                       corrector: bool = False) -> torch.Tensor:
    """b_j for the predictions at `lambdas` (oldest first) of one step from lambda_s to lambda_t.

    The Lagrange integrals l solve sum_j lambda_j^p l_j = J_p; b = alpha_t l with alpha_t = sigma_t e^lambda_t
    (1 for a VE model). `simple_order_2`: the paper's simplified two-point coefficients (Appendix D).
    """
    alpha_t = sigma_t * lambda_t.exp()
    if simple_order_2 and len(lambdas) == 2:
        k, h = 1 + tau ** 2, lambda_t - lambda_s
        total = alpha_t * (-h * k).expm1().neg()
        if corrector:  # one step back: the new prediction weighs k h / 2
            newest = alpha_t * (0.5 * k * h)
        else:  # two steps: the older prediction extrapolates with weight k h^2 / (2 (lambda_old - lambda_s))
            newest = total - alpha_t * (0.5 * k * h ** 2) / (lambdas[-2] - lambda_s)
        return torch.stack([total - newest, newest])
    powers = torch.stack([lambdas ** p for p in range(len(lambdas))])  # (p, j)
    return alpha_t * torch.linalg.solve(powers, exponential_moments(lambda_s, lambda_t, len(lambdas), tau))


def tau_interval(start_sigma: float, end_sigma: float) -> Callable[[torch.Tensor], float]:
    """tau(sigma) = 1 for start_sigma >= sigma >= end_sigma, else 0."""
    return lambda sigma: 1.0 if start_sigma >= float(sigma) >= end_sigma else 0.0


@torch.no_grad()
def sample_sa_solver(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                     tau_func: Callable[[torch.Tensor], float] | None = None, s_noise=1.0,
                     noise_sampler: NoiseSampler | None = None, predictor_order=3, corrector_order=4,
                     use_pece=False, simple_order_2=False):
    """SA-Solver (Xue et al. 2023): stochastic Adams predictor-corrector, as ComfyUI's sa_solver."""
    if tau_func is None:
        model_sampling = model_sampling_of(model)
        if model_sampling is None:
            raise ValueError("sa_solver needs a tau_func or a denoiser with a model_sampling (its default "
                             "stochastic interval is the model's sigmas at 20 % and 80 % of sampling)")
        start, end = (float(model_sampling.percent_to_sigma(p)) for p in TAU_INTERVAL)
        if is_flow(model):  # the interval in VE sigmas, where the flow model is sampled
            start, end = start / (1 - start), end / (1 - end)
        tau_func = tau_interval(start, end)
    if is_flow(model):
        return run_in_ve_coordinates(sample_sa_solver, model, x, sigmas, extra_args, callback, disable,
                                     tau_func=tau_func, s_noise=s_noise, noise_sampler=noise_sampler,
                                     predictor_order=predictor_order, corrector_order=corrector_order,
                                     use_pece=use_pece, simple_order_2=simple_order_2)
    if len(sigmas) <= 1:
        return x
    extra_args = {} if extra_args is None else extra_args
    noise_sampler = default_noise_sampler(x) if noise_sampler is None else noise_sampler
    s_in = x.new_ones([x.shape[0]])
    lambdas = -sigmas.log()  # inf at sigma 0, never used there
    keep = max(predictor_order, corrector_order)
    lower_order_to_end = float(sigmas[-1]) == 0
    x_pred, h, tau, noise, predictions = x, 0.0, 0.0, 0.0, []
    for i in range(len(sigmas) - 1):
        denoised = model(x_pred, sigmas[i] * s_in, **extra_args)
        if callback is not None:
            callback({"x": x_pred, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        predictions = (predictions + [denoised])[-keep:]
        p_order = min(predictor_order, len(predictions))
        last = sigmas[i + 1] == 0
        c_order = 0 if i == 0 or (last and not use_pece) else min(corrector_order, len(predictions))
        if lower_order_to_end:
            p_order = min(p_order, len(sigmas) - 2 - i)
            c_order = min(c_order, len(sigmas) - 1 - i)
        if c_order == 0:
            x = x_pred
        else:  # correct the step sigma_(i-1) -> sigma_i with the new prediction
            b = adams_coefficients(sigmas[i], lambdas[i - c_order + 1:i + 1], lambdas[i - 1], lambdas[i], tau,
                                   simple_order_2, corrector=True)
            x = sigmas[i] / sigmas[i - 1] * (-(tau ** 2) * h).exp() * x + \
                sum(b_j * d for b_j, d in zip(b, predictions[-c_order:], strict=True))
            if tau > 0 and s_noise > 0:
                x = x + noise  # the predictor's noise of that step
            if use_pece:
                denoised = model(x, sigmas[i] * s_in, **extra_args)
                predictions[-1] = denoised
        if last:
            x_pred = denoised
            continue
        tau = tau_func(sigmas[i + 1])
        b = adams_coefficients(sigmas[i + 1], lambdas[i - p_order + 1:i + 1], lambdas[i], lambdas[i + 1], tau,
                               simple_order_2)
        h = lambdas[i + 1] - lambdas[i]
        x_pred = sigmas[i + 1] / sigmas[i] * (-(tau ** 2) * h).exp() * x + \
            sum(b_j * d for b_j, d in zip(b, predictions[-p_order:], strict=True))
        if tau > 0 and s_noise > 0:
            noise = noise_sampler(sigmas[i], sigmas[i + 1]) * sigmas[i + 1] * \
                (-2 * tau ** 2 * h).expm1().neg().sqrt() * s_noise
            x_pred = x_pred + noise
    return x_pred


@torch.no_grad()
def sample_sa_solver_pece(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None,
                          tau_func: Callable[[torch.Tensor], float] | None = None, s_noise=1.0,
                          noise_sampler: NoiseSampler | None = None, predictor_order=3, corrector_order=4,
                          simple_order_2=False):
    """SA-Solver in PECE mode (predict, evaluate, correct, evaluate), as ComfyUI's sa_solver_pece."""
    return sample_sa_solver(model, x, sigmas, extra_args, callback, disable, tau_func, s_noise, noise_sampler,
                            predictor_order, corrector_order, use_pece=True, simple_order_2=simple_order_2)
