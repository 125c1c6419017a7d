"""The model patches of the sampler: RescaleCFG against diffusers' rescale_noise_cfg, Perp-Neg and DualCFG
against their formulas written out here, the cfg function hook, and ModelSamplingDiscrete's predictions
against diffusers' schedulers (v-prediction Euler steps, LCM's timesteps and boundary scalings, zero
terminal SNR)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import EulerDiscreteScheduler, LCMScheduler
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg
from diffusers.schedulers.scheduling_ddim import rescale_zero_terminal_snr

from engine.models.bundles import DiffusionModel
from engine.sampling.guidance import (
    CFGDenoiser,
    CfgInputs,
    Conditioning,
    DualCFGDenoiser,
    PerpNegCfg,
    PerpNegDenoiser,
    RescaleCfg,
)
from engine.sampling.model_sampling import (
    Denoiser,
    EpsPrediction,
    FluxFlowMatching,
    LCMPrediction,
    X0Prediction,
    scaled_linear_betas,
)
from engine.sampling.samplers import sample_euler
from nodes.model_patches import ModelSamplingDiscrete, RescaleCFG
from tests.engine.sampling.conditioning_helpers import Recording, prompt, tiny_unet


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def sd_betas() -> torch.Tensor:
    return scaled_linear_betas()  # float64, SD's scaled-linear schedule


def test_rescale_cfg_is_diffusers_rescale_noise_cfg_in_v_space():
    x, cond, uncond = rand(2, 4, 8, 8) * 4, rand(2, 4, 8, 8, seed=1), rand(2, 4, 8, 8, seed=2)
    sigma, scale, multiplier = torch.tensor([3.0, 0.5]), 7.5, 0.7
    ours = RescaleCfg(multiplier)(CfgInputs(cond, uncond, scale, x, sigma, None))
    s = sigma.reshape(-1, 1, 1, 1).double()
    alpha, sigma_vp = 1 / (1 + s ** 2).sqrt(), s / (1 + s ** 2).sqrt()  # VP scalings of the VE sigma
    x_vp = x.double() * alpha

    def velocity(x0: torch.Tensor) -> torch.Tensor:  # v = alpha eps - sigma x0 (Salimans & Ho 2022)
        eps = (x.double() - x0.double()) / s
        return alpha * eps - sigma_vp * x0.double()

    v_cond, v_uncond = velocity(cond), velocity(uncond)
    v = rescale_noise_cfg(v_uncond + scale * (v_cond - v_uncond), v_cond, guidance_rescale=multiplier)
    expected = alpha * x_vp - sigma_vp * v  # x0 from v
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-5)


def comfy_perp_neg(pos: np.ndarray, neg: np.ndarray, empty: np.ndarray, neg_scale: float, scale: float):
    p, n = pos - empty, neg - empty
    perpendicular = n - (np.sum(n * p) / np.linalg.norm(p) ** 2) * p
    return empty + scale * (p - perpendicular * neg_scale)


def test_perp_neg_guider_batches_three_prompts_and_mixes_them_by_its_formula():
    recorder = Recording()
    x, sigma = rand(2, 4, 8, 8), torch.tensor([2.0, 2.0])
    guided = PerpNegDenoiser(recorder, Conditioning(prompt(1.0)), Conditioning(prompt(-1.0, seed=1)),
                             Conditioning(prompt(0.0, seed=2)), cfg_scale=6.0, neg_scale=1.5)
    out = guided(x, sigma)
    assert [c["shape"][0] for c in recorder.calls] == [6]  # positive, negative and empty in one call
    predict = Recording()
    pos, neg, empty = (predict(x, sigma, context=p.repeat(2, 1, 1)).numpy()
                       for p in (prompt(1.0), prompt(-1.0, seed=1), prompt(0.0, seed=2)))
    np.testing.assert_allclose(out.numpy(), comfy_perp_neg(pos, neg, empty, 1.5, 6.0), rtol=1e-5, atol=1e-5)
    recorder.calls.clear()
    sides = (Conditioning(prompt(1.0)), Conditioning(prompt(-1.0)), Conditioning(prompt(0.0)))
    PerpNegDenoiser(recorder, *sides, cfg_scale=1.0, neg_scale=0.0)(x, sigma)
    assert [c["shape"][0] for c in recorder.calls] == [2]  # ComfyUI's shortcut: the positive prompt alone


@pytest.mark.parametrize("nested", [False, True])
def test_dual_cfg_guider_follows_comfyuis_regular_and_nested_formulas(nested):
    recorder = Recording()
    x, sigma = rand(1, 4, 8, 8), torch.tensor([1.5])
    prompts = [prompt(1.0), prompt(0.3, seed=1), prompt(-1.0, seed=2)]
    guided = DualCFGDenoiser(recorder, *(Conditioning(p) for p in prompts), cfg_conds=3.0,
                             cfg_cond2_negative=5.0, nested=nested)
    out = guided(x, sigma)
    cond1, cond2, negative = (Recording()(x, sigma, context=p) for p in prompts)
    if nested:
        expected = negative + 5.0 * ((cond2 + 3.0 * (cond1 - cond2)) - negative)
    else:
        expected = negative + 5.0 * (cond2 - negative) + (cond1 - cond2) * 3.0
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert [c["shape"][0] for c in recorder.calls] == [3]


def test_dual_cfg_at_cfg_one_skips_the_prompts_comfyui_skips():
    recorder = Recording()
    x, sigma = rand(1, 4, 8, 8), torch.tensor([1.5])
    prompts = [Conditioning(prompt(1.0)), Conditioning(prompt(0.3)), Conditioning(prompt(-1.0))]
    out = DualCFGDenoiser(recorder, *prompts, cfg_conds=1.0, cfg_cond2_negative=1.0)(x, sigma)
    assert [c["shape"][0] for c in recorder.calls] == [1]
    torch.testing.assert_close(out, Recording()(x, sigma, context=prompt(1.0)))


def test_a_models_cfg_function_replaces_the_mix_and_sees_zeros_where_the_negative_did_not_run():
    seen = []

    def cfg_function(inputs: CfgInputs) -> torch.Tensor:
        seen.append(inputs)
        return inputs.cond_denoised * 0 + 42.0

    model = Recording()
    model.cfg_function = cfg_function
    x, sigma = rand(1, 4, 8, 8), torch.tensor([1.0])
    guided = CFGDenoiser(model, Conditioning(prompt(1.0)), Conditioning(prompt(0.0)), 7.0)
    assert torch.all(guided(x, sigma) == 42)
    assert seen[-1].cond_scale == 7.0 and seen[-1].model is model and torch.equal(seen[-1].x, x)
    CFGDenoiser(model, Conditioning(prompt(1.0)), Conditioning(prompt(0.0)), 1.0)(x, sigma)
    assert torch.equal(seen[-1].uncond_denoised, torch.zeros_like(x))


def test_perp_neg_model_patch_predicts_the_empty_prompt_resolved_by_the_model():
    empty = [[prompt(0.0, seed=5), {}]]
    resolved = []

    def resolve(conditioning, width, height):
        resolved.append((width, height))
        return [Conditioning(context) for context, _ in conditioning]

    model = Denoiser(lambda x, t, context, y=None: x * 0 + context.mean(), EpsPrediction(), resolve=resolve)
    x, sigma = rand(1, 4, 8, 6), torch.tensor([2.0])
    cond, uncond = rand(1, 4, 8, 6, seed=1), rand(1, 4, 8, 6, seed=2)
    out = PerpNegCfg(empty, neg_scale=0.8)(CfgInputs(cond, uncond, 5.0, x, sigma, model))
    empty_x0 = model(x, sigma, context=prompt(0.0, seed=5))
    expected = comfy_perp_neg(cond.numpy(), uncond.numpy(), empty_x0.numpy(), 0.8, 5.0)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert resolved == [(48, 64)]


def tiny_model() -> DiffusionModel:
    return DiffusionModel(unet=tiny_unet(), model_sampling=EpsPrediction(), family="sd1", latent_channels=4,
                          latent_scale=1.0, latent_shift=0.0, compute_device="cpu")


def test_v_prediction_euler_steps_match_diffusers_euler_scheduler():
    model = tiny_model()
    (patched,) = ModelSamplingDiscrete().run(None, model, "v_prediction", False)
    assert isinstance(model.model_sampling, EpsPrediction) and model.options == {}  # the input is untouched
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       prediction_type="v_prediction")
    scheduler.set_timesteps(4)  # timesteps 999, 666, 333, 0: table entries, as our quantised timesteps
    context = prompt(0.2)
    x = rand(1, 4, 8, 8) * float(scheduler.sigmas[0])
    with torch.no_grad():
        denoiser = patched.denoiser()
        ours = sample_euler(lambda x, s: denoiser(x, s, context=context), x.clone(), scheduler.sigmas)
        reference = x.clone()
        for t in scheduler.timesteps:
            out = model.unet(scheduler.scale_model_input(reference, t), t.reshape(1), context)
            reference = scheduler.step(out, t, reference).prev_sample
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


def test_lcm_sampling_has_lcms_50_timesteps_and_comfyuis_boundary_condition():
    sampling = LCMPrediction()
    scheduler = LCMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    scheduler.set_timesteps(50, original_inference_steps=50)
    assert sampling.timestep(sampling.sigmas).long().tolist() == sorted(scheduler.timesteps.tolist())
    full = EpsPrediction()
    torch.testing.assert_close(sampling.sigmas, full.sigmas[19::20])
    torch.testing.assert_close(sampling.t_to_sigma(torch.tensor([999.0, 19.0])), full.sigmas[[999, 19]])
    x, output = rand(2, 4, 4, 4), rand(2, 4, 4, 4, seed=1)
    sigma = sampling.sigmas[[30, 7]]
    denoised = sampling.calculate_denoised(sigma, output, x)
    for i, t in enumerate(sampling.timestep(sigma).long().tolist()):
        c_skip, c_out = scheduler.get_scalings_for_boundary_condition_discrete(t)
        x0 = x[i] - output[i] * sigma[i]  # eps parametrisation on the VE latent, as ComfyUI's LCM
        torch.testing.assert_close(denoised[i], c_out * x0 + c_skip * x[i])
    assert sampling.percent_to_sigma(0.5) == pytest.approx(float(sampling.t_to_sigma(torch.tensor(499.5))))


def test_x0_sampling_takes_the_output_as_the_clean_sample():
    x, output = rand(1, 4, 4, 4), rand(1, 4, 4, 4, seed=1)
    assert torch.equal(X0Prediction().calculate_denoised(torch.tensor([3.0]), output, x), output)


def test_zsnr_sigmas_are_diffusers_zero_terminal_snr_schedule_with_comfyuis_last_value():
    sampling = EpsPrediction(zsnr=True)
    alphas_cumprod = torch.cumprod(1 - rescale_zero_terminal_snr(sd_betas()), dim=0)
    expected = ((1 - alphas_cumprod) / alphas_cumprod).sqrt()
    torch.testing.assert_close(sampling.sigmas[:-1].double(), expected[:-1], rtol=1e-5, atol=0)
    assert alphas_cumprod[-1] == 0 and sampling.sigmas[-1] == pytest.approx(
        math.sqrt((1 - 4.8973451890853435e-08) / 4.8973451890853435e-08), rel=1e-6)
    (patched,) = ModelSamplingDiscrete().run(None, tiny_model(), "eps", True)
    assert patched.model_sampling.zsnr and float(patched.model_sampling.sigma_max) > 4000


def test_model_patch_nodes_refuse_flow_models_and_set_the_cfg_function():
    (patched,) = RescaleCFG().run(None, tiny_model(), 0.5)
    assert patched.denoiser().cfg_function == RescaleCfg(0.5)
    flow = tiny_model()
    flow.model_sampling = FluxFlowMatching()
    with pytest.raises(ValueError, match="rectified flow"):
        ModelSamplingDiscrete().run(None, flow, "v_prediction", False)
