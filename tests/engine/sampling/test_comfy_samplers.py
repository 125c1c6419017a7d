"""ComfyUI's samplers that Sluice gained for issue 23, each against a reference loop written here from
ComfyUI's mathematics (comfy/extra_samplers/uni_pc.py, comfy/k_diffusion/sampling.py and sa_solver.py),
never calling the engine's samplers:

- its UniPC (uni_pc, uni_pc_bh2): VP parametrisation in the sigmas' dtype, end at sigma 0.001, order
  min(3, steps - 1), the step_index loop with its warm-up and final predictor-only step;
- the CFG++ samplers (dpmpp_2s_ancestral_cfg_pp, dpmpp_2m_cfg_pp, res_multistep(_ancestral)_cfg_pp,
  gradient_estimation_cfg_pp), the reference computing cond and uncond by calling the toy network itself;
- SEEDS-2/3 and the exponential Heun samplers, on VE and (in ComfyUI's half-log-SNR form) flow models;
- SA-Solver (and PECE), its coefficients integrated numerically (Gauss-Legendre) rather than in closed form;
- the KSampler name lists of current ComfyUI, written down.
"""

import math

import numpy as np
import pytest
import torch

from engine.sampling.guidance import CFGDenoiser, Conditioning
from engine.sampling.model_sampling import EpsPrediction, FluxFlowMatching
from engine.sampling.registry import SAMPLERS, final_sigma, resolve_sampler
from engine.sampling.sample import sample_sigmas
from engine.sampling.schedulers import resolve_scheduler
from tests.engine.sampling.comfy_lists import COMFY_SAMPLER_NAMES, COMFY_SCHEDULER_NAMES

SIGMAS_VE = [14.614642, 7.4, 3.9, 2.1, 1.05, 0.48, 0.17, 0.0292, 0.0]  # a descending SD1-range schedule


def test_every_comfyui_sampler_and_scheduler_name_resolves():
    for name in COMFY_SAMPLER_NAMES:
        assert callable(resolve_sampler(name)), name
    for name in COMFY_SCHEDULER_NAMES:
        assert callable(resolve_scheduler(name)), name
    assert resolve_sampler("ddim") is resolve_sampler("euler")  # ComfyUI's ddim is euler
    assert resolve_sampler("ddim_trailing") is not resolve_sampler("ddim")  # sd.cpp's is DDIM itself


# ---- toys ------------------------------------------------------------------------------------------------


class MeanByContext:
    """Exact denoiser of Gaussian data N(m, s^2) with m the context's first value, so the positive and
    negative prompts predict differently; VE (SD1) or rectified flow (x = (1 - sigma) x0 + sigma noise)."""

    def __init__(self, flow: bool = False, std: float = 0.7):
        self.flow, self.std = flow, std
        self.model_sampling = FluxFlowMatching(1.15) if flow else EpsPrediction()
        self.calls = 0

    def __call__(self, x, sigma, context=None, y=None, **extra):
        self.calls += 1
        mean = context[:, 0, 0].reshape(-1, 1, 1, 1).to(x)
        s = torch.as_tensor(sigma, dtype=x.dtype).reshape(-1, 1, 1, 1)
        if self.flow:
            alpha = 1 - s
            return mean + alpha * self.std ** 2 / (alpha ** 2 * self.std ** 2 + s ** 2) * (x - alpha * mean)
        return (self.std ** 2 * x + s ** 2 * mean) / (self.std ** 2 + s ** 2)


def context(value: float, dtype=torch.float64) -> torch.Tensor:
    return torch.full((1, 3, 2), value, dtype=dtype)


class Reference:
    """What the reference loops call: the toy's cond and uncond predictions and their CFG mix."""

    def __init__(self, toy: MeanByContext, cfg: float, cond: float = 0.6, uncond: float = -0.4):
        self.toy, self.cfg, self.cond, self.uncond = toy, cfg, cond, uncond

    def both(self, x, sigma):
        """(guided, uncond) x0 predictions at x, sigma."""
        sigma = torch.as_tensor(sigma, dtype=x.dtype).expand(x.shape[0])
        c = self.toy(x, sigma, context=context(self.cond, x.dtype).expand(x.shape[0], -1, -1))
        u = self.toy(x, sigma, context=context(self.uncond, x.dtype).expand(x.shape[0], -1, -1))
        return u + self.cfg * (c - u), u

    def guided(self, dtype=torch.float64) -> CFGDenoiser:
        """Ours: the same toy behind the engine's CFG denoiser."""
        return CFGDenoiser(self.toy, Conditioning(context(self.cond, dtype)),
                           Conditioning(context(self.uncond, dtype)), self.cfg)


def start(sigma0: float, seed: int = 0, dtype=torch.float64, shape=(2, 3, 4, 4)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * sigma0


def noise_list(count: int, shape, seed: int = 11, dtype=torch.float64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=dtype) for _ in range(count)]


def replay(noises: list[torch.Tensor]):
    """A noise sampler handing out the listed draws in order (and recording the sigmas it was asked at)."""
    draws = iter(noises)
    return lambda sigma, sigma_next: next(draws)


def ve_ancestral(sigma, sigma_next, eta):
    """k-diffusion's get_ancestral_step."""
    if not eta:
        return sigma_next, 0.0
    sigma, sigma_next = float(sigma), float(sigma_next)
    up = min(sigma_next, eta * math.sqrt(sigma_next ** 2 * (sigma ** 2 - sigma_next ** 2) / sigma ** 2))
    return math.sqrt(float(sigma_next) ** 2 - up ** 2), up


# ---- UniPC -------------------------------------------------------------------------------------------------


def comfy_unipc(model, x, sigmas, variant):
    """ComfyUI's sample_unipc: timesteps = sigmas with a final 0 made 0.001; the noise divided by
    sqrt(1 + t_0^2) into VP space; UniPC.sample(multistep, order min(3, len - 2), lower_order_final) over
    them, in data prediction with eps from the k-diffusion model; the result divided by alpha(t_end)."""
    ts = sigmas.clone()
    if ts[-1] == 0:
        ts[-1] = 0.001

    def log_alpha(t):
        return 0.5 * torch.log(1 / ((t * t) + 1))

    def alpha(t):
        return torch.exp(log_alpha(t))

    def std(t):
        return torch.sqrt(1.0 - torch.exp(2.0 * log_alpha(t)))

    def lam(t):
        return log_alpha(t) - 0.5 * torch.log(1.0 - torch.exp(2.0 * log_alpha(t)))

    def x0(x_vp, t):
        x_in = x_vp * ((t ** 2 + 1.0) ** 0.5)
        eps = (x_in - model(x_in, t.expand(x_vp.shape[0]))) / t
        return (x_vp - std(t) * eps) / alpha(t)

    def update(x, values, times, t, order, corrector):
        """One multistep UniPC-bh update to t from the history (values at times, newest last)."""
        h = lam(t) - lam(times[-1])
        ratios = [(lam(times[-(k + 1)]) - lam(times[-1])) / h for k in range(1, order)]
        diffs = [(values[-(k + 1)] - values[-1]) / r for k, r in zip(range(1, order), ratios, strict=True)]
        r_all = torch.stack(ratios + [torch.ones_like(h)])
        hh = -h
        big_b = hh if variant == "bh1" else torch.expm1(hh)
        phi = torch.expm1(hh) / hh - 1
        rows, rhs, fact = [], [], 1
        for k in range(1, order + 1):
            rows.append(r_all ** (k - 1))
            rhs.append(phi * fact / big_b)
            fact *= k + 1
            phi = phi / hh - 1 / fact
        rows, rhs = torch.stack(rows), torch.stack(rhs)
        base = std(t) / std(times[-1]) * x - alpha(t) * torch.expm1(hh) * values[-1]
        if order == 1:
            predicted = base
        else:
            rho = [0.5] if order == 2 else list(torch.linalg.solve(rows[:-1, :-1], rhs[:-1]))
            predicted = base - alpha(t) * big_b * sum(p * d for p, d in zip(rho, diffs, strict=True))
        if not corrector:
            return predicted, None
        value = x0(predicted, t)
        rho = [0.5] if order == 1 else list(torch.linalg.solve(rows, rhs))
        correction = sum((p * d for p, d in zip(rho[:-1], diffs, strict=True)), torch.zeros_like(x))
        return base - alpha(t) * big_b * (correction + rho[-1] * (value - values[-1])), value

    steps = len(ts) - 1
    order = min(3, len(ts) - 2)
    x = x / torch.sqrt(1.0 + ts[0] ** 2.0)
    values, times = [], []
    for step_index in range(steps):
        if step_index == 0:
            values, times = [x0(x, ts[0])], [ts[0]]
        elif step_index < order:  # warm-up: order = step index
            x, value = update(x, values, times, ts[step_index], step_index, True)
            values, times = values + [value], times + [ts[step_index]]
        else:  # full order, lowered near the end; the last index also takes the final, predictor-only step
            for step in range(step_index, step_index + (2 if step_index == steps - 1 else 1)):
                x, value = update(x, values, times, ts[step], min(order, steps + 1 - step), step != steps)
                times = times[1:] + [ts[step]]
                if step < steps:
                    values = values[1:] + [value]
    return x / alpha(ts[-1])


@pytest.mark.parametrize("variant", ["uni_pc", "uni_pc_bh2"])
@pytest.mark.parametrize("steps", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.float64, 1e-11)])
def test_uni_pc_is_comfyui_unipc(variant, steps, dtype, tolerance):
    reference = Reference(MeanByContext(), cfg=3.0)
    sigmas = torch.tensor(SIGMAS_VE[:steps] + [0.0], dtype=dtype)
    x = start(float(sigmas[0]), dtype=dtype)
    ours = SAMPLERS[variant](reference.guided(dtype), x.clone(), sigmas)
    expected = comfy_unipc(lambda x_, s: reference.both(x_, s)[0], x.clone(), sigmas,
                           "bh1" if variant == "uni_pc" else "bh2")
    assert (ours - expected).abs().max() < tolerance
    assert sigmas[-1] == 0  # our sampler does not change the schedule it is given (ComfyUI's does)


def test_uni_pc_ends_at_sigma_0001_not_at_the_data():
    """The last step lands at sigma 0.001: for Gaussian data the result keeps (0.001 / sigma_prev)-ish of the
    noise, and ending the schedule at 0.001 explicitly gives the same result."""
    reference = Reference(MeanByContext(), cfg=1.0)
    sigmas = torch.tensor(SIGMAS_VE, dtype=torch.float64)
    x = start(float(sigmas[0]))
    ends_at_zero = SAMPLERS["uni_pc"](reference.guided(), x.clone(), sigmas)
    explicit = sigmas.clone()
    explicit[-1] = 0.001
    assert torch.allclose(SAMPLERS["uni_pc"](reference.guided(), x.clone(), explicit), ends_at_zero,
                          rtol=0, atol=1e-12)
    assert final_sigma(SAMPLERS["uni_pc"], sigmas) == pytest.approx(0.001)
    assert final_sigma(SAMPLERS["euler"], sigmas) == 0


def test_one_step_uni_pc_takes_no_step_as_comfyui():
    """Order min(3, 1 - 1) = 0: ComfyUI evaluates the model once, returns x alpha(sigma_0) / alpha(0.001)."""
    toy = MeanByContext()
    reference = Reference(toy, cfg=2.0)
    x = start(14.614642)
    sigmas = torch.tensor([14.614642, 0.0], dtype=torch.float64)
    out = SAMPLERS["uni_pc"](reference.guided(), x.clone(), sigmas)
    scale = math.sqrt(1 + 0.001 ** 2) / math.sqrt(1 + 14.614642 ** 2)
    assert torch.allclose(out, x * scale, rtol=1e-12, atol=0)
    assert toy.calls == 1  # one guided evaluation (cond and uncond in one batch)


def test_flow_uni_pc_is_unscaled_at_its_final_sigma_0001():
    """ComfyUI's KSampler un-scales the sample at the sigma UniPC changed to 0.001: x / 0.999 on flow."""
    toy = MeanByContext(flow=True)
    reference = Reference(toy, cfg=1.0)
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64)
    noise = start(1.0)
    latent = torch.zeros_like(noise)
    ours = sample_sigmas(reference.guided(), latent, noise, sigmas, SAMPLERS["uni_pc"], seed=0)
    raw = comfy_unipc(lambda x_, s: reference.both(x_, s)[0], noise.clone(), sigmas, "bh1")
    assert torch.allclose(ours, raw / (1 - 0.001), atol=1e-10)


# ---- CFG++ samplers ----------------------------------------------------------------------------------------


def ref_dpmpp_2s_ancestral_cfg_pp(ref: Reference, x, sigmas, noises, eta=1.0):
    """ComfyUI's sample_dpmpp_2s_ancestral_cfg_pp (VE): both stages along uncond, then + denoised - uncond."""
    draws = iter(noises)
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        denoised, uncond = ref.both(x, s)
        guidance = denoised - uncond
        down, up = ve_ancestral(s, s_next, eta)
        if down == 0:
            x = x + (x - uncond) / s * (down - s)
        else:
            t, t_next = -torch.log(s), -math.log(down)
            h = t_next - t
            mid = torch.exp(-(t + h / 2))
            x_2 = (mid / s) * x - torch.expm1(-h / 2) * uncond
            _, uncond_2 = ref.both(x_2, mid)
            x = (down / s) * x - torch.expm1(-h) * uncond_2
        if s_next > 0:
            x = x + next(draws) * up
        x = x + guidance
    return x


def ref_dpmpp_2s_ancestral_rf_cfg_pp(ref: Reference, x, sigmas, noises, eta=1.0):
    """ComfyUI's sample_dpmpp_2s_ancestral_RF_cfg_pp (flow models)."""
    draws = iter(noises)
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        denoised, uncond = ref.both(x, s)
        guidance = denoised - uncond
        down = s_next * (1 + (s_next / s - 1) * eta)
        alpha_next, alpha_down = 1 - s_next, 1 - down
        renoise = (s_next ** 2 - down ** 2 * alpha_next ** 2 / alpha_down ** 2) ** 0.5
        if s_next == 0:
            x = x + (x - uncond) / s * (down - s)
        else:
            if s == 1.0:
                mid = torch.tensor(0.9999, dtype=x.dtype)
            else:
                lam, lam_down = torch.log((1 - s) / s), torch.log((1 - down) / down)
                mid = 1 / (torch.exp(lam + (lam_down - lam) / 2) + 1)
            u = mid / s * x + (1 - mid / s) * uncond
            _, uncond_2 = ref.both(u, mid)
            x = down / s * x + (1 - down / s) * uncond_2
        if s_next > 0 and eta > 0:
            x = alpha_next / alpha_down * x + next(draws) * renoise
        x = x + (1 - s_next) * guidance
    return x


def ref_dpmpp_2m_cfg_pp(ref: Reference, x, sigmas):
    """ComfyUI's sample_dpmpp_2m_cfg_pp."""
    old_uncond = None
    for i in range(len(sigmas) - 1):
        denoised, uncond = ref.both(x, sigmas[i])
        t, t_next = -torch.log(sigmas[i]), -torch.log(sigmas[i + 1])
        h = t_next - t
        if old_uncond is None or sigmas[i + 1] == 0:
            mix = -torch.exp(-h) * uncond
        else:
            r = (t - -torch.log(sigmas[i - 1])) / h
            mix = -torch.exp(-h) * uncond - torch.expm1(-h) * (1 / (2 * r)) * (denoised - old_uncond)
        x = denoised + mix + torch.exp(-h) * x
        old_uncond = uncond
    return x


def ref_res_multistep_cfg_pp(ref: Reference, x, sigmas, noises, eta):
    """ComfyUI's res_multistep(cfg_pp=True): the RES second-order multistep step along uncond."""
    draws = iter(noises)
    old, old_down = None, None
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        denoised, uncond = ref.both(x, s)
        down, up = ve_ancestral(s, s_next, eta)
        if down == 0 or old is None:
            x = denoised + (x - uncond) / s * down
        else:
            t, t_old, t_next = -math.log(s), -math.log(old_down), -math.log(down)
            t_prev = -math.log(sigmas[i - 1])
            h = t_next - t
            c2 = (t_prev - t_old) / h
            phi1 = math.expm1(-h) / -h
            phi2 = (phi1 - 1) / -h
            x = x + (denoised - uncond)
            x = math.exp(-h) * x + h * ((phi1 - phi2 / c2) * uncond + phi2 / c2 * old)
        if s_next > 0 and up > 0:
            x = x + next(draws) * up
        old, old_down = uncond, down
    return x


def ref_gradient_estimation_cfg_pp(ref: Reference, x, sigmas, gamma=2.0):
    """ComfyUI's sample_gradient_estimation(cfg_pp=True)."""
    old_d = None
    for i in range(len(sigmas) - 1):
        denoised, uncond = ref.both(x, sigmas[i])
        d = (x - uncond) / sigmas[i]
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            x = denoised + d * sigmas[i + 1]
            if i >= 1:
                x = x + (gamma - 1) * (d - old_d) * (sigmas[i + 1] - sigmas[i])
        old_d = d
    return x


SIGMAS_FLOW = [1.0, 0.86, 0.7, 0.52, 0.35, 0.2, 0.08, 0.0]


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_dpmpp_2s_ancestral_cfg_pp_is_comfyui_on_ve_and_flow_models(cfg):
    for flow, sigmas, reference_loop in ((False, SIGMAS_VE, ref_dpmpp_2s_ancestral_cfg_pp),
                                          (True, SIGMAS_FLOW, ref_dpmpp_2s_ancestral_rf_cfg_pp)):
        ref = Reference(MeanByContext(flow=flow), cfg=cfg)
        sigmas = torch.tensor(sigmas, dtype=torch.float64)
        x = start(float(sigmas[0]))
        noises = noise_list(len(sigmas), x.shape)
        ours = SAMPLERS["dpmpp_2s_ancestral_cfg_pp"](ref.guided(), x.clone(), sigmas,
                                                     noise_sampler=replay(noises))
        assert (ours - reference_loop(ref, x.clone(), sigmas, noises)).abs().max() < 1e-10, (flow, cfg)


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_dpmpp_2m_cfg_pp_and_gradient_estimation_cfg_pp_are_comfyui(cfg):
    ref = Reference(MeanByContext(), cfg=cfg)
    sigmas = torch.tensor(SIGMAS_VE, dtype=torch.float64)
    x = start(float(sigmas[0]))
    ours = SAMPLERS["dpmpp_2m_cfg_pp"](ref.guided(), x.clone(), sigmas)
    assert (ours - ref_dpmpp_2m_cfg_pp(ref, x.clone(), sigmas)).abs().max() < 1e-10
    ours = SAMPLERS["gradient_estimation_cfg_pp"](ref.guided(), x.clone(), sigmas)
    assert (ours - ref_gradient_estimation_cfg_pp(ref, x.clone(), sigmas)).abs().max() < 1e-10


@pytest.mark.parametrize("name, eta", [("res_multistep_cfg_pp", 0.0),
                                       ("res_multistep_ancestral_cfg_pp", 1.0)])
def test_res_multistep_cfg_pp_samplers_are_comfyui(name, eta):
    ref = Reference(MeanByContext(), cfg=5.0)
    sigmas = torch.tensor(SIGMAS_VE, dtype=torch.float64)
    x = start(float(sigmas[0]))
    noises = noise_list(len(sigmas), x.shape)
    ours = SAMPLERS[name](ref.guided(), x.clone(), sigmas, noise_sampler=replay(noises))
    assert (ours - ref_res_multistep_cfg_pp(ref, x.clone(), sigmas, noises, eta)).abs().max() < 1e-10


def test_cfg_pp_samplers_differ_from_their_plain_versions_under_guidance():
    ref = Reference(MeanByContext(), cfg=5.0)
    sigmas = torch.tensor(SIGMAS_VE, dtype=torch.float64)
    x = start(float(sigmas[0]))
    for plain, cfg_pp in (("dpmpp_2m", "dpmpp_2m_cfg_pp"), ("res_multistep", "res_multistep_cfg_pp"),
                          ("gradient_estimation", "gradient_estimation_cfg_pp")):
        assert (resolve_sampler(plain)(ref.guided(), x.clone(), sigmas)
                - resolve_sampler(cfg_pp)(ref.guided(), x.clone(), sigmas)).abs().max() > 1e-3, cfg_pp


# ---- SEEDS and the exponential Heun samplers ---------------------------------------------------------------


def ref_seeds_2(ref: Reference, x, sigmas, noises, eta=1.0, r=0.5, solver="phi_1", flow=False):
    """ComfyUI's sample_seeds_2 with its half-log-SNR lambda: -log sigma (VE), log((1 - sigma) / sigma)
    (flow: CONST), alpha = sigma e^lambda; a first flow sigma of 1 moved to percent_to_sigma(1e-4)."""
    if flow and sigmas[0] >= 1:
        sigmas = sigmas.clone()
        sigmas[0] = ref.toy.model_sampling.percent_to_sigma(1e-4)

    def lam(s):
        return torch.log((1 - s) / s) if flow else -torch.log(s)

    def sigma_of(lam_):
        return torch.sigmoid(-lam_) if flow else torch.exp(-lam_)

    draws = iter(noises)
    for i in range(len(sigmas) - 1):
        denoised, _ = ref.both(x, sigmas[i])
        if sigmas[i + 1] == 0:
            x = denoised
            continue
        lam_s, lam_t = lam(sigmas[i]), lam(sigmas[i + 1])
        h = lam_t - lam_s
        h_eta = h * (eta + 1)
        lam_1 = lam_s + r * h
        sigma_1 = sigma_of(lam_1)
        alpha_1, alpha_t = sigma_1 * torch.exp(lam_1), sigmas[i + 1] * torch.exp(lam_t)
        x_2 = sigma_1 / sigmas[i] * torch.exp(-r * h * eta) * x - alpha_1 * torch.expm1(-r * h_eta) * denoised
        first = torch.sqrt(-torch.expm1(-2 * r * h * eta)) * next(draws) if eta > 0 else 0
        x_2 = x_2 + first * sigma_1
        denoised_2, _ = ref.both(x_2, sigma_1)
        decay = sigmas[i + 1] / sigmas[i] * torch.exp(-h * eta)
        if solver == "phi_1":
            x = decay * x - alpha_t * torch.expm1(-h_eta) * (denoised + (denoised_2 - denoised) / (2 * r))
        else:
            b2 = (torch.expm1(-h_eta) + h_eta) / -h_eta / r
            x = decay * x - alpha_t * ((torch.expm1(-h_eta) - b2) * denoised + b2 * denoised_2)
        if eta > 0:
            segment = (r - 1) * h * eta
            path = first * torch.exp(segment) + torch.sqrt(-torch.expm1(2 * segment)) * next(draws)
            x = x + path * sigmas[i + 1]
    return x


def ref_seeds_3(ref: Reference, x, sigmas, noises, eta=1.0, r_1=1 / 3, r_2=2 / 3):
    """ComfyUI's sample_seeds_3 (VE)."""

    def phi_2(h):
        return (torch.expm1(h) - h) / h

    draws = iter(noises)
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        denoised, _ = ref.both(x, s)
        if s_next == 0:
            x = denoised
            continue
        h = -torch.log(s_next) + torch.log(s)
        h_eta = h * (eta + 1)
        sigma_1, sigma_2 = s * torch.exp(-r_1 * h), s * torch.exp(-r_2 * h)
        x_2 = sigma_1 / s * torch.exp(-r_1 * h * eta) * x - torch.expm1(-r_1 * h_eta) * denoised
        path = torch.sqrt(-torch.expm1(-2 * r_1 * h * eta)) * next(draws)
        denoised_2, _ = ref.both(x_2 + path * sigma_1, sigma_1)
        a_2 = r_2 / r_1 * phi_2(-r_2 * h_eta)
        x_3 = sigma_2 / s * torch.exp(-r_2 * h * eta) * x - ((torch.expm1(-r_2 * h_eta) - a_2) * denoised
                                                               + a_2 * denoised_2)
        segment = (r_1 - r_2) * h * eta
        path = path * torch.exp(segment) + torch.sqrt(-torch.expm1(2 * segment)) * next(draws)
        denoised_3, _ = ref.both(x_3 + path * sigma_2, sigma_2)
        b_3 = phi_2(-h_eta) / r_2
        x = s_next / s * torch.exp(-h * eta) * x - ((torch.expm1(-h_eta) - b_3) * denoised + b_3 * denoised_3)
        segment = (r_2 - 1) * h * eta
        path = path * torch.exp(segment) + torch.sqrt(-torch.expm1(2 * segment)) * next(draws)
        x = x + path * s_next
    return x


@pytest.mark.parametrize("flow", [False, True])
@pytest.mark.parametrize("name, options", [
    ("seeds_2", dict(eta=1.0, r=0.5, solver="phi_1")),
    ("exp_heun_2_x0", dict(eta=0.0, r=1.0, solver="phi_2")),
    ("exp_heun_2_x0_sde", dict(eta=1.0, r=1.0, solver="phi_2")),
])
def test_seeds_2_family_is_comfyui(name, options, flow):
    ref = Reference(MeanByContext(flow=flow), cfg=3.0)
    sigmas = torch.tensor(SIGMAS_FLOW if flow else SIGMAS_VE, dtype=torch.float64)
    x = start(float(sigmas[0]))
    noises = noise_list(2 * len(sigmas), x.shape)
    kwargs = {} if name == "exp_heun_2_x0" else {"noise_sampler": replay(noises)}
    ours = SAMPLERS[name](ref.guided(), x.clone(), sigmas, **kwargs)
    expected = ref_seeds_2(ref, x.clone(), sigmas, noises, flow=flow, **options)
    assert (ours - expected).abs().max() < 1e-9


def test_seeds_2_phi_2_and_seeds_3_are_comfyui():
    ref = Reference(MeanByContext(), cfg=3.0)
    sigmas = torch.tensor(SIGMAS_VE, dtype=torch.float64)
    x = start(float(sigmas[0]))
    noises = noise_list(3 * len(sigmas), x.shape)
    ours = SAMPLERS["seeds_2"](ref.guided(), x.clone(), sigmas, noise_sampler=replay(noises), r=0.4,
                               solver_type="phi_2")
    assert (ours - ref_seeds_2(ref, x.clone(), sigmas, noises, r=0.4, solver="phi_2")).abs().max() < 1e-10
    ours = SAMPLERS["seeds_3"](ref.guided(), x.clone(), sigmas, noise_sampler=replay(noises))
    assert (ours - ref_seeds_3(ref, x.clone(), sigmas, noises)).abs().max() < 1e-10


# ---- SA-Solver ---------------------------------------------------------------------------------------------


def sd1_sigma_at(t: float) -> float:
    """SD1's sigma at a fractional timestep, log-interpolated in its float32 table (ComfyUI's sigma(t))."""
    betas = np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=np.float64) ** 2
    alphas_cumprod = np.cumprod(1 - betas)
    log_sigmas = np.log(((1 - alphas_cumprod) / alphas_cumprod) ** 0.5).astype(np.float32)
    low, high = math.floor(t), math.ceil(t)
    return math.exp((1 - (t - low)) * log_sigmas[low] + (t - low) * log_sigmas[high])


def adams_b(lambdas: list[float], lam_s: float, lam_t: float, tau: float) -> list[float]:
    """b_j = int_s^t k e^(k (l - t)) L_j(l) dl, k = 1 + tau^2, L_j the Lagrange basis on `lambdas`, by
    40-point Gauss-Legendre quadrature (exact for these integrands to ~1e-15)."""
    nodes, weights = np.polynomial.legendre.leggauss(40)
    grid = (lam_t - lam_s) / 2 * nodes + (lam_t + lam_s) / 2
    k = 1 + tau ** 2
    kernel = (lam_t - lam_s) / 2 * weights * k * np.exp(k * (grid - lam_t))
    out = []
    for j, lam_j in enumerate(lambdas):
        basis = np.ones_like(grid)
        for m, lam_m in enumerate(lambdas):
            if m != j:
                basis *= (grid - lam_m) / (lam_j - lam_m)
        out.append(float(np.sum(kernel * basis)))
    return out


def ref_sa_solver(ref: Reference, x, sigmas, noises, pece=False, p_order=3, c_order=4):
    """ComfyUI's sample_sa_solver (VE), tau 1 between the model's sigmas at 20 % and 80 % of sampling."""
    start_sigma, end_sigma = sd1_sigma_at(0.8 * 999), sd1_sigma_at(0.2 * 999)
    sig = [float(s) for s in sigmas]
    lam = [-math.log(s) if s > 0 else math.inf for s in sig]
    draws = iter(noises)
    x_pred, h, tau, noise, preds = x, 0.0, 0.0, 0.0, []
    for i in range(len(sig) - 1):
        denoised, _ = ref.both(x_pred, sigmas[i])
        preds = (preds + [denoised])[-max(p_order, c_order):]
        p_used = min(p_order, len(preds), len(sig) - 2 - i)
        c_used = 0 if i == 0 or (sig[i + 1] == 0 and not pece) else min(c_order, len(preds), len(sig) - 1 - i)
        if c_used == 0:
            x = x_pred
        else:
            b = adams_b(lam[i - c_used + 1:i + 1], lam[i - 1], lam[i], tau)
            x = sig[i] / sig[i - 1] * math.exp(-tau ** 2 * h) * x + \
                sum(bj * d for bj, d in zip(b, preds[-c_used:], strict=True))
            if tau > 0:
                x = x + noise
            if pece:
                denoised, _ = ref.both(x, sigmas[i])
                preds[-1] = denoised
        if sig[i + 1] == 0:
            x_pred = denoised
            continue
        tau = 1.0 if start_sigma >= sig[i + 1] >= end_sigma else 0.0
        b = adams_b(lam[i - p_used + 1:i + 1], lam[i], lam[i + 1], tau)
        h = lam[i + 1] - lam[i]
        x_pred = sig[i + 1] / sig[i] * math.exp(-tau ** 2 * h) * x + \
            sum(bj * d for bj, d in zip(b, preds[-p_used:], strict=True))
        if tau > 0:
            noise = next(draws) * sig[i + 1] * math.sqrt(-math.expm1(-2 * tau ** 2 * h))
            x_pred = x_pred + noise
    return x_pred


@pytest.mark.parametrize("name", ["sa_solver", "sa_solver_pece"])
def test_sa_solver_is_comfyui_with_quadrature_coefficients(name):
    ref = Reference(MeanByContext(), cfg=3.0)
    sigmas = torch.tensor(SIGMAS_VE, dtype=torch.float64)  # 7.4 .. 0.48 lie inside tau's interval
    x = start(float(sigmas[0]))
    noises = noise_list(len(sigmas), x.shape)
    ours = SAMPLERS[name](ref.guided(), x.clone(), sigmas, noise_sampler=replay(noises))
    expected = ref_sa_solver(ref, x.clone(), sigmas, noises, pece=name.endswith("pece"))
    assert (ours - expected).abs().max() < 1e-9


def test_sa_solver_tau_interval_is_comfyui_percent_to_sigma():
    """ModelSamplingDiscrete.percent_to_sigma(p): sigma at timestep (1 - p) * 999; 0.2 -> t 799.2."""
    ms = EpsPrediction()
    assert ms.percent_to_sigma(0.2) == pytest.approx(sd1_sigma_at(799.2), rel=1e-6)
    assert ms.percent_to_sigma(0.8) == pytest.approx(sd1_sigma_at(199.8), rel=1e-6)
    assert ms.percent_to_sigma(0.0) == 999999999.9 and ms.percent_to_sigma(1.0) == 0.0
