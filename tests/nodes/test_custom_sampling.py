"""The custom-sampling nodes on the embedded model: assembled from NOISE, GUIDER, SAMPLER and SIGMAS they give
the KSampler's latents bit for bit, keep ComfyUI's edge cases (no sigmas, one sigma, denoise < 1, split
schedules), and a ComfyUI API prompt built from them imports and runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import telemetry
from engine.graph.comfy import from_comfy_api
from engine.graph.document import Workflow
from engine.graph.executor import Executor
from engine.graph.spec import RunContext
from engine.sampling.noise import EmptyNoise, SeededNoise, prepare_noise
from engine.sampling.registry import SamplerChoice
from engine.sampling.sample import ksampler_sigmas
from engine.sampling.schedulers import calculate_sigmas
from engine.settings import load_settings, resources_dir
from nodes import custom_sampling as cs
from nodes.conditioning import ConditioningZeroOut, FluxGuidance
from nodes.latent import EmptySD3LatentImage
from nodes.registry import default_registry
from nodes.sampling import KSampler, KSamplerAdvanced

sys.path.insert(0, str(Path(__file__).parent))
from capture_node import Capture  # noqa: E402

SEED = 1234
STEPS = 4
SIZE = 64
KSAMPLER_RUNS: dict[tuple, torch.Tensor] = {}


class Recorder:
    """A RunContext that records progress and previews."""

    def __init__(self) -> None:
        self.progress: list[tuple[int, int]] = []
        self.previews = 0
        self.ctx = RunContext("test", report_progress=lambda v, m: self.progress.append((v, m)),
                              report_preview=self._preview)

    def _preview(self, image: Any) -> None:
        self.previews += 1


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory):
    return load_settings(output_dir=tmp_path_factory.mktemp("out"))


@pytest.fixture(scope="module")
def embedded(settings) -> dict[str, Any]:
    """The default workflow's model, prompts and empty latent, taken from a real executor run."""
    registry = default_registry(settings)
    registry.register(Capture)
    workflow = Workflow.load(resources_dir() / "workflows" / "default.json")
    latent_id = next(i for i, n in workflow.nodes.items() if n.type == "EmptyLatentImage")
    workflow.nodes[latent_id].widgets.update(width=SIZE, height=SIZE)  # small: 8 x 8 latent cells
    for node_type in ("KSampler", "VAEDecode", "SaveImage"):
        workflow.remove_node(next(i for i, n in workflow.nodes.items() if n.type == node_type))
    ids = {n.type if n.type != "CLIPTextEncode" else n.title: i for i, n in workflow.nodes.items()}
    taps = {"model": (ids["CheckpointLoaderSimple"], 0, "MODEL"),
            "positive": (ids["Positive prompt"], 0, "CONDITIONING"),
            "negative": (ids["Negative prompt"], 0, "CONDITIONING"),
            "latent": (ids["EmptyLatentImage"], 0, "LATENT")}
    capture_ids = {}
    for name, (source, output, type_name) in taps.items():
        capture_ids[name] = workflow.add_node("Capture").id
        workflow.connect(source, output, capture_ids[name], "value", type_name)
    Capture.seen.clear()
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status == "finished", result.failure or result.errors
    return {name: Capture.seen[node_id] for name, node_id in capture_ids.items()}


def ksampler(embedded: dict, seed: int = SEED, cfg: float = 7.0, sampler: str = "euler",
             scheduler: str = "normal", denoise: float = 1.0, latent: dict | None = None) -> torch.Tensor:
    """The KSampler's latent (the default run computed once)."""
    key = (seed, cfg, sampler, scheduler, denoise)
    if latent is None and key in KSAMPLER_RUNS:
        return KSAMPLER_RUNS[key]
    (out,) = KSampler().run(Recorder().ctx, embedded["model"], seed, STEPS, cfg, sampler, scheduler,
                            embedded["positive"], embedded["negative"], latent or embedded["latent"], denoise)
    if latent is None:
        KSAMPLER_RUNS[key] = out["samples"]
    return out["samples"]


def advanced(embedded: dict, noise: Any, guider: Any, sampler: str = "euler", sigmas: Any = None,
             latent: dict | None = None, ctx: RunContext | None = None) -> tuple[dict, dict]:
    (choice,) = cs.KSamplerSelect().run(None, sampler)
    if sigmas is None:
        (sigmas,) = cs.BasicScheduler().run(None, embedded["model"], "normal", STEPS, 1.0)
    return cs.SamplerCustomAdvanced().run(ctx or Recorder().ctx, noise, guider, choice, sigmas,
                                          latent or embedded["latent"])


def cfg_guider(embedded: dict, cfg: float = 7.0) -> cs.Guider:
    return cs.CFGGuider().run(None, embedded["model"], embedded["positive"], embedded["negative"], cfg)[0]


def test_sampler_custom_advanced_gives_the_ksampler_latent_bit_for_bit(embedded):
    recorder = Recorder()
    (noise,) = cs.RandomNoise().run(None, SEED)
    output, denoised = advanced(embedded, noise, cfg_guider(embedded), ctx=recorder.ctx)
    assert torch.equal(output["samples"], ksampler(embedded))
    assert denoised["samples"].shape == output["samples"].shape
    assert recorder.progress == [(i, STEPS) for i in range(1, STEPS + 1)]  # as the KSampler reports
    assert recorder.previews == STEPS
    assert not torch.equal(advanced(embedded, cs.RandomNoise().run(None, SEED + 1)[0],
                                    cfg_guider(embedded))[0]["samples"], output["samples"])


def test_basic_guider_is_the_ksampler_at_cfg_1(embedded):
    (guider,) = cs.BasicGuider().run(None, embedded["model"], embedded["positive"])
    output, _ = advanced(embedded, SeededNoise(SEED), guider, sampler="dpmpp_2m")
    assert torch.equal(output["samples"], ksampler(embedded, cfg=1.0, sampler="dpmpp_2m"))


def test_sampler_custom_gives_the_ksampler_latent(embedded):
    (choice,) = cs.KSamplerSelect().run(None, "euler_ancestral")
    (sigmas,) = cs.BasicScheduler().run(None, embedded["model"], "karras", STEPS, 1.0)
    output, _ = cs.SamplerCustom().run(Recorder().ctx, embedded["model"], True, SEED, 7.0,
                                       embedded["positive"], embedded["negative"], choice, sigmas,
                                       embedded["latent"])
    assert torch.equal(output["samples"], ksampler(embedded, sampler="euler_ancestral", scheduler="karras"))


def test_without_noise_the_step_noise_still_follows_the_seed_as_in_comfyui(embedded):
    """SamplerCustom with add_noise off seeds ancestral steps with noise_seed; DisableNoise with 0."""
    latent = {"samples": ksampler(embedded)}  # a non-empty latent to start from
    (choice,) = cs.KSamplerSelect().run(None, "euler_ancestral")
    (sigmas,) = cs.BasicScheduler().run(None, embedded["model"], "normal", STEPS, 1.0)
    (basic,) = cs.BasicGuider().run(None, embedded["model"], embedded["positive"])
    custom, _ = cs.SamplerCustom().run(Recorder().ctx, embedded["model"], False, SEED, 1.0,
                                       embedded["positive"], embedded["negative"], choice, sigmas, latent)
    disabled, _ = advanced(embedded, cs.DisableNoise().run(None)[0], basic, "euler_ancestral", latent=latent)
    for seed, output in ((SEED, custom), (0, disabled)):
        (reference,) = KSamplerAdvanced().run(Recorder().ctx, embedded["model"], "disable", seed, STEPS, 1.0,
                                              "euler_ancestral", "normal", embedded["positive"],
                                              embedded["negative"], latent, 0, 10000, "disable")
        assert torch.equal(output["samples"], reference["samples"])


def test_basic_scheduler_denoise_keeps_the_last_steps_like_the_ksampler(embedded):
    model_sampling = embedded["model"].model_sampling
    (sigmas,) = cs.BasicScheduler().run(None, embedded["model"], "normal", STEPS, 0.5)
    assert torch.equal(sigmas, ksampler_sigmas(model_sampling, "normal", STEPS, 0.5))
    assert torch.equal(sigmas, calculate_sigmas("normal", model_sampling, 8)[-(STEPS + 1):])
    assert len(cs.BasicScheduler().run(None, embedded["model"], "normal", STEPS, 0.0)[0]) == 0
    image = {"samples": ksampler(embedded)}
    output, _ = advanced(embedded, SeededNoise(SEED), cfg_guider(embedded), sigmas=sigmas, latent=image)
    assert torch.equal(output["samples"], ksampler(embedded, denoise=0.5, latent=image))


def test_split_sigmas_halves_chain_into_the_full_run_and_the_high_half_keeps_its_x0(embedded):
    (sigmas,) = cs.BasicScheduler().run(None, embedded["model"], "normal", STEPS, 1.0)
    high, low = cs.SplitSigmas().run(None, sigmas, 2)
    assert torch.equal(high, sigmas[:3]) and torch.equal(low, sigmas[2:])
    first, first_x0 = advanced(embedded, SeededNoise(SEED), cfg_guider(embedded), sigmas=high)
    assert not torch.allclose(first["samples"], first_x0["samples"], atol=1e-2)  # noisy vs. its x0
    second, _ = advanced(embedded, EmptyNoise(), cfg_guider(embedded), sigmas=low, latent=first)
    torch.testing.assert_close(second["samples"], ksampler(embedded), rtol=1e-4, atol=1e-4)
    high_d, low_d = cs.SplitSigmasDenoise().run(None, sigmas, 0.25)
    assert torch.equal(high_d, sigmas[:-1]) and torch.equal(low_d, sigmas[-2:])
    flipped = cs.FlipSigmas().run(None, sigmas)[0]
    assert flipped[0] == pytest.approx(0.0001) and torch.equal(flipped[1:], sigmas.flip(0)[1:])
    assert sigmas[-1] == 0  # the input is not written to


def test_explicit_schedulers_match_the_engine_schedules(embedded):
    karras = cs.KarrasScheduler().run(None, STEPS, 14.614642, 0.0291675, 7.0)[0]
    reference = ksampler_sigmas(embedded["model"].model_sampling, "karras", STEPS)  # SD1's exact range
    torch.testing.assert_close(karras, reference, rtol=1e-4, atol=0)  # ComfyUI's defaults are rounded
    exponential = cs.ExponentialScheduler().run(None, STEPS, 14.614642, 0.0291675)[0]
    assert len(exponential) == STEPS + 1 and exponential[0] == pytest.approx(14.614642)
    beta = cs.BetaSamplingScheduler().run(None, embedded["model"], STEPS, 0.6, 0.6)[0]
    assert torch.equal(beta, ksampler_sigmas(embedded["model"].model_sampling, "beta", STEPS))
    with pytest.raises(ValueError, match="sigma_min and sigma_max > 0"):
        cs.ExponentialScheduler().run(None, STEPS, 14.6, 0.0)


def test_no_sigmas_return_the_latent_and_one_sigma_only_noises_it_as_comfyui(embedded):
    image = {"samples": ksampler(embedded), "batch_index": [0]}
    output, denoised = advanced(embedded, SeededNoise(SEED), cfg_guider(embedded), sigmas=torch.zeros(0),
                                latent=image)
    assert torch.equal(output["samples"], image["samples"]) and denoised is output
    assert output["batch_index"] == [0]
    sigma = torch.tensor([2.0])
    quiet, _ = advanced(embedded, EmptyNoise(), cfg_guider(embedded), sigmas=sigma, latent=image)
    torch.testing.assert_close(quiet["samples"], image["samples"], rtol=1e-6, atol=1e-6)
    noisy, _ = advanced(embedded, SeededNoise(SEED), cfg_guider(embedded), sigmas=sigma, latent=image)
    scale = embedded["model"].latent_scale
    expected = image["samples"] + prepare_noise(image["samples"], SEED) * 2.0 / scale
    torch.testing.assert_close(noisy["samples"], expected, rtol=1e-5, atol=1e-5)


def test_bad_links_and_names_give_clear_errors(embedded):
    with pytest.raises(ValueError, match="unknown sampler 'nope'; accepted: euler"):
        SamplerChoice("nope")
    with pytest.raises(ValueError, match="expected a GUIDER input .from CFGGuider or BasicGuider"):
        advanced(embedded, SeededNoise(SEED), "not a guider")
    with pytest.raises(ValueError, match="expected SIGMAS .* got \\(2, 2\\)"):
        advanced(embedded, SeededNoise(SEED), cfg_guider(embedded), sigmas=torch.ones(2, 2))
    with pytest.raises(ValueError, match="cfg 7.0 needs a negative"):
        advanced(embedded, SeededNoise(SEED), cs.Guider(embedded["model"], embedded["positive"], None, 7.0))


def test_flux_guidance_copies_the_conditioning_and_sd_models_ignore_it(embedded):
    positive = embedded["positive"]
    before = [dict(extras) for _, extras in positive]
    (guided,) = FluxGuidance().run(None, positive, 4.5)
    assert [extras for _, extras in positive] == before and "guidance" not in positive[0][1]
    assert all(extras["guidance"] == 4.5 for _, extras in guided) and guided[0][0] is positive[0][0]
    assert embedded["model"].guidance_conditioning(guided, SIZE, SIZE)[0].guidance == 4.5
    assert embedded["model"].guidance_conditioning(positive, SIZE, SIZE)[0].guidance is None
    (negative,) = FluxGuidance().run(None, embedded["negative"], 2.0)
    (guider,) = cs.CFGGuider().run(None, embedded["model"], guided, negative, 7.0)
    output, _ = advanced(embedded, SeededNoise(SEED), guider)
    assert torch.equal(output["samples"], ksampler(embedded))


def test_conditioning_zero_out_zeros_context_and_pooled_and_keeps_the_rest():
    context, pooled = torch.randn(1, 77, 8), torch.randn(1, 4)
    conditioning = [[context, {"pooled_output": pooled, "width": 512}], [context, {"pooled_output": None}]]
    (zeroed,) = ConditioningZeroOut().run(None, conditioning)
    assert torch.equal(zeroed[0][0], torch.zeros_like(context)) and zeroed[0][1]["width"] == 512
    assert torch.equal(zeroed[0][1]["pooled_output"], torch.zeros(1, 4))
    assert zeroed[1][1]["pooled_output"] is None
    assert conditioning[0][1]["pooled_output"] is pooled and bool(context.any())
    with pytest.raises(ValueError, match="expected a CONDITIONING"):
        ConditioningZeroOut().run(None, "text")


def test_empty_sd3_latent_has_16_channels_and_an_sd_model_takes_it_as_its_own_empty_latent(embedded):
    assert EmptySD3LatentImage.input_named("width").step == 16
    assert EmptySD3LatentImage.default_widget_values() == {"width": 1024, "height": 1024, "batch_size": 1}
    (latent,) = EmptySD3LatentImage().run(None, 96, 128, 2)
    assert latent["samples"].shape == (2, 16, 16, 12) and not latent["samples"].any()
    sd3_empty = EmptySD3LatentImage().run(None, SIZE, SIZE, 1)[0]
    assert torch.equal(ksampler(embedded, latent=sd3_empty), ksampler(embedded))  # ComfyUI fixes the channels
    with pytest.raises(ValueError, match="the latent has 16 channels but this .* model samples 4"):
        ksampler(embedded, latent={"samples": torch.ones(1, 16, 16, 16)})


def api_prompt(sampler_name: str = "euler") -> dict:
    """A ComfyUI API prompt of the custom-sampling graph on the embedded model (as ComfyUI would queue it)."""
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sluice-shapes.safetensors"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": "sluice-shapes-clip.safetensors",
                                                     "type": "stable_diffusion"}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "a large red circle", "clip": ["2", 0]}},
        "4": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["3", 0]}},
        "5": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["3", 0], "guidance": 3.5}},
        "6": {"class_type": "CFGGuider", "inputs": {"model": ["1", 0], "positive": ["5", 0],
                                                    "negative": ["4", 0], "cfg": 5.0}},
        "7": {"class_type": "RandomNoise", "inputs": {"noise_seed": 7}},
        "8": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": sampler_name}},
        "9": {"class_type": "BasicScheduler", "inputs": {"model": ["1", 0], "scheduler": "simple", "steps": 3,
                                                         "denoise": 1.0}},
        "10": {"class_type": "EmptyLatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "11": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["7", 0], "guider": ["6", 0],
                                                                 "sampler": ["8", 0], "sigmas": ["9", 0],
                                                                 "latent_image": ["10", 0]}},
        "12": {"class_type": "VAEDecode", "inputs": {"samples": ["11", 1], "vae": ["1", 2]}},
        "13": {"class_type": "Capture", "inputs": {"value": ["12", 0]}},
    }


def test_a_comfyui_api_prompt_of_custom_sampling_nodes_imports_and_runs(settings):
    registry = default_registry(settings)
    registry.register(Capture)
    workflow, warnings = from_comfy_api(api_prompt(), registry.get)
    assert [w for w in warnings if not w.startswith(("node 1 ", "node 2 "))] == []  # loaders: Sluice options
    assert {link.type for link in workflow.links} >= {"NOISE", "GUIDER", "SAMPLER", "SIGMAS"}
    Capture.seen.clear()
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status == "finished", result.failure or result.errors
    assert Capture.seen["13"].shape == (1, SIZE, SIZE, 3)
    workflow, _ = from_comfy_api(api_prompt("nope"), registry.get)
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status == "invalid" and "'nope' is not one of the choices" in str(result.errors)
