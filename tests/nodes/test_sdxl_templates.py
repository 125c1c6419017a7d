"""ComfyUI's official SDXL templates (UI format, as published) import and run end to end on tiny SDXL-shaped
checkpoints named as the templates name them, with few steps and a small latent."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine import telemetry
from engine.graph.comfy import from_comfy_ui
from engine.graph.document import Workflow
from engine.graph.executor import Executor
from engine.models.loader import clear_cache
from engine.models.unclip import SDXL_POOLED
from engine.settings import Settings, load_settings
from nodes.registry import NodeRegistry, default_registry
from tests.engine.models import clip_vision_checkpoints as vision
from tests.engine.models import sd_checkpoints as sd

SIZE = 64  # pixels: a 8 x 8 latent
DECODED = SIZE // 8 * 2 ** (len(sd.family_spec("sdxl").vae.ch_mult) - 1)  # pixels: the tiny VAE upsamples 2x
STEPS = 2  # every sampler's steps; a base/refiner pair splits them at SWITCH
SWITCH = 1  # the step where a base KSamplerAdvanced ends and its refiner starts
CHECKPOINTS = {"sd_xl_base_1.0.safetensors": "sdxl", "sd_xl_turbo_1.0_fp16.safetensors": "sdxl",
               "sd_xl_refiner_1.0.safetensors": "sdxl_refiner"}


@pytest.fixture(scope="module")
def sdxl_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    root = tmp_path_factory.mktemp("sdxl")
    (root / "models" / "checkpoints").mkdir(parents=True)
    for name, family in CHECKPOINTS.items():
        sd.write_checkpoint(root / "models" / "checkpoints" / name, family, size="tiny")
    return load_settings(models_root=root / "models", output_dir=root / "out")


def write_revision_checkpoint(path: Path) -> None:
    """Tiny SDXL whose OpenCLIP-G projects to SDXL_POOLED (1280) as the real one does: revision replaces the
    pooled text feature with a CLIP vision embedding of that fixed width."""
    spec = sd.family_spec("sdxl")
    clip_l, clip_g = spec.text
    unet = dataclasses.replace(spec.unet, adm_in_channels=SDXL_POOLED + 6 * 256)
    shapes = {**sd.unet_shapes(unet), **sd.vae_shapes(spec.vae), **sd.text_shapes(clip_l),
              **sd.text_shapes(dataclasses.replace(clip_g, projection_dim=SDXL_POOLED))}
    sd.save_state_dict(path, sd.random_state_dict(shapes), "safetensors")


def write_clip_vision_g(path: Path) -> None:
    """A tiny CLIP vision tower (transformers' layout, as clip_vision_g.safetensors is) projecting to 1280."""
    state = vision.hf_state(vision.reference("gelu"))
    generator = torch.Generator().manual_seed(1)
    state["visual_projection.weight"] = torch.randn(SDXL_POOLED, vision.WIDTH, generator=generator) * 0.05
    sd.save_state_dict(path, state, "safetensors", vision.UNCLIP_METADATA)


@pytest.fixture(scope="module")
def revision_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    root = tmp_path_factory.mktemp("revision")
    for folder in ("checkpoints", "clip_vision"):
        (root / "models" / folder).mkdir(parents=True)
    write_revision_checkpoint(root / "models" / "checkpoints" / "sd_xl_base_1.0.safetensors")
    write_clip_vision_g(root / "models" / "clip_vision" / "clip_vision_g.safetensors")
    (root / "input").mkdir()
    for index, color in ((1, (200, 40, 40)), (2, (40, 40, 200))):  # LoadImage reads <output_dir>/../input
        image = Image.new("RGB", (48, 40), color)
        image.save(root / "input" / f"sdxl_revision_text_prompts_ref_image{index}.png")
    return load_settings(models_root=root / "models", output_dir=root / "out")


@pytest.fixture
def registry(sdxl_settings: Settings) -> NodeRegistry:
    """Per test: building a registry points the loaders' model choices at these settings' folders."""
    return default_registry(sdxl_settings)


@pytest.fixture(autouse=True)
def fresh_models():
    clear_cache()
    yield
    clear_cache()


def templates() -> Path:
    package = pytest.importorskip("comfyui_workflow_templates_json",
                                  reason="comfyui-workflow-templates-json (a dev extra) is not installed")
    return Path(package.__file__).parent / "templates"


def shrink(workflow: Workflow) -> None:
    """A small image, few steps and fixed seeds, as a user would set them in the widgets."""
    for node in workflow.nodes.values():
        if node.type == "EmptyLatentImage":
            node.widgets.update(width=SIZE, height=SIZE)
        if node.type in ("KSampler", "KSamplerAdvanced", "SDTurboScheduler"):
            node.widgets["steps"] = min(node.widgets["steps"], STEPS)
        if node.type == "KSamplerAdvanced":  # the base ends where the refiner starts
            for key in ("start_at_step", "end_at_step"):
                if 0 < node.widgets[key] < 10000:
                    node.widgets[key] = SWITCH
        node.seed_controls = dict.fromkeys(node.seed_controls, "fixed")


def run(workflow: Workflow, settings: Settings, registry: NodeRegistry) -> list[Path]:
    """Run `workflow`; the PNG files it saved."""
    out = Path(settings.output_dir)
    before = set(out.rglob("*.png")) if out.exists() else set()
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status == "finished", result.failure or result.errors
    return sorted(set(out.rglob("*.png")) - before)


def image_of(name: str, settings: Settings, registry: NodeRegistry,
             widgets: dict[str, dict[str, object]] | None = None) -> torch.Tensor:
    """The image template `name` saves, shrunk, with `widgets` ({node id: {widget: value}}) set on top."""
    data = json.loads((templates() / f"{name}.json").read_text())
    workflow, warnings = from_comfy_ui(data, registry.get)
    assert not [w for w in warnings if "unknown" in w.lower() or "not" in w.lower() and "type" in w.lower()]
    shrink(workflow)
    for node_id, values in (widgets or {}).items():
        workflow.nodes[node_id].widgets.update(values)
    saved = run(workflow, settings, registry)
    assert len(saved) == 1
    with Image.open(saved[0]) as image:
        assert image.size == (DECODED, DECODED)
        return torch.from_numpy(np.asarray(image).copy())


@pytest.mark.parametrize("name", ["image_sdxl_simple", "sdxl_simple_example", "sdxlturbo_example",
                                  "sdxl_refiner_prompt_example"])
def test_official_sdxl_template_imports_and_runs(name, sdxl_settings, registry):
    image_of(name, sdxl_settings, registry)


def test_official_sdxl_revision_template_imports_runs_and_reads_its_images(revision_settings):
    registry = default_registry(revision_settings)
    published = image_of("sdxl_revision_text_prompts", revision_settings, registry)
    first_image_twice = {"38": {"image": "sdxl_revision_text_prompts_ref_image1.png"}}  # was image 2
    other = image_of("sdxl_revision_text_prompts", revision_settings, registry, first_image_twice)
    assert not torch.equal(published, other)


def test_sdxl_template_runs_are_deterministic(sdxl_settings, registry):
    first = image_of("sdxlturbo_example", sdxl_settings, registry)  # euler_ancestral: fresh noise each step
    assert torch.equal(first, image_of("sdxlturbo_example", sdxl_settings, registry))
