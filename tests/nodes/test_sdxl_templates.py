"""ComfyUI's official SDXL templates (UI format, as published) import and run end to end on tiny SDXL-shaped
checkpoints named as the templates name them, with few steps and a small latent."""

from __future__ import annotations

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
from engine.settings import Settings, load_settings
from nodes.registry import NodeRegistry, default_registry
from tests.engine.models.sd_checkpoints import family_spec, write_checkpoint

SIZE = 64  # pixels: a 8 x 8 latent
DECODED = SIZE // 8 * 2 ** (len(family_spec("sdxl").vae.ch_mult) - 1)  # the tiny VAE upsamples less than 8x
STEPS = 2  # every sampler's steps; a base/refiner pair splits them at SWITCH
SWITCH = 1
CHECKPOINTS = {"sd_xl_base_1.0.safetensors": "sdxl", "sd_xl_turbo_1.0_fp16.safetensors": "sdxl",
               "sd_xl_refiner_1.0.safetensors": "sdxl_refiner"}


@pytest.fixture(scope="module")
def sdxl_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    root = tmp_path_factory.mktemp("sdxl")
    (root / "models" / "checkpoints").mkdir(parents=True)
    for name, family in CHECKPOINTS.items():
        write_checkpoint(root / "models" / "checkpoints" / name, family, size="tiny")
    return load_settings(models_root=root / "models", output_dir=root / "out")


@pytest.fixture(scope="module")
def registry(sdxl_settings: Settings) -> NodeRegistry:
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
        if "control_after_generate" in node.widgets:
            node.widgets["control_after_generate"] = "fixed"


def run(workflow: Workflow, settings: Settings, registry: NodeRegistry) -> list[Path]:
    """Run `workflow`; the PNG files it saved."""
    out = Path(settings.output_dir)
    before = set(out.rglob("*.png")) if out.exists() else set()
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status == "finished", result.failure or result.errors
    return sorted(set(out.rglob("*.png")) - before)


def image_of(name: str, settings: Settings, registry: NodeRegistry) -> torch.Tensor:
    data = json.loads((templates() / f"{name}.json").read_text())
    workflow, warnings = from_comfy_ui(data, registry.get)
    assert not [w for w in warnings if "unknown" in w.lower() or "not" in w.lower() and "type" in w.lower()]
    shrink(workflow)
    saved = run(workflow, settings, registry)
    assert len(saved) == 1
    with Image.open(saved[0]) as image:
        assert image.size == (DECODED, DECODED)
        return torch.from_numpy(np.asarray(image).copy())


@pytest.mark.parametrize("name", ["image_sdxl_simple", "sdxl_simple_example", "sdxlturbo_example",
                                  "sdxl_refiner_prompt_example"])
def test_official_sdxl_template_imports_and_runs(name, sdxl_settings, registry):
    image_of(name, sdxl_settings, registry)
