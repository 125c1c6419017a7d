"""The txt2img workflow runs with every sampler and scheduler the KSampler lists, deterministically; the lists
name each one once, under ComfyUI's name, and every other spelling is still accepted.

It runs the default workflow (loader, two text encodes, empty latent, KSampler, VAE decode) on the embedded
model through the executor, 3 steps each; a second, independent executor repeats every run, and the images
must be bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.settings import load_settings
from nodes.sampling import KSampler
from tests.engine.sampling.comfy_lists import COMFY_SAMPLER_NAMES, COMFY_SCHEDULER_NAMES
from tools.embedded_generate import EmbeddedGenerator

SAMPLER_NAMES = tuple(KSampler.input_named("sampler_name").current_choices())
SCHEDULER_NAMES = tuple(KSampler.input_named("scheduler").current_choices())
PROMPT = "a large red circle in the center on a white background"


@pytest.fixture(scope="module")
def generators(tmp_path_factory):
    settings = load_settings(output_dir=tmp_path_factory.mktemp("out"))
    return EmbeddedGenerator(settings, steps=3), EmbeddedGenerator(settings, steps=3)


def render_twice(generators, sampler: str, scheduler: str) -> tuple[np.ndarray, np.ndarray]:
    images = []
    for generator in generators:
        widgets = generator.workflow.nodes[generator.sampler_id].widgets
        widgets.update(sampler_name=sampler, scheduler=scheduler)
        images.append(np.asarray(generator.generate(PROMPT, seed=7)))
    return images[0], images[1]


def test_the_ksampler_accepts_every_stable_diffusion_cpp_and_comfyui_name_and_lists_comfyuis_once():
    sd_cpp = {"euler", "euler_a", "heun", "dpm2", "dpm++2s_a", "dpm++2m", "dpm++2mv2", "ipndm", "ipndm_v",
              "lcm", "ddim_trailing", "tcd", "res_multistep", "res_2s", "er_sde", "euler_cfg_pp",
              "euler_a_cfg_pp",
              "euler_ge", "dpm++2m_sde", "dpm++2m_sde_bt", "lms"}
    comfy = {"euler_ancestral", "dpm_2", "dpm_2_ancestral", "dpmpp_2s_ancestral", "dpmpp_2m", "dpmpp_sde",
             "dpmpp_2m_sde", "dpmpp_3m_sde", "ddpm", "deis", "uni_pc", "uni_pc_bh2", "lcm", "ipndm"}
    schedulers = {"normal", "discrete", "karras", "exponential", "ays", "gits", "sgm_uniform", "simple",
                  "smoothstep", "kl_optimal", "lcm", "beta", "ddim_uniform", "linear_quadratic"}
    sampler_input, scheduler_input = KSampler.input_named("sampler_name"), KSampler.input_named("scheduler")
    assert all(sampler_input.check_value(name) is None for name in sd_cpp | comfy)
    assert all(scheduler_input.check_value(name) is None for name in schedulers)
    assert sampler_input.check_value("dpm++9m") is not None
    assert comfy <= set(SAMPLER_NAMES)  # listed under ComfyUI's names ...
    assert not {"euler_a", "dpm++2m", "dpm2"} & set(SAMPLER_NAMES)  # ... not sd.cpp's aliases too
    assert len(SAMPLER_NAMES) == len(set(SAMPLER_NAMES))
    assert SCHEDULER_NAMES[:9] == ("normal", "karras", "exponential", "sgm_uniform", "simple", "ddim_uniform",
                                   "beta", "linear_quadratic", "kl_optimal")  # ComfyUI's, in its order
    assert "discrete" not in SCHEDULER_NAMES  # sd.cpp's name of "normal"
    assert set(COMFY_SAMPLER_NAMES) <= set(SAMPLER_NAMES)  # current ComfyUI's KSampler lists
    assert set(COMFY_SCHEDULER_NAMES) <= set(SCHEDULER_NAMES)


@pytest.mark.parametrize("sampler", SAMPLER_NAMES)
def test_every_sampler_runs_the_workflow_deterministically(generators, sampler):
    first, second = render_twice(generators, sampler, "karras")
    assert first.shape == (128, 128, 3)
    assert np.array_equal(first, second)


@pytest.mark.parametrize("scheduler", SCHEDULER_NAMES)
def test_every_scheduler_runs_the_workflow_deterministically(generators, scheduler):
    first, second = render_twice(generators, "euler", scheduler)
    assert first.shape == (128, 128, 3)
    assert np.array_equal(first, second)


def test_different_seeds_give_different_images(generators):
    generator = generators[0]
    generator.workflow.nodes[generator.sampler_id].widgets.update(sampler_name="euler_a", scheduler="normal")
    assert not np.array_equal(np.asarray(generator.generate(PROMPT, seed=1)),
                              np.asarray(generator.generate(PROMPT, seed=2)))
