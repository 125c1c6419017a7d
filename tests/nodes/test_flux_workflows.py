"""ComfyUI's own FLUX workflows (the official templates, UI format, and the FLUX dev example in API format)
import and run end to end on tiny FLUX-shaped files named as the templates name them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine import telemetry
from engine.graph.comfy import from_comfy_api, from_comfy_ui
from engine.graph.document import Workflow
from engine.graph.executor import Executor
from engine.models.loader import clear_cache
from engine.settings import Settings, load_settings
from nodes.registry import NodeRegistry, default_registry
from tests.engine.models.flux_checkpoints import write_flux_files

SIZE = 64  # pixels: a 8 x 8 latent, 16 image tokens


@pytest.fixture(scope="module")
def flux_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    root = tmp_path_factory.mktemp("flux")
    for dev in (True, False):
        write_flux_files(root / "models", dev)
    return load_settings(models_root=root / "models", output_dir=root / "out")


@pytest.fixture(scope="module")
def registry(flux_settings: Settings) -> NodeRegistry:
    return default_registry(flux_settings)


@pytest.fixture(autouse=True)
def fresh_models():
    clear_cache()
    yield
    clear_cache()


def templates() -> Path:
    package = pytest.importorskip("comfyui_workflow_templates_json",
                                  reason="comfyui-workflow-templates-json (a dev extra) is not installed")
    return Path(package.__file__).parent / "templates"


def shrink(workflow: Workflow, steps: int = 2) -> None:
    """A small image and few steps, as a user would set them in the widgets."""
    for node in workflow.nodes.values():
        if node.type in ("EmptySD3LatentImage", "EmptyLatentImage", "ModelSamplingFlux"):
            node.widgets.update(width=SIZE, height=SIZE)
        if node.type in ("KSampler", "BasicScheduler"):
            node.widgets["steps"] = steps
        if node.type == "KSampler":
            node.widgets["control_after_generate"] = "fixed"


def run(workflow: Workflow, settings: Settings, registry: NodeRegistry) -> list[Path]:
    """Run `workflow`; the PNG files it saved."""
    out = Path(settings.output_dir)
    before = set(out.rglob("*.png")) if out.exists() else set()
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status == "finished", result.failure or result.errors
    return sorted(set(out.rglob("*.png")) - before)


@pytest.mark.parametrize("name", ["flux_dev_full_text_to_image", "flux_schnell_full_text_to_image",
                                  "flux_schnell", "flux_dev_checkpoint_example"])
def test_official_flux_template_imports_and_runs(name, flux_settings, registry):
    data = json.loads((templates() / f"{name}.json").read_text())
    workflow, warnings = from_comfy_ui(data, registry.get)
    assert not [w for w in warnings if "unknown" in w.lower() or "not" in w.lower() and "type" in w.lower()]
    shrink(workflow)
    saved = run(workflow, flux_settings, registry)
    assert len(saved) == 1
    with Image.open(saved[0]) as image:
        assert image.size == (SIZE, SIZE)


def flux_dev_api_prompt(seed: int = 42) -> dict:
    """ComfyUI's FLUX dev example (ComfyUI_examples flux_dev_example.png) as an API-format prompt."""
    return {
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red cube on a blue table",
                                                         "clip": ["11", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["13", 0], "vae": ["10", 0]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "ComfyUI", "images": ["8", 0]}},
        "10": {"class_type": "VAELoader", "inputs": {"vae_name": "ae.safetensors"}},
        "11": {"class_type": "DualCLIPLoader", "inputs": {
            "clip_name1": "t5xxl_fp16.safetensors", "clip_name2": "clip_l.safetensors", "type": "flux"}},
        "12": {"class_type": "UNETLoader", "inputs": {"unet_name": "flux1-dev.safetensors",
                                                      "weight_dtype": "default"}},
        "13": {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["25", 0], "guider": ["22", 0], "sampler": ["16", 0], "sigmas": ["17", 0],
            "latent_image": ["27", 0]}},
        "16": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "17": {"class_type": "BasicScheduler", "inputs": {"scheduler": "simple", "steps": 2, "denoise": 1.0,
                                                          "model": ["30", 0]}},
        "22": {"class_type": "BasicGuider", "inputs": {"model": ["30", 0], "conditioning": ["26", 0]}},
        "25": {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}},
        "26": {"class_type": "FluxGuidance", "inputs": {"guidance": 3.5, "conditioning": ["6", 0]}},
        "27": {"class_type": "EmptySD3LatentImage", "inputs": {"width": SIZE, "height": SIZE,
                                                               "batch_size": 1}},
        "30": {"class_type": "ModelSamplingFlux", "inputs": {"max_shift": 1.15, "base_shift": 0.5,
                                                             "width": SIZE, "height": SIZE,
                                                             "model": ["12", 0]}},
    }


def test_flux_dev_example_api_prompt_runs_and_is_deterministic(flux_settings, registry):
    images = []
    for _ in range(2):
        workflow, warnings = from_comfy_api(flux_dev_api_prompt(), registry.get)
        saved = run(workflow, flux_settings, registry)
        assert len(saved) == 1
        with Image.open(saved[0]) as image:
            assert image.size == (SIZE, SIZE)
            images.append(torch.from_numpy(np.asarray(image).copy()))
    assert torch.equal(images[0], images[1])


def test_flux_guidance_and_seed_change_the_dev_image(flux_settings, registry):
    def image_of(prompt: dict) -> torch.Tensor:
        workflow, _ = from_comfy_api(prompt, registry.get)
        (path,) = run(workflow, flux_settings, registry)
        with Image.open(path) as image:
            return torch.from_numpy(np.asarray(image).copy())

    base = image_of(flux_dev_api_prompt())
    other_seed = image_of(flux_dev_api_prompt(seed=43))
    guided = flux_dev_api_prompt()
    guided["26"]["inputs"]["guidance"] = 30.0
    other_guidance = image_of(guided)
    assert not torch.equal(base, other_seed) and not torch.equal(base, other_guidance)


def test_t5_in_an_sdxl_dual_clip_loader_gives_a_clear_error(flux_settings, registry):
    prompt = flux_dev_api_prompt()
    prompt["11"]["inputs"]["type"] = "sdxl"
    workflow, _ = from_comfy_api(prompt, registry.get)
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=flux_settings).run(workflow)
    assert result.status == "failed"
    assert "a sdxl text encoder takes no T5-XXL" in str(result.failure)
