"""The ControlNet nodes through the real registry and executor on a tiny random SD1 checkpoint and tiny random
ControlNets written for its UNet: ComfyUI's semantics (strength 0, step range, chaining, the old node's
control on the negative side), every file layout, the memory runtime module, and one sampling step checked
against the UNet and ControlNet driven directly."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file

import nodes.loaders
from engine import telemetry
from engine.graph.document import Workflow
from engine.graph.executor import Executor
from engine.memory.runtime import MemoryRuntime, set_runtime
from engine.models.controlnet import ControlNetConfig, ControlNetModel, controlnet_config
from engine.models.detect import detect
from engine.models.loader import clear_cache, load_checkpoint
from engine.sampling.noise import prepare_noise
from engine.settings import Settings
from nodes.loaders import workflow_plan
from nodes.registry import default_registry

sys.path.insert(0, str(Path(__file__).parents[1] / "engine" / "models"))
from sd_checkpoints import write_checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from capture_node import Capture  # noqa: E402

from tests.engine.models.control_checkpoints import write_controlnet  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SIZE = 64  # pixels: an 8 x 8 latent
HINT_SIZE = (80, 96)  # (height, width) of the hint file: resized to 64 x 64 with a centre crop


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for folder in ("checkpoints", "controlnet", "t2i_adapter"):
        (root / folder).mkdir()
    checkpoint = root / "checkpoints" / "sd1.safetensors"
    write_checkpoint(checkpoint, "sd1", seed=3)
    unet = detect(load_file(checkpoint)).unet
    for name, layout in (("cn_ldm", "ldm"), ("control_sd15_prefixed", "ldm_prefixed"),
                         ("cn_diffusers", "diffusers")):
        write_controlnet(root / "controlnet" / f"{name}.safetensors", unet, layout, seed=7)
    write_controlnet(root / "t2i_adapter" / "cn_other_shuffle.safetensors", unet, "ldm", seed=8)
    full = load_file(root / "controlnet" / "control_sd15_prefixed.safetensors")
    base = load_file(checkpoint)
    difference = {key: value - base[key.replace("control_model.", "model.diffusion_model.")]
                  if key.replace("control_model.", "model.diffusion_model.") in base else value
                  for key, value in full.items()}
    save_file({**difference, "difference": torch.zeros(1)}, root / "controlnet" / "cn_difference.safetensors")
    generator = torch.Generator().manual_seed(5)
    pixels = (torch.rand(*HINT_SIZE, 3, generator=generator) * 255).to(torch.uint8).numpy()
    Image.fromarray(np.asarray(pixels)).save(root / "hint.png")
    return root


@pytest.fixture
def settings(models_root: Path, tmp_path: Path):
    runtime = MemoryRuntime(bus=telemetry.EventBus())
    previous = set_runtime(runtime)
    settings = Settings(models_root, tmp_path / "output", None)
    nodes.loaders.configure(settings)
    clear_cache()
    yield settings
    nodes.loaders.configure(None)
    set_runtime(previous)


@pytest.fixture(autouse=True)
def compute_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodes.loaders, "COMPUTE_DEVICE", "cpu")


def add(workflow: Workflow, node_type: str, inputs: dict[str, tuple] | None = None, **widgets: Any) -> str:
    """Add a node; `inputs` maps input name -> (source node id, output index, type)."""
    node = workflow.add_node(node_type, widgets)
    for name, (source, output, type_name) in (inputs or {}).items():
        workflow.connect(source, output, node.id, name, type_name)
    return node.id


def run(settings: Settings, workflow: Workflow) -> dict[str, Any]:
    registry = default_registry()
    registry.register(Capture)
    Capture.seen.clear()
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status == "finished", (result.errors, result.failure)
    return dict(Capture.seen)


def controlled_workflow(models_root: Path, controls: list[dict[str, Any]], steps: int = 2,
                        sampler: str = "euler", cfg: float = 5.0) -> tuple[Workflow, str]:
    """Checkpoint, prompts, the controls in order (each a dict: node type, file, widgets, "old" for
    ControlNetApply on the positive prompt only), KSampler; returns the workflow and its Capture id."""
    workflow = Workflow()
    checkpoint = add(workflow, "CheckpointLoaderSimple", ckpt_name="sd1.safetensors")
    positive = add(workflow, "CLIPTextEncode", {"clip": (checkpoint, 1, "CLIP")}, text="a red fox")
    negative = add(workflow, "CLIPTextEncode", {"clip": (checkpoint, 1, "CLIP")}, text="blurry")
    hint = add(workflow, "LoadImage", image=str(models_root / "hint.png"))
    pos, neg = (positive, 0), (negative, 0)
    for control in controls:
        loader_inputs = {"model": (checkpoint, 0, "MODEL")} if control.get("diff") else {}
        loader = add(workflow, "DiffControlNetLoader" if control.get("diff") else "ControlNetLoader",
                     loader_inputs, control_net_name=control["file"], **control.get("loader", {}))
        links = {"control_net": (loader, 0, "CONTROL_NET"), "image": (hint, 0, "IMAGE")}
        if control.get("old"):
            pos = (add(workflow, "ControlNetApply", {"conditioning": (*pos, "CONDITIONING"), **links},
                       strength=control.get("strength", 1.0)), 0)
            continue
        apply = add(workflow, "ControlNetApplyAdvanced", {"positive": (*pos, "CONDITIONING"),
                                                           "negative": (*neg, "CONDITIONING"), **links},
                    strength=control.get("strength", 1.0), start_percent=control.get("start", 0.0),
                    end_percent=control.get("end", 1.0))
        pos, neg = (apply, 0), (apply, 1)
    latent = add(workflow, "EmptyLatentImage", width=SIZE, height=SIZE, batch_size=1)
    sampled = add(workflow, "KSampler", {"model": (checkpoint, 0, "MODEL"),
                                         "positive": (*pos, "CONDITIONING"),
                                         "negative": (*neg, "CONDITIONING"),
                                         "latent_image": (latent, 0, "LATENT")},
                  seed=42, steps=steps, cfg=cfg, sampler_name=sampler, scheduler="normal", denoise=1.0)
    capture = add(workflow, "Capture", {"value": (sampled, 0, "LATENT")})
    return workflow, capture


def sampled(settings: Settings, models_root: Path, controls: list[dict[str, Any]], **options: Any,
            ) -> torch.Tensor:
    workflow, capture = controlled_workflow(models_root, controls, **options)
    return run(settings, workflow)[capture]["samples"]


def test_strength_zero_and_an_empty_step_range_give_the_image_without_control(settings, models_root):
    plain = sampled(settings, models_root, [])
    zero = sampled(settings, models_root, [{"file": "cn_ldm.safetensors", "strength": 0.0}])
    assert torch.equal(zero, plain)
    assert torch.equal(sampled(settings, models_root, [{"file": "cn_ldm.safetensors", "old": True,
                                                        "strength": 0.0}]), plain)
    assert torch.equal(sampled(settings, models_root, [{"file": "cn_ldm.safetensors", "end": 0.0}]), plain)
    controlled = sampled(settings, models_root, [{"file": "cn_ldm.safetensors"}])
    assert (controlled - plain).abs().max() > 1e-3


def test_every_file_layout_gives_the_same_image(settings, models_root):
    images = [sampled(settings, models_root, [{"file": f"{name}.safetensors", "strength": 0.8}])
              for name in ("cn_ldm", "control_sd15_prefixed", "cn_diffusers")]
    for other in images[1:]:
        torch.testing.assert_close(other, images[0], rtol=0, atol=1e-6)


def test_the_old_node_on_the_positive_prompt_controls_the_negative_one_too(settings, models_root):
    advanced = sampled(settings, models_root, [{"file": "cn_ldm.safetensors", "strength": 0.7}])
    old = sampled(settings, models_root, [{"file": "cn_ldm.safetensors", "strength": 0.7, "old": True}])
    torch.testing.assert_close(old, advanced, rtol=0, atol=1e-6)


def test_chained_controls_add_their_residuals(settings, models_root):
    single = sampled(settings, models_root, [{"file": "cn_ldm.safetensors", "strength": 1.0}])
    chained = sampled(settings, models_root, [{"file": "cn_ldm.safetensors", "strength": 0.25},
                                              {"file": "cn_diffusers.safetensors", "strength": 0.75}])
    torch.testing.assert_close(chained, single, rtol=0, atol=1e-4)
    late = sampled(settings, models_root, [{"file": "cn_ldm.safetensors", "start": 0.5}], steps=4)
    early = sampled(settings, models_root, [{"file": "cn_ldm.safetensors", "end": 0.5}], steps=4)
    both = sampled(settings, models_root, [{"file": "cn_ldm.safetensors", "start": 0.5},
                                           {"file": "cn_ldm.safetensors", "end": 0.5}], steps=4)
    full = sampled(settings, models_root, [{"file": "cn_ldm.safetensors"}], steps=4)
    assert (late - early).abs().max() > 1e-3
    torch.testing.assert_close(both, full, rtol=0, atol=1e-5)


def test_a_difference_controlnet_gets_the_model_weights_added(settings, models_root):
    full = sampled(settings, models_root, [{"file": "control_sd15_prefixed.safetensors", "strength": 0.9}])
    diff = sampled(settings, models_root, [{"file": "cn_difference.safetensors", "strength": 0.9,
                                            "diff": True}])
    torch.testing.assert_close(diff, full, rtol=1e-4, atol=1e-4)  # (w - u) + u rounds in float32


@pytest.mark.parametrize("params", ["device", "cpu", "disk"])
def test_the_controlnet_is_its_own_memory_runtime_module(settings, models_root, params):
    from engine.memory.runtime import get_runtime

    reference = sampled(settings, models_root, [{"file": "cn_ldm.safetensors", "strength": 0.6}])
    clear_cache()
    placed = sampled(settings, models_root, [{"file": "cn_ldm.safetensors", "strength": 0.6,
                                              "loader": {"params_backend": params}}])
    assert "controlnet" in get_runtime().modules()
    torch.testing.assert_close(placed, reference, rtol=0, atol=1e-6)


def test_auto_fit_plans_the_controlnet_beside_the_checkpoint(settings, models_root):
    workflow, _ = controlled_workflow(models_root, [{"file": "cn_ldm.safetensors"}])
    plan = workflow_plan(workflow, settings)
    modules = [choice.need.module for choice in plan.choices]
    assert modules[:2] == ["diffusion", "controlnet"]
    need = next(choice.need for choice in plan.choices if choice.need.module == "controlnet")
    network = ControlNetModel(controlnet_config({k: tuple(v.shape) for k, v in load_file(
        models_root / "controlnet" / "cn_ldm.safetensors").items()}), device="meta")
    assert need.weight_bytes == sum(p.numel() * 4 for p in network.parameters())


def test_one_step_matches_the_unet_with_the_controlnet_residuals_driven_directly(settings, models_root):
    """Euler, one step from sigma_max to 0, is the guided x0 of the first model call: checked against our
    UNet and ControlNet called by hand on the noise, with the hint resized here (nearest-exact, centre
    crop to the square) and the residuals scaled by the strength."""
    strength, cfg = 0.6, 5.0
    got = sampled(settings, models_root, [{"file": "cn_ldm.safetensors", "strength": strength}], steps=1,
                  cfg=cfg)
    model, clip, _ = load_checkpoint(models_root / "checkpoints" / "sd1.safetensors")
    tensors = load_file(models_root / "controlnet" / "cn_ldm.safetensors")
    controlnet = ControlNetModel(controlnet_config({k: tuple(v.shape) for k, v in tensors.items()}),
                                 device="meta")
    controlnet.load_state_dict(tensors, assign=True)
    image = torch.from_numpy(np.array(Image.open(models_root / "hint.png"))).float() / 255  # (80, 96, 3)
    left = round((HINT_SIZE[1] - HINT_SIZE[0]) / 2)
    square = image[:, left:left + HINT_SIZE[0]].permute(2, 0, 1)[None]  # (1, 3, 80, 80)
    hint = F.interpolate(square, size=(SIZE, SIZE), mode="nearest-exact")
    sampling = model.model_sampling
    sigma = sampling.sigma_max
    noise = prepare_noise(torch.zeros(1, 4, SIZE // 8, SIZE // 8), 42)
    x = noise * (1 + sigma ** 2) ** 0.5
    x_in = x / (sigma ** 2 + 1) ** 0.5
    timestep = torch.tensor([999.0])
    with torch.no_grad():
        denoised = []
        for text in ("a red fox", "blurry"):
            context = clip.encode(text)[0][0]
            residuals = controlnet(x_in, hint, timestep, context)
            scaled = {kind: [r * strength for r in values] for kind, values in residuals.items()}
            eps = model.unet(x_in, timestep, context, control=scaled)
            denoised.append(x - eps * sigma)
    expected = (denoised[1] + (denoised[0] - denoised[1]) * cfg) / model.latent_scale
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)  # float noise of values up to ~200


def test_a_controlnet_of_another_family_is_refused_with_its_widths(settings, models_root, tmp_path):
    from tests.engine.models.control_checkpoints import CASES

    (models_root / "controlnet" / "xl.safetensors").unlink(missing_ok=True)
    write_controlnet(models_root / "controlnet" / "xl.safetensors", CASES["sdxl_like"][0], "ldm")
    workflow, _ = controlled_workflow(models_root, [{"file": "xl.safetensors"}])
    registry = default_registry()
    registry.register(Capture)
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    (models_root / "controlnet" / "xl.safetensors").unlink()
    assert result.status == "failed"
    assert "does not fit the sd_custom model (block widths [64, 64, 64, 128]" in result.failure.message


def test_the_shuffle_file_name_turns_on_global_average_pooling(settings, models_root):
    from engine.models.control_loader import load_control_model

    shuffle = load_control_model(models_root / "t2i_adapter" / "cn_other_shuffle.safetensors")
    plain = load_control_model(models_root / "controlnet" / "cn_ldm.safetensors")
    assert shuffle.global_average_pooling and not plain.global_average_pooling
    assert isinstance(shuffle.network.control_config, ControlNetConfig)


def controlnet_api_prompt(models_root: Path) -> dict:
    """ComfyUI's ControlNet example graph (ComfyUI_examples, controlnet) as an API prompt, on tiny files."""
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sd1.safetensors"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red fox", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["1", 1]}},
        "4": {"class_type": "LoadImage", "inputs": {"image": str(models_root / "hint.png")}},
        "5": {"class_type": "ControlNetLoader", "inputs": {"control_net_name": "cn_diffusers.safetensors"}},
        "6": {"class_type": "ControlNetApplyAdvanced",
              "inputs": {"positive": ["2", 0], "negative": ["3", 0], "control_net": ["5", 0],
                         "image": ["4", 0], "strength": 0.8, "start_percent": 0.0, "end_percent": 0.9}},
        "7": {"class_type": "EmptyLatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 2}},
        "8": {"class_type": "KSampler",
              "inputs": {"model": ["1", 0], "positive": ["6", 0], "negative": ["6", 1],
                         "latent_image": ["7", 0], "seed": 1, "steps": 3, "cfg": 6.0,
                         "sampler_name": "dpmpp_2m", "scheduler": "karras", "denoise": 1.0}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["1", 2]}},
        "10": {"class_type": "Capture", "inputs": {"value": ["9", 0]}},
    }


def test_a_comfyui_api_prompt_with_a_controlnet_imports_and_runs(settings, models_root):
    from engine.graph.comfy import from_comfy_api

    registry = default_registry(settings)
    registry.register(Capture)
    workflow, warnings = from_comfy_api(controlnet_api_prompt(models_root), registry.get)
    assert [w for w in warnings if not w.startswith(("node 1 ", "node 5 "))] == []  # loaders: Sluice options
    Capture.seen.clear()
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status == "finished", result.failure or result.errors
    assert Capture.seen["10"].shape == (2, 16, 16, 3)  # the tiny VAE upsamples twice
