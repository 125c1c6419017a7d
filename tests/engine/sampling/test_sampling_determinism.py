"""sample(): KSampler / KSamplerAdvanced semantics, seeding, interruption, previews; model sampling."""

import math

import numpy as np
import pytest
import torch
from diffusers import EulerDiscreteScheduler

from engine.sampling.guidance import Conditioning
from engine.sampling.model_sampling import Denoiser, EpsPrediction, FlowMatching, VPrediction
from engine.sampling.noise import prepare_noise
from engine.sampling.preview import LATENT_RGB_BIAS, LATENT_RGB_FACTORS, latent_to_rgb
from engine.sampling.registry import SAMPLER_ALIASES, SAMPLERS, resolve_sampler
from engine.sampling.sample import ksampler_sigmas, sample
from engine.sampling.schedulers import calculate_sigmas

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # diffusers vs NumPy 2, not ours

POSITIVE = Conditioning(torch.full((1, 77, 8), 0.3))
NEGATIVE = Conditioning(torch.full((1, 77, 8), -0.2))


class ToyUnet:
    """An eps-predicting 'network' that records its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, x_in, timesteps, context, y=None):
        self.calls.append({"batch": x_in.shape[0], "x_in": x_in.clone(), "timesteps": timesteps.clone()})
        return 0.2 * x_in + context.mean(dim=(1, 2)).reshape(-1, 1, 1, 1)


def _model() -> Denoiser:
    return Denoiser(ToyUnet(), EpsPrediction())


def _run(**overrides) -> torch.Tensor:
    args = dict(model=_model(), latent=torch.zeros(1, 4, 8, 8), positive=POSITIVE, negative=NEGATIVE, cfg=5.0,
                sampler="euler_a", scheduler="karras", steps=6, seed=42)
    args.update(overrides)
    return sample(**args)


def test_initial_noise_is_comfyui_prepare_noise():
    latent = torch.zeros(2, 4, 16, 16)
    generator = torch.manual_seed(1234)  # ComfyUI's literal recipe (comfy/sample.py prepare_noise)
    reference = torch.randn(latent.size(), dtype=latent.dtype, layout=latent.layout, generator=generator,
                            device="cpu")
    assert torch.equal(prepare_noise(latent, 1234), reference)


@pytest.mark.parametrize("sampler", ["euler_a", "dpm++2m_sde", "er_sde", "dpm++3m_sde", "uni_pc"])
def test_same_seed_is_bit_identical_and_another_seed_differs(sampler):
    first, second = _run(sampler=sampler), _run(sampler=sampler)
    assert torch.equal(first, second)
    assert not torch.equal(first, _run(sampler=sampler, seed=43))


def test_interrupt_aborts_within_one_step():
    class Interrupted(Exception):
        pass

    model, checks = _model(), []

    def check_interrupt():
        checks.append(1)
        if len(checks) > 3:
            raise Interrupted

    with pytest.raises(Interrupted):
        _run(model=model, sampler="heun", steps=10, check_interrupt=check_interrupt)
    assert len(model.unet_fn.calls) == 3  # three evaluations made, the fourth never started


def test_denoise_zero_returns_the_input_latent_unchanged():
    latent = torch.randn(1, 4, 8, 8)
    model = _model()
    assert torch.equal(_run(model=model, latent=latent, denoise=0.0), latent)
    assert model.unet_fn.calls == []


def test_denoise_below_one_takes_the_last_steps_of_a_longer_schedule_and_noises_by_sigma():
    ms = EpsPrediction()
    sigmas = ksampler_sigmas(ms, "normal", 10, denoise=0.4)
    assert torch.equal(sigmas, calculate_sigmas("normal", ms, 25)[-11:])
    latent, seen = torch.randn(1, 4, 8, 8), []
    _run(latent=latent, sampler="euler", scheduler="normal", steps=10, denoise=0.4,
         callback=lambda info: seen.append(info))
    expected_x = latent + prepare_noise(latent, 42) * sigmas[0]  # img2img: noise scaled by sigma
    assert torch.allclose(seen[0]["x"], expected_x, atol=1e-6)
    assert len(seen) == 10 and seen[0]["total"] == 10


def test_full_denoise_scales_noise_by_sqrt_one_plus_sigma_squared():
    seen = []
    _run(sampler="euler", callback=lambda info: seen.append(info))
    sigma_max = float(EpsPrediction().sigma_max)
    expected = prepare_noise(torch.zeros(1, 4, 8, 8), 42) * math.sqrt(1 + sigma_max ** 2)
    assert torch.allclose(seen[0]["x"], expected, rtol=1e-5)


def test_start_end_steps_and_leftover_noise_slice_the_sigmas():
    ms = EpsPrediction()
    full = calculate_sigmas("karras", ms, 10)
    leftover = ksampler_sigmas(ms, "karras", 10, end_step=6, return_with_leftover_noise=True)
    assert torch.equal(leftover, full[:7])
    ended = ksampler_sigmas(ms, "karras", 10, end_step=6)
    assert torch.equal(ended[:-1], full[:6]) and float(ended[-1]) == 0.0
    assert torch.equal(ksampler_sigmas(ms, "karras", 10, start_step=4), full[4:])
    assert len(ksampler_sigmas(ms, "karras", 10, start_step=10)) == 0
    for bad in (dict(denoise=1.5), dict(start_step=-1), dict(steps=0)):
        with pytest.raises(ValueError, match="denoise|start_step|steps"):
            ksampler_sigmas(ms, "karras", **{"steps": 10, **bad})


def test_two_advanced_stages_with_leftover_noise_equal_one_full_run():
    whole = _run(sampler="dpm++2m", steps=10)
    first = _run(sampler="dpm++2m", steps=10, end_step=4, return_with_leftover_noise=True)
    second = _run(sampler="dpm++2m", steps=10, latent=first, start_step=4, add_noise=False)
    whole_euler = _run(sampler="euler", steps=10)
    first_euler = _run(sampler="euler", steps=10, end_step=4, return_with_leftover_noise=True)
    second_euler = _run(sampler="euler", steps=10, latent=first_euler, start_step=4, add_noise=False)
    assert torch.allclose(second_euler, whole_euler, atol=1e-5)  # Euler is memoryless: exact split
    assert (second - whole).abs().max() < 0.05 * whole.abs().max()  # 2M restarts its history: close


def test_add_noise_false_starts_from_the_latent_itself():
    latent, seen = torch.randn(1, 4, 8, 8), []
    _run(latent=latent, sampler="euler", add_noise=False, callback=lambda info: seen.append(info))
    assert torch.equal(seen[0]["x"], latent)


def test_cfg_one_makes_one_batch_one_model_call_per_step():
    model = _model()
    _run(model=model, sampler="euler", steps=5, cfg=1.0)
    assert [c["batch"] for c in model.unet_fn.calls] == [1] * 5
    model = _model()
    _run(model=model, sampler="euler", steps=5, cfg=4.0)
    assert [c["batch"] for c in model.unet_fn.calls] == [2] * 5


def test_preview_gets_uint8_rgb_frames_every_step():
    frames = []
    _run(steps=4, latent=torch.zeros(1, 4, 8, 12), preview=lambda i, rgb: frames.append((i, rgb)))
    assert [i for i, _ in frames] == [0, 1, 2, 3]
    assert all(rgb.shape == (8, 12, 3) and rgb.dtype == np.uint8 for _, rgb in frames)


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_latent_to_rgb_is_comfyui_linear_projection(family):
    latent = torch.randn(4, 5, 6)
    factors = np.array(LATENT_RGB_FACTORS[family])
    rgb = np.einsum("chw,cr->hwr", latent.numpy(), factors) + LATENT_RGB_BIAS[family]
    expected = (np.clip((rgb + 1) / 2, 0, 1) * 255).astype(np.uint8)
    assert np.abs(latent_to_rgb(latent[None], family).astype(int) - expected.astype(int)).max() <= 1
    with pytest.raises(ValueError, match="accepted: sd1, sdxl, flux"):
        latent_to_rgb(latent, "sd3")
    with pytest.raises(ValueError, match=r"needs a \(16, H, W\) latent for 'flux'"):
        latent_to_rgb(latent, "flux")


def test_sampler_names_resolve_case_insensitively_with_comfyui_aliases():
    assert resolve_sampler("Euler_A") is SAMPLERS["euler_a"]
    assert resolve_sampler("DPMPP_2M_SDE") is SAMPLERS["dpm++2m_sde"]
    assert all(resolve_sampler(alias) is SAMPLERS[name] for alias, name in SAMPLER_ALIASES.items())
    with pytest.raises(ValueError, match=r"unknown sampler 'eulr'; accepted: euler, euler_a, heun"):
        resolve_sampler("eulr")


def test_model_sampling_matches_diffusers_tables_and_v_prediction():
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    ms, vs = EpsPrediction(), VPrediction()
    sigmas = torch.tensor([0.05, 0.7, 3.0, 12.0])
    reference_t = scheduler._sigma_to_t(sigmas.numpy(), np.log(scheduler.sigmas[:-1].flip(0).numpy()))
    assert np.allclose(ms.sigma_to_t(sigmas).numpy(), reference_t, atol=2e-3)
    assert torch.allclose(ms.t_to_sigma(ms.sigma_to_t(sigmas)), sigmas, rtol=1e-4)
    x, out = torch.randn(4, 4, 2, 2), torch.randn(4, 4, 2, 2)
    s = sigmas.reshape(-1, 1, 1, 1)
    diffusers_v = out * (-s / (s ** 2 + 1) ** 0.5) + x / (s ** 2 + 1)  # EulerDiscrete, v_prediction
    assert torch.allclose(vs.calculate_denoised(sigmas, out, x), diffusers_v, atol=1e-6)
    assert torch.allclose(ms.calculate_denoised(sigmas, out, x), x - s * out)


def test_denoiser_feeds_scaled_input_and_nearest_timestep():
    model = _model()
    x, sigma = torch.randn(1, 4, 8, 8), torch.tensor([2.5])
    model(x, sigma, context=POSITIVE.context)
    call = model.unet_fn.calls[0]
    assert torch.allclose(call["x_in"], x / math.sqrt(2.5 ** 2 + 1))
    table = EpsPrediction().sigmas
    assert int(call["timesteps"][0]) == int((table.log() - math.log(2.5)).abs().argmin())


def test_flow_matching_shift_and_noise_scaling_round_trip():
    flow = FlowMatching(shift=3.0)
    t = torch.tensor([250.0, 500.0, 900.0])
    s = t / 1000
    assert torch.allclose(flow.t_to_sigma(t), 3.0 * s / (1 + 2.0 * s))
    assert torch.allclose(flow.sigma_to_t(flow.t_to_sigma(t)), t, rtol=1e-5)
    latent, noise, sigma = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3), torch.tensor([0.3, 0.6])
    noised = flow.noise_scaling(sigma, noise, latent)
    assert torch.allclose(noised[0], 0.3 * noise[0] + 0.7 * latent[0])  # x = sigma noise + (1 - sigma) x0
    velocity = noise - latent  # rectified flow target: x0 = x - sigma v
    assert torch.allclose(flow.calculate_denoised(sigma, velocity, noised), latent, atol=1e-5)


SD_CPP_SAMPLERS = [
    "euler", "euler_a", "heun", "dpm2", "dpm++2s_a", "dpm++2m", "dpm++2mv2", "ipndm", "ipndm_v", "lcm",
    "ddim_trailing", "tcd", "res_multistep", "res_2s", "er_sde", "euler_cfg_pp", "euler_a_cfg_pp", "euler_ge",
    "dpm++2m_sde", "dpm++2m_sde_bt", "lms",
]


def test_every_stable_diffusion_cpp_sampler_name_is_registered():
    assert all(resolve_sampler(name) is SAMPLERS[name] for name in SD_CPP_SAMPLERS)


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_every_sampler_runs_a_guided_job_with_one_callback_per_step(name):
    seen = []
    out = _run(sampler=name, steps=4, scheduler="karras", callback=lambda info: seen.append(info["i"]))
    assert out.shape == (1, 4, 8, 8) and bool(torch.isfinite(out).all())
    if name not in ("dpm_fast", "dpm_adaptive"):  # these pick their own steps
        assert seen == [0, 1, 2, 3]
