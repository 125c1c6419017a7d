"""Schedulers against diffusers (same SD1.5 scaled-linear table) and against closed forms."""

import math

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler, LCMScheduler

from engine.sampling.model_sampling import EpsPrediction
from engine.sampling.schedule_tables import GITS_NOISE_LEVELS_1_20
from engine.sampling.schedulers import (
    AYS_NOISE_LEVELS,
    SCHEDULERS,
    beta_ppf,
    calculate_sigmas,
    custom,
    resolve_scheduler,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # diffusers vs NumPy 2, not ours

SD = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)
MS = EpsPrediction()
TABLE = MS.sigmas.double().numpy()


def _diffusers_euler_sigmas(steps: int, **config) -> np.ndarray:
    scheduler = EulerDiscreteScheduler(**SD, **config)
    scheduler.set_timesteps(steps)
    return scheduler.sigmas.double().numpy()


def test_sigma_table_matches_diffusers_alphas_cumprod():
    alphas_cumprod = EulerDiscreteScheduler(**SD).alphas_cumprod
    reference = (1 - alphas_cumprod) / alphas_cumprod
    assert np.allclose(TABLE, reference.double().sqrt().numpy(), rtol=2e-5)


@pytest.mark.parametrize("steps", [5, 10, 30])
@pytest.mark.parametrize("name, config", [("karras", {"use_karras_sigmas": True}),
                                          ("exponential", {"use_exponential_sigmas": True})])
def test_karras_and_exponential_match_diffusers(name, config, steps):
    ours = calculate_sigmas(name, MS, steps).double().numpy()
    assert np.allclose(ours, _diffusers_euler_sigmas(steps, **config), rtol=1e-5, atol=1e-6)


def test_normal_and_discrete_match_diffusers_linspace_timesteps():
    # 10 steps: diffusers' linspace(0, 999, 10) hits integer timesteps, so its sigma interpolation is exact.
    reference = _diffusers_euler_sigmas(10)
    for name in ("normal", "discrete"):
        assert np.allclose(calculate_sigmas(name, MS, 10).double().numpy(), reference, rtol=1e-5, atol=1e-6)


def test_ddim_uniform_matches_diffusers_leading_ddim_timesteps():
    scheduler = DDIMScheduler(**SD, timestep_spacing="leading", steps_offset=1)
    scheduler.set_timesteps(20)
    reference = np.append(TABLE[scheduler.timesteps.numpy()], 0.0)
    assert np.allclose(calculate_sigmas("ddim_uniform", MS, 20).double().numpy(), reference, rtol=1e-6)


@pytest.mark.parametrize("steps", [4, 6, 8])
def test_lcm_matches_diffusers_lcm_timesteps(steps):
    scheduler = LCMScheduler(**SD)
    scheduler.set_timesteps(steps)
    reference = np.append(TABLE[scheduler.timesteps.numpy()], 0.0)
    assert np.allclose(calculate_sigmas("lcm", MS, steps).double().numpy(), reference, rtol=1e-6)


def _log_interp_table(timesteps: np.ndarray) -> np.ndarray:
    """Sigma at fractional timesteps, linear in log sigma between table entries (numpy reference)."""
    return np.exp(np.interp(timesteps, np.arange(len(TABLE)), np.log(TABLE)))


def test_sgm_uniform_simple_and_smoothstep_match_their_closed_forms():
    n = 7
    sgm = np.append(_log_interp_table(np.linspace(999, 0, n + 1)[:-1]), 0.0)
    simple = np.append([TABLE[-(1 + int(i * 1000 / n))] for i in range(n)], 0.0)
    u = 1 - np.arange(n) / n
    smooth = np.append(TABLE[np.round(u * u * (3 - 2 * u) * 999).astype(int)], 0.0)
    for name, reference in (("sgm_uniform", sgm), ("simple", simple), ("smoothstep", smooth)):
        assert np.allclose(calculate_sigmas(name, MS, n).double().numpy(), reference, rtol=1e-5), name


def test_beta_ppf_matches_closed_forms():
    for p in (0.01, 0.2, 0.5, 0.77, 0.99):
        assert abs(beta_ppf(p, 0.5, 0.5) - math.sin(math.pi * p / 2) ** 2) < 1e-10  # arcsine law
        assert abs(beta_ppf(p, 1.0, 1.0) - p) < 1e-10
        assert abs(beta_ppf(p, 2.0, 1.0) - math.sqrt(p)) < 1e-10
        assert abs(beta_ppf(p, 0.6, 0.6) + beta_ppf(1 - p, 0.6, 0.6) - 1.0) < 1e-10  # symmetry


def test_beta_scheduler_picks_table_sigmas_at_beta_quantiles():
    n = 10
    timesteps = [round(beta_ppf(1 - i / n, 0.6, 0.6) * 999) for i in range(n)]
    reference = np.append(TABLE[timesteps], 0.0)
    assert np.allclose(calculate_sigmas("beta", MS, n).double().numpy(), reference, rtol=1e-6)


def test_kl_optimal_is_uniform_in_arctan_sigma():
    sigmas = calculate_sigmas("kl_optimal", MS, 12).double().numpy()
    angles = np.arctan(sigmas[:-1])
    assert np.allclose(np.diff(angles), np.diff(angles)[0], atol=1e-6)
    assert np.isclose(sigmas[0], TABLE[-1], rtol=1e-5) and np.isclose(sigmas[-2], TABLE[0], rtol=1e-5)


def _loglinear(levels, num):
    xs, ys = np.linspace(0, 1, len(levels)), np.log(levels[::-1])
    return np.exp(np.interp(np.linspace(0, 1, num), xs, ys))[::-1]


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_ays_uses_the_published_levels_and_loglinear_resampling(family):
    levels = np.array(AYS_NOISE_LEVELS[family])
    assert np.allclose(calculate_sigmas("ays", MS, 10, family=family).numpy(), np.append(levels[:-1], 0.0),
                       rtol=1e-6)
    reference = _loglinear(levels, 26)
    reference[-1] = 0.0
    assert np.allclose(calculate_sigmas("ays", MS, 25, family=family).numpy(), reference, rtol=1e-5)


def test_gits_uses_the_table_row_then_loglinear_beyond_20_steps():
    row = np.array(GITS_NOISE_LEVELS_1_20[10 - 2])
    assert np.allclose(calculate_sigmas("gits", MS, 10).numpy(), np.append(row[:-1], 0.0), rtol=1e-6)
    reference = _loglinear(np.array(GITS_NOISE_LEVELS_1_20[-1]), 31)
    reference[-1] = 0.0
    assert np.allclose(calculate_sigmas("gits", MS, 30).numpy(), reference, rtol=1e-5)
    assert all(len(r) == n + 1 for n, r in zip(range(2, 21), GITS_NOISE_LEVELS_1_20, strict=True))


def test_linear_quadratic_is_linear_to_the_threshold_then_quadratic_to_zero():
    n, sigma_max = 10, float(TABLE[-1])
    sigmas = calculate_sigmas("linear_quadratic", MS, n).double().numpy()
    linear = sigma_max * (1 - np.arange(6) * 0.025 / 5)  # continuous into the quadratic part at step 5
    assert np.allclose(sigmas[:6], linear, rtol=1e-6)
    second_difference = np.diff(sigmas[5:], 2)
    assert np.allclose(second_difference, second_difference[0], atol=1e-4)
    assert sigmas[-1] == 0.0


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
@pytest.mark.parametrize("steps", [2, 9, 25])
def test_every_scheduler_descends_to_zero(name, steps):
    sigmas = calculate_sigmas(name, MS, steps)
    assert sigmas.dtype == torch.float32 and float(sigmas[-1]) == 0.0
    assert bool((sigmas[:-1] > sigmas[1:]).all()) and bool((sigmas >= 0).all())
    assert len(sigmas) == steps + 1 or name == "beta"


def test_custom_sigmas_are_validated_and_get_a_trailing_zero():
    assert custom([10.0, 3.0, 0.5]).tolist() == [10.0, 3.0, 0.5, 0.0]
    assert calculate_sigmas("custom", MS, 1, custom_sigmas=[2.0, 0.0]).tolist() == [2.0, 0.0]
    for bad, message in (([1.0, 3.0, 0.0], "descending"), ([3.0, -1.0], ">= 0"), ([], "empty")):
        with pytest.raises(ValueError, match=message):
            custom(bad)
    with pytest.raises(ValueError, match="custom_sigmas"):
        calculate_sigmas("custom", MS, 5)


def test_unknown_scheduler_names_the_accepted_ones():
    with pytest.raises(ValueError, match=r"unknown scheduler 'karas'; accepted: normal, discrete, karras"):
        resolve_scheduler("karas")
    assert resolve_scheduler(" Karras ") is SCHEDULERS["karras"]
