"""Samplers against independent references: diffusers' schedulers driven with the same sigmas, the same
exact Gaussian-data denoiser and the same injected noise (float64 samples; diffusers keeps sigmas in
float32, hence the 1e-5 tolerance), and the closed-form probability-flow ODE solution of Gaussian data."""

import math

import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    HeunDiscreteScheduler,
    KDPM2AncestralDiscreteScheduler,
    KDPM2DiscreteScheduler,
    LCMScheduler,
    TCDScheduler,
    UniPCMultistepScheduler,
)
from gaussian_toy_denoiser import GaussianDenoiser, alphas_sigma, run_k_scheduler, run_vp_scheduler

from engine.sampling.guidance import CFGDenoiser, Conditioning
from engine.sampling.model_sampling import EpsPrediction
from engine.sampling.registry import SAMPLERS
from engine.sampling.samplers_multistep import _edm_to_vp_time, lagrange_coefficients
from engine.sampling.schedulers import karras

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # diffusers vs NumPy 2, not ours

SD = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)
PARITY_TOL = 1e-5  # diffusers computes with float32 sigmas; our samples stay float64


def _latent(seed: int = 0) -> torch.Tensor:
    return torch.randn(64, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _noise_list(count: int, shape, seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(count)]


def _replay(noises: list[torch.Tensor]):
    it = iter(noises)
    return lambda sigma, sigma_next: next(it)


def _generator_sampler(seed: int, shape):
    """Draws as diffusers' randn_tensor(shape, generator) does on the CPU (schedulers taking a generator)."""
    g = torch.Generator().manual_seed(seed)
    return lambda sigma, sigma_next: torch.randn(shape, generator=g, dtype=torch.float64)


def _euler_sigmas(steps: int, use_karras: bool) -> torch.Tensor:
    scheduler = EulerDiscreteScheduler(**SD, use_karras_sigmas=use_karras)
    scheduler.set_timesteps(steps)
    return scheduler.sigmas.double()


@pytest.mark.parametrize("use_karras", [False, True])
@pytest.mark.parametrize("name, scheduler_cls", [
    ("euler", EulerDiscreteScheduler), ("heun", HeunDiscreteScheduler), ("dpm2", KDPM2DiscreteScheduler),
])
def test_deterministic_k_samplers_match_diffusers(name, scheduler_cls, use_karras):
    scheduler = scheduler_cls(**SD, use_karras_sigmas=use_karras)
    scheduler.set_timesteps(12)
    sigmas = _euler_sigmas(12, use_karras)
    x = _latent() * sigmas[0]
    reference = run_k_scheduler(scheduler, GaussianDenoiser(), x.clone())
    ours = SAMPLERS[name](GaussianDenoiser(), x.clone(), sigmas)
    assert (ours - reference).abs().max() < PARITY_TOL


@pytest.mark.parametrize("name, scheduler_cls, use_karras", [
    ("euler_a", EulerAncestralDiscreteScheduler, False),
    ("dpm2_a", KDPM2AncestralDiscreteScheduler, False),
    ("dpm2_a", KDPM2AncestralDiscreteScheduler, True),
])
def test_ancestral_k_samplers_match_diffusers_with_the_same_noise(name, scheduler_cls, use_karras):
    scheduler = scheduler_cls(**SD, **({"use_karras_sigmas": True} if use_karras else {}))
    scheduler.set_timesteps(12)
    sigmas = _euler_sigmas(12, use_karras)
    x = _latent() * sigmas[0]
    reference = run_k_scheduler(scheduler, GaussianDenoiser(), x.clone(),
                                generator=torch.Generator().manual_seed(5))
    ours = SAMPLERS[name](GaussianDenoiser(), x.clone(), sigmas, noise_sampler=_generator_sampler(5, x.shape))
    assert (ours - reference).abs().max() < PARITY_TOL


@pytest.mark.parametrize("use_karras", [False, True])
@pytest.mark.parametrize("name, config, final", [
    ("dpm++2m", dict(algorithm_type="dpmsolver++", solver_order=2), "zero"),
    ("dpm++2m_sde", dict(algorithm_type="sde-dpmsolver++", solver_order=2), "zero"),
    ("uni_pc", dict(solver_type="bh1", solver_order=3), "sigma_min"),
    ("uni_pc_bh2", dict(solver_type="bh2", solver_order=3), "sigma_min"),
])
def test_multistep_samplers_match_diffusers(name, config, final, use_karras):
    """UniPC, ComfyUI's (a schedule ending at 0 ends at sigma 0.001 instead: test_comfy_samplers.py), takes
    diffusers' UniPC steps on schedules ending at sigma_min."""
    cls = UniPCMultistepScheduler if name.startswith("uni_pc") else DPMSolverMultistepScheduler
    scheduler = cls(**SD, use_karras_sigmas=use_karras, final_sigmas_type=final, **config)
    scheduler.set_timesteps(12)
    sigmas = scheduler.sigmas.double()
    x = _latent() * sigmas[0]
    noises = _noise_list(12, x.shape)
    stochastic = "sde" in name
    step_kwargs = (lambda i: {"variance_noise": noises[i]}) if stochastic else (lambda i: {})
    reference = run_vp_scheduler(scheduler, GaussianDenoiser(), x, sigmas.tolist(), step_kwargs)
    options = {"noise_sampler": _replay(noises)} if stochastic else {}
    ours = SAMPLERS[name](GaussianDenoiser(), x.clone(), sigmas, **options)
    assert (ours - reference).abs().max() < PARITY_TOL


@pytest.mark.parametrize("use_karras", [False, True])
def test_dpmpp_3m_sde_at_eta_0_matches_diffusers_third_order_dpm_solver(use_karras):
    scheduler = DPMSolverMultistepScheduler(**SD, use_karras_sigmas=use_karras, final_sigmas_type="zero",
                                            algorithm_type="dpmsolver++", solver_order=3)
    scheduler.set_timesteps(16)  # >= 15 steps: diffusers keeps third order until the last step, as we do
    sigmas = scheduler.sigmas.double()
    x = _latent() * sigmas[0]
    reference = run_vp_scheduler(scheduler, GaussianDenoiser(), x, sigmas.tolist())
    ours = SAMPLERS["dpm++3m_sde"](GaussianDenoiser(), x.clone(), sigmas, eta=0.0)
    assert (ours - reference).abs().max() < 5e-5


@pytest.mark.parametrize("eta", [0.0, 0.7])
def test_ddim_trailing_matches_diffusers_ddim_with_trailing_spacing(eta):
    scheduler = DDIMScheduler(**SD, timestep_spacing="trailing", clip_sample=False)
    scheduler.set_timesteps(10)
    sigmas = [alphas_sigma(scheduler, t) for t in scheduler.timesteps] + [0.0]
    x = _latent() * sigmas[0]
    noises = _noise_list(10, x.shape)
    reference = run_vp_scheduler(scheduler, GaussianDenoiser(), x, sigmas,
                                 lambda i: {"eta": eta, "variance_noise": noises[i]})
    ours = SAMPLERS["ddim_trailing"](GaussianDenoiser(), x.clone(), torch.tensor(sigmas, dtype=torch.float64),
                                     eta=eta, noise_sampler=_replay(noises))
    assert (ours - reference).abs().max() < PARITY_TOL


def test_ddpm_matches_diffusers_ddpm_with_the_same_noise():
    scheduler = DDPMScheduler(**SD, clip_sample=False)
    scheduler.set_timesteps(12)
    sigmas = [alphas_sigma(scheduler, t) for t in scheduler.timesteps] + [0.0]
    x = _latent() * sigmas[0]
    generator = torch.Generator().manual_seed(3)
    reference = run_vp_scheduler(scheduler, GaussianDenoiser(), x, sigmas, lambda i: {"generator": generator})
    ours = SAMPLERS["ddpm"](GaussianDenoiser(), x.clone(), torch.tensor(sigmas, dtype=torch.float64),
                            noise_sampler=_generator_sampler(3, x.shape))
    assert (ours - reference).abs().max() < PARITY_TOL


def test_lcm_matches_diffusers_lcm_without_boundary_scalings():
    # LCM's c_skip/c_out boundary condition belongs to the model; timestep_scaling=1e6 makes it the identity.
    scheduler = LCMScheduler(**SD, timestep_scaling=1e6)
    scheduler.set_timesteps(4)
    sigmas = [alphas_sigma(scheduler, t) for t in scheduler.timesteps] + [0.0]
    x = _latent() * sigmas[0]
    generator = torch.Generator().manual_seed(3)
    reference = run_vp_scheduler(scheduler, GaussianDenoiser(), x, sigmas, lambda i: {"generator": generator})
    ours = SAMPLERS["lcm"](GaussianDenoiser(), x.clone(), torch.tensor(sigmas, dtype=torch.float64),
                           noise_sampler=_generator_sampler(3, x.shape))
    assert (ours - reference).abs().max() < PARITY_TOL


@pytest.mark.parametrize("eta", [0.0, 0.3])
def test_tcd_matches_diffusers_tcd(eta):
    scheduler = TCDScheduler(**SD)
    scheduler.set_timesteps(6)
    sigmas = [alphas_sigma(scheduler, t) for t in scheduler.timesteps] + [0.0]
    x = _latent() * sigmas[0]
    generator = torch.Generator().manual_seed(3)
    reference = run_vp_scheduler(scheduler, GaussianDenoiser(), x, sigmas,
                                 lambda i: {"generator": generator, "eta": eta})
    ours = SAMPLERS["tcd"](GaussianDenoiser(), x.clone(), torch.tensor(sigmas, dtype=torch.float64), eta=eta,
                           noise_sampler=_generator_sampler(3, x.shape))
    # TCD ends at timestep 0 (sigma 0.029), where diffusers returns the VP sample sqrt(abar_0) * x.
    assert (ours * math.sqrt(float(scheduler.alphas_cumprod[0])) - reference).abs().max() < PARITY_TOL


# Max |x - exact ODE solution| after 20 Karras steps (SD1.5 sigmas, 256 samples): measured, then rounded up.
ODE_TOLERANCE_20_STEPS = {
    "euler": 0.15, "heun": 0.03, "heunpp2": 0.15, "dpm2": 0.02, "dpm++2m": 0.03, "dpm++2mv2": 0.13,
    "ipndm": 0.01, "ipndm_v": 0.01, "lms": 0.02, "deis": 0.02, "res_multistep": 0.04, "res_2s": 0.01,
    "euler_ge": 0.11, "uni_pc": 0.005, "uni_pc_bh2": 0.006, "ddim_trailing": 0.15, "dpm++2s_a": 0.02,
}


@pytest.mark.parametrize("name", sorted(ODE_TOLERANCE_20_STEPS))
def test_ode_samplers_approach_the_exact_gaussian_flow(name):
    sigmas = karras(EpsPrediction(), 20).double()
    x = _latent()[:, 0] * float(sigmas[0])
    toy = GaussianDenoiser()
    options = {"eta": 0.0} if name == "dpm++2s_a" else {}
    ours = SAMPLERS[name](toy, x.clone(), sigmas, **options)
    assert (ours - toy.ode_solution(x, float(sigmas[0]))).abs().max() < ODE_TOLERANCE_20_STEPS[name]


def test_ipndm_v_equals_ipndm_on_uniform_steps_up_to_third_order():
    # Equal steps: variable-step Adams-Bashforth = fixed AB. (zju-pi's 4th-order variable weights, which
    # ComfyUI copies, give (57, -65, 43, -11)/24 rather than AB4's (55, -59, 37, -9)/24; we keep theirs.)
    sigmas = torch.linspace(10.0, 0.0, 13, dtype=torch.float64)
    x = _latent() * 10.0
    fixed = SAMPLERS["ipndm"](GaussianDenoiser(), x.clone(), sigmas, max_order=3)
    variable = SAMPLERS["ipndm_v"](GaussianDenoiser(), x.clone(), sigmas, max_order=3)
    assert (fixed - variable).abs().max() < 1e-12


def test_ddpm_equals_euler_ancestral_given_the_same_noise():
    # The DDPM posterior in k-diffusion variables is exactly the eta = 1 ancestral Euler step.
    sigmas = karras(EpsPrediction(), 15).double()
    x = _latent() * float(sigmas[0])
    ddpm = SAMPLERS["ddpm"](GaussianDenoiser(), x.clone(), sigmas,
                            noise_sampler=_replay(_noise_list(15, x.shape)))
    euler_a = SAMPLERS["euler_a"](GaussianDenoiser(), x.clone(), sigmas,
                                  noise_sampler=_replay(_noise_list(15, x.shape)))
    assert (ddpm - euler_a).abs().max() < 1e-9


def test_lms_coefficients_integrate_polynomials_exactly():
    nodes = [3.0, 4.5, 7.0, 11.0]  # newest first, as the sampler passes them
    coeffs = lagrange_coefficients(nodes, 3.0, 1.8)
    poly = [0.3, -1.2, 0.5, 2.0]  # a cubic through the nodes is interpolated exactly
    values = [sum(c * s ** k for k, c in enumerate(poly)) for s in nodes]
    exact = sum(c * (1.8 ** (k + 1) - 3.0 ** (k + 1)) / (k + 1) for k, c in enumerate(poly))
    assert abs(sum(c * v for c, v in zip(coeffs, values, strict=True)) - exact) < 1e-10


def test_deis_coefficients_match_comfyui_riemann_sum_formula():
    """ComfyUI/zju-pi tab-DEIS: a 10000-point sum over VP time of L_j(tau) * dsigma/dtau."""
    vp_time = _edm_to_vp_time()
    nodes = [2.0, 3.1, 5.0]
    ours = lagrange_coefficients(nodes, 2.0, 1.2, warp=vp_time)
    beta_d = 2 * (math.log(0.002 ** 2 + 1) / 1e-3 - math.log(80.0 ** 2 + 1)) / (1e-3 - 1)
    beta_0 = math.log(80.0 ** 2 + 1) - 0.5 * beta_d
    beta_1 = beta_d + beta_0
    t_nodes = torch.tensor([float(vp_time(torch.tensor(s, dtype=torch.float64).numpy())) for s in nodes],
                           dtype=torch.float64)
    t_cur, t_next = float(t_nodes[0]), float(vp_time(torch.tensor(1.2, dtype=torch.float64).numpy()))
    taus = torch.linspace(t_cur, t_next, 10000, dtype=torch.float64, requires_grad=True)
    log_alpha = -0.5 * taus ** 2 * (beta_1 - beta_0) - taus * beta_0
    (d_log_alpha,) = torch.autograd.grad(log_alpha.sum(), taus)
    alpha = log_alpha.exp()
    integrand = (-0.5 * d_log_alpha / torch.sqrt(alpha * (1 - alpha))).detach()
    for j, c in enumerate(ours):
        basis = torch.ones_like(integrand)
        for k in range(len(nodes)):
            if k != j:
                basis = basis * (taus.detach() - t_nodes[k]) / (t_nodes[j] - t_nodes[k])
        reference = float((integrand * basis).sum() * (t_next - t_cur) / 10000)
        assert abs(c - reference) < 2e-3 * max(1.0, abs(reference))


class _TwoPromptDenoiser(GaussianDenoiser):
    """A toy that gives a different data mean per context value, to make cond and uncond differ."""

    def __call__(self, x, sigma, context=None, y=None, **extra):
        self.calls += 1
        mean = context[:, 0, 0].reshape(-1, *([1] * (x.ndim - 1))).to(x)
        sigma = torch.as_tensor(sigma, dtype=x.dtype).reshape(-1, *([1] * (x.ndim - 1)))
        return (self.std ** 2 * x + sigma ** 2 * mean) / (self.std ** 2 + sigma ** 2)


def _cfg(cfg: float, uncond_mean: float) -> CFGDenoiser:
    cond = Conditioning(torch.full((1, 2, 3), 0.5, dtype=torch.float64))
    uncond = Conditioning(torch.full((1, 2, 3), uncond_mean, dtype=torch.float64))
    return CFGDenoiser(_TwoPromptDenoiser(), cond, uncond, cfg)


def test_cfg_pp_reduces_to_euler_when_uncond_equals_cond():
    sigmas = karras(EpsPrediction(), 10).double()
    x = _latent() * float(sigmas[0])
    plain = SAMPLERS["euler"](_cfg(3.0, 0.5), x.clone(), sigmas)
    cfg_pp = SAMPLERS["euler_cfg_pp"](_cfg(3.0, 0.5), x.clone(), sigmas)
    assert (plain - cfg_pp).abs().max() < 1e-9
    plain_a = SAMPLERS["euler_a"](_cfg(3.0, 0.5), x.clone(), sigmas,
                                  noise_sampler=_replay(_noise_list(10, x.shape)))
    cfg_pp_a = SAMPLERS["euler_a_cfg_pp"](_cfg(3.0, 0.5), x.clone(), sigmas,
                                          noise_sampler=_replay(_noise_list(10, x.shape)))
    assert (plain_a - cfg_pp_a).abs().max() < 1e-9


def test_cfg_pp_step_renoises_with_the_unconditional_prediction():
    sigmas = torch.tensor([4.0, 1.5], dtype=torch.float64)  # one step, checked against the CFG++ formula
    x = _latent() * 4.0
    model = _cfg(2.0, -1.0)
    out = SAMPLERS["euler_cfg_pp"](model, x.clone(), sigmas)
    toy = GaussianDenoiser()
    cond_x0, uncond_x0 = toy(x, torch.tensor(4.0)), GaussianDenoiser(mean=-1.0)(x, torch.tensor(4.0))
    guided = uncond_x0 + 2.0 * (cond_x0 - uncond_x0)
    assert (out - (guided + 1.5 * (x - uncond_x0) / 4.0)).abs().max() < 1e-12


def _exact_flow_at(x, sigma_start: float, sigma_end: float) -> torch.Tensor:
    """Closed-form probability-flow ODE solution for Gaussian data from sigma_start to sigma_end."""
    toy = GaussianDenoiser()
    scale = math.sqrt(toy.std ** 2 + sigma_end ** 2) / math.sqrt(toy.std ** 2 + sigma_start ** 2)
    return toy.mean + (x - toy.mean) * scale


@pytest.mark.parametrize("steps, tolerance", [(10, 0.03), (20, 0.006)])
def test_dpm_fast_reaches_the_exact_flow_at_the_smallest_sigma_in_steps_evaluations(steps, tolerance):
    sigmas = karras(EpsPrediction(), steps).double()
    x = _latent()[:, 0] * float(sigmas[0])
    toy = GaussianDenoiser()
    ours = SAMPLERS["dpm_fast"](toy, x.clone(), sigmas)
    assert (ours - _exact_flow_at(x, float(sigmas[0]), float(sigmas[-2]))).abs().max() < tolerance
    assert toy.calls == steps


@pytest.mark.parametrize("rtol, atol, tolerance", [(0.05, 0.0078, 0.06), (0.0005, 0.00005, 0.003)])
def test_dpm_adaptive_error_follows_its_tolerances(rtol, atol, tolerance):
    sigmas = karras(EpsPrediction(), 10).double()
    x = _latent()[:, 0] * float(sigmas[0])
    ours = SAMPLERS["dpm_adaptive"](GaussianDenoiser(), x.clone(), sigmas, rtol=rtol, atol=atol)
    assert (ours - _exact_flow_at(x, float(sigmas[0]), float(sigmas[-2]))).abs().max() < tolerance
