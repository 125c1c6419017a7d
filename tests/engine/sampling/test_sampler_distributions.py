"""Stochastic samplers against the closed form: with the exact denoiser of Gaussian data N(0.5, 0.5^2),
starting from the exact noisy marginal, the samples must follow N(0.5, 0.5^2).

20000 scalar samples (standard error of the mean 0.0035); 100 Karras steps. Tolerances: mean within
0.015, standard deviation within 0.025 (first-order ancestral steps shrink the variance by ~0.02 at 100
steps, which is discretisation error, not noise)."""

import pytest
import torch
from gaussian_toy_denoiser import DATA_MEAN, DATA_STD, GaussianDenoiser

from engine.sampling.model_sampling import EpsPrediction
from engine.sampling.noise import default_noise_sampler
from engine.sampling.registry import SAMPLERS
from engine.sampling.schedulers import karras

STOCHASTIC = {
    "euler_a": {}, "dpm2_a": {}, "dpm++2s_a": {}, "dpm++sde": {}, "dpm++2m_sde": {}, "dpm++2m_sde_heun": {},
    "dpm++3m_sde": {}, "er_sde": {}, "ddpm": {}, "euler_a_cfg_pp": {}, "ddim_trailing": {"eta": 1.0},
    "res_2s": {"eta": 1.0}, "res_multistep_ancestral": {},
}


@pytest.mark.parametrize("name", sorted(STOCHASTIC))
def test_stochastic_sampler_reproduces_the_gaussian_data_distribution(name):
    sigmas = karras(EpsPrediction(), 100).double()
    g = torch.Generator().manual_seed(0)
    marginal_std = (float(sigmas[0]) ** 2 + DATA_STD ** 2) ** 0.5
    x = DATA_MEAN + torch.randn(20000, 1, generator=g, dtype=torch.float64) * marginal_std
    out = SAMPLERS[name](GaussianDenoiser(), x, sigmas, noise_sampler=default_noise_sampler(x, seed=1),
                         **STOCHASTIC[name])
    assert abs(float(out.mean()) - DATA_MEAN) < 0.015
    assert abs(float(out.std()) - DATA_STD) < 0.025
