"""UniPC (Zhao et al. 2023, "UniPC: A Unified Predictor-Corrector Framework for Fast Sampling of Diffusion
Models") as ComfyUI's uni_pc and uni_pc_bh2 (its comfy/extra_samplers/uni_pc.py, after the authors' code).

It is not diffusers' UniPCMultistepScheduler nor a k-diffusion port; what changes the image:

- The solver works on the VP sample x / sqrt(1 + sigma^2) in data prediction, with alpha, the VP noise
  level and lambda computed from each k-diffusion sigma, in the sigmas' dtype, by ComfyUI's formulas:
  log alpha = 0.5 log(1 / (sigma^2 + 1)), sigma_vp = sqrt(1 - exp(2 log alpha)), lambda = log alpha -
  0.5 log(1 - exp(2 log alpha)). In float32 these are coarse near sigma 0.001, and so is ComfyUI's image.
- A schedule ending at sigma 0 ends at UNIPC_FINAL_SIGMA (0.001) instead: the result is the sample at that
  sigma, which ComfyUI's KSampler un-scales at 0.001 (registry.final_sigma).
- The order is min(3, steps - 1), lowered to the step's index over the first steps and to the steps left
  over the last two. One step takes no step at all: the input comes back as x alpha(sigma_0) / alpha(end).
- Each step predicts (UniP), evaluates the model at the prediction, and corrects (UniC) with that value,
  which is also the next step's history; the last step only predicts.

Flow models are sampled with their sigmas as if they were VE ones, as ComfyUI does; the steps solve the
same ODE in both coordinates (flow.py).
"""

import torch

from .samplers import Callback

UNIPC_FINAL_SIGMA = 0.001


def unipc_vp(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(alpha, sigma_vp, lambda) of a k-diffusion sigma, by ComfyUI's SigmaConvert formulas."""
    log_alpha = 0.5 * torch.log(1 / (sigma * sigma + 1))
    sigma_vp = torch.sqrt(1.0 - torch.exp(2.0 * log_alpha))
    lam = log_alpha - 0.5 * torch.log(1.0 - torch.exp(2.0 * log_alpha))
    return log_alpha.exp(), sigma_vp, lam


def unipc_sigmas(sigmas: torch.Tensor) -> torch.Tensor:
    """The sigmas UniPC runs: a final 0 becomes UNIPC_FINAL_SIGMA."""
    sigmas = sigmas.clone()
    if sigmas[-1] == 0:
        sigmas[-1] = UNIPC_FINAL_SIGMA
    return sigmas


def _unipc_system(lambdas: list[torch.Tensor], lambda_t: torch.Tensor, order: int, variant: str):
    """The step's ratios r_k, h phi_1(h), B(h), and UniPC's linear system R rho = b (its eqs. for data
    prediction, with hh = -h): R_kj = r_j^(k-1), b_k = hh phi_(k+1)(hh) k! / B(h)."""
    h = lambda_t - lambdas[-1]
    rks = torch.stack([(lambdas[-(k + 1)] - lambdas[-1]) / h for k in range(1, order)] + [torch.ones_like(h)])
    hh = -h
    h_phi_1 = torch.expm1(hh)
    b_h = hh if variant == "bh1" else torch.expm1(hh)
    h_phi_k, factorial, rows, b = h_phi_1 / hh - 1, 1, [], []
    for k in range(1, order + 1):
        rows.append(rks ** (k - 1))
        b.append(h_phi_k * factorial / b_h)
        factorial *= k + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    return rks, h_phi_1, b_h, torch.stack(rows), torch.stack(b)


@torch.no_grad()
def sample_uni_pc(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None, variant="bh1"):
    """UniPC multistep predictor-corrector (Zhao et al. 2023), ComfyUI's uni_pc (B(h) = h)."""
    if variant not in ("bh1", "bh2"):
        raise ValueError(f"UniPC variant must be 'bh1' or 'bh2'; got '{variant}'")
    extra_args = {} if extra_args is None else extra_args
    ts = unipc_sigmas(sigmas)
    steps = len(ts) - 1
    order = min(3, steps - 1)
    s_in = x.new_ones([x.shape[0]])

    def data_prediction(x_vp: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x0 from the model's eps at the VE sample, as (x_vp - sigma_vp eps) / alpha."""
        alpha, sigma_vp, _ = unipc_vp(t)
        x_ve = x_vp * ((t ** 2 + 1.0) ** 0.5)
        eps = (x_ve - model(x_ve, t * s_in, **extra_args)) / t
        return (x_vp - sigma_vp * eps) / alpha

    def report(i: int, x_vp: torch.Tensor, denoised: torch.Tensor) -> None:
        if callback is not None:
            callback({"x": x_vp * ((ts[i] ** 2 + 1.0) ** 0.5), "i": i, "sigma": ts[i], "sigma_hat": ts[i],
                      "denoised": denoised})

    x = x / torch.sqrt(1.0 + ts[0] ** 2.0)  # (B, C, H, W) VP sample
    history = [data_prediction(x, ts[0])]  # model values at the last `order` sigmas, newest last
    lambdas = [unipc_vp(ts[0])[2]]
    report(0, x, history[-1])
    for s in range(1, steps + 1 if steps > 1 else 1):  # one step: none is taken
        step_order = min(s, order, steps + 1 - s)
        alpha_t, sigma_t, lambda_t = unipc_vp(ts[s])
        sigma_prev = unipc_vp(ts[s - 1])[1]
        rks, h_phi_1, b_h, rows, b = _unipc_system(lambdas, lambda_t, step_order, variant)
        m0 = history[-1]
        d1s = [(history[-(k + 1)] - m0) / rks[k - 1] for k in range(1, step_order)]
        x_base = (sigma_t / sigma_prev) * x - (alpha_t * h_phi_1) * m0
        x_pred = x_base
        if step_order > 1:  # UniP: higher-order terms from the history
            rhos_p = [0.5] if step_order == 2 else torch.linalg.solve(rows[:-1, :-1], b[:-1])
            x_pred = x_base - (alpha_t * b_h) * sum(rho * d for rho, d in zip(rhos_p, d1s, strict=True))
        if s == steps:
            x = x_pred
            break
        model_t = data_prediction(x_pred, ts[s])
        rhos_c = [0.5] if step_order == 1 else torch.linalg.solve(rows, b)
        correction = sum((rho * d for rho, d in zip(rhos_c[:-1], d1s, strict=True)), torch.zeros_like(x))
        x = x_base - (alpha_t * b_h) * (correction + rhos_c[-1] * (model_t - m0))  # UniC
        history, lambdas = (history + [model_t])[-order:], (lambdas + [lambda_t])[-order:]
        report(s, x, model_t)
    return x / unipc_vp(ts[-1])[0]


@torch.no_grad()
def sample_uni_pc_bh2(model, x, sigmas, extra_args=None, callback: Callback = None, disable=None):
    """UniPC with B(h) = e^h - 1 (Zhao et al. 2023), ComfyUI's uni_pc_bh2."""
    return sample_uni_pc(model, x, sigmas, extra_args, callback, disable, variant="bh2")
