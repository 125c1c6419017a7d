"""The CLIP vision and unCLIP nodes through the real registry and executor on a tiny random SD2.1 unCLIP
checkpoint and the same vision tower as a transformers-layout clip_vision file: ComfyUI's node signatures,
both loaders giving the same embedding, unCLIPConditioning's list semantics, the memory runtime module and
auto-fit, and one sampling step checked against ComfyUI's unCLIP formula (tests/engine/models) driven by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import nodes.loaders
from engine import telemetry
from engine.graph.document import Workflow
from engine.graph.executor import Executor
from engine.memory.runtime import MemoryRuntime, get_runtime, set_runtime
from engine.models.clip_vision import CLIPVisionOutput
from engine.models.loader import clear_cache, load_checkpoint
from engine.sampling.noise import prepare_noise
from engine.settings import Settings
from nodes.loaders import workflow_plan
from nodes.registry import default_registry
from tests.engine.models.clip_vision_checkpoints import (
    PROJECTION,
    UNCLIP_METADATA,
    hf_state,
    reference,
    write_unclip_checkpoint,
)
from tests.engine.models.test_unclip_conditioning import comfy_unclip_adm
from tests.nodes.capture_node import Capture

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SIZE = 32  # pixels: a 4 x 4 latent


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for folder in ("checkpoints", "clip_vision"):
        (root / folder).mkdir()
    write_unclip_checkpoint(root / "checkpoints" / "sd21_unclip.safetensors", seed=0)
    save_file(hf_state(reference("gelu", 0)), str(root / "clip_vision" / "vision_hf.safetensors"),
              metadata=UNCLIP_METADATA)
    pixels = (torch.rand(40, 56, 3, generator=torch.Generator().manual_seed(5)) * 255).to(torch.uint8)
    Image.fromarray(np.asarray(pixels.numpy())).save(root / "image.png")
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


def unclip_workflow(models_root: Path, unclips: list[dict[str, Any]], vision_loader: str = "checkpoint",
                    loader_widgets: dict[str, Any] | None = None, steps: int = 1, cfg: float = 4.0,
                    ) -> tuple[Workflow, dict[str, str]]:
    """ComfyUI's unCLIP example in small: unCLIPCheckpointLoader, prompts, LoadImage -> CLIPVisionEncode ->
    unCLIPConditioning (one per dict of `unclips`, chained) -> KSampler; returns the Capture ids."""
    workflow = Workflow()
    checkpoint = add(workflow, "unCLIPCheckpointLoader", ckpt_name="sd21_unclip.safetensors",
                     **(loader_widgets or {}))
    vision = (checkpoint, 3)
    if vision_loader == "file":
        vision = (add(workflow, "CLIPVisionLoader", clip_name="vision_hf.safetensors",
                      **(loader_widgets or {})), 0)
    positive = add(workflow, "CLIPTextEncode", {"clip": (checkpoint, 1, "CLIP")}, text="a red fox")
    negative = add(workflow, "CLIPTextEncode", {"clip": (checkpoint, 1, "CLIP")}, text="blurry")
    image = add(workflow, "LoadImage", image=str(models_root / "image.png"))
    encoded = add(workflow, "CLIPVisionEncode", {"clip_vision": (*vision, "CLIP_VISION"),
                                                 "image": (image, 0, "IMAGE")}, crop="center")
    pos = (positive, 0)
    for unclip in unclips:
        pos = (add(workflow, "unCLIPConditioning", {"conditioning": (*pos, "CONDITIONING"),
                                                    "clip_vision_output": (encoded, 0, "CLIP_VISION_OUTPUT")},
                   **unclip), 0)
    latent = add(workflow, "EmptyLatentImage", width=SIZE, height=SIZE, batch_size=1)
    sampled = add(workflow, "KSampler", {"model": (checkpoint, 0, "MODEL"),
                                         "positive": (*pos, "CONDITIONING"),
                                         "negative": (negative, 0, "CONDITIONING"),
                                         "latent_image": (latent, 0, "LATENT")},
                  seed=42, steps=steps, cfg=cfg, sampler_name="euler", scheduler="normal", denoise=1.0)
    captures = {"latent": add(workflow, "Capture", {"value": (sampled, 0, "LATENT")}),
                "embedding": add(workflow, "Capture", {"value": (encoded, 0, "CLIP_VISION_OUTPUT")}),
                "positive": add(workflow, "Capture", {"value": (*pos, "CONDITIONING")})}
    return workflow, captures


def test_the_nodes_have_comfyuis_signatures() -> None:
    registry = default_registry()

    def signature(name: str) -> tuple:
        node = registry.get(name)
        return ([(i.name, i.kind if i.default is None else i.default) for i in node.inputs],
                [o.name for o in node.outputs])

    assert signature("CLIPVisionEncode") == ([("clip_vision", "CLIP_VISION"), ("image", "IMAGE"),
                                              ("crop", "center")], ["CLIP_VISION_OUTPUT"])
    assert registry.get("CLIPVisionEncode").inputs[2].choices == ("center", "none")
    assert signature("unCLIPConditioning") == ([("conditioning", "CONDITIONING"),
                                                ("clip_vision_output", "CLIP_VISION_OUTPUT"),
                                                ("strength", 1.0), ("noise_augmentation", 0.0)],
                                               ["CONDITIONING"])
    strength, noise = registry.get("unCLIPConditioning").inputs[2:]
    assert (strength.min, strength.max, noise.min, noise.max) == (-10.0, 10.0, 0.0, 1.0)
    assert signature("unCLIPCheckpointLoader")[1] == ["MODEL", "CLIP", "VAE", "CLIP_VISION"]
    assert signature("CLIPVisionLoader")[0][0][0] == "clip_name"
    assert signature("CLIPVisionLoader")[1] == ["CLIP_VISION"]


def test_both_loaders_give_the_same_embedding_and_conditioning_chains(settings, models_root) -> None:
    unclips = [{"strength": 0.8, "noise_augmentation": 0.1}, {"strength": 0.5, "noise_augmentation": 0.0}]
    workflow, captures = unclip_workflow(models_root, unclips)
    seen = run(settings, workflow)
    embedding = seen[captures["embedding"]]
    assert isinstance(embedding, CLIPVisionOutput) and embedding.image_embeds.shape == (1, PROJECTION)
    workflow, file_captures = unclip_workflow(models_root, unclips, vision_loader="file")
    from_file = run(settings, workflow)
    torch.testing.assert_close(from_file[file_captures["embedding"]].image_embeds, embedding.image_embeds,
                               rtol=0, atol=1e-6)
    (_, options), = seen[captures["positive"]]
    assert [(u["strength"], u["noise_augmentation"]) for u in options["unclip_conditioning"]] == [(0.8, 0.1),
                                                                                                 (0.5, 0.0)]
    zero, zero_captures = unclip_workflow(models_root, [{"strength": 0.0, "noise_augmentation": 0.3}])
    (_, options), = run(settings, zero)[zero_captures["positive"]]
    assert "unclip_conditioning" not in options


def test_one_step_matches_comfyuis_unclip_formula_driven_by_hand(settings, models_root) -> None:
    """Euler, one step from sigma_max to 0, gives the guided x0 of the first model call: the positive prompt
    with y from ComfyUI's unclip_adm (seed 42 - 10), the negative with zeros."""
    strength, noise_augmentation, cfg = 0.7, 0.25, 4.0
    workflow, captures = unclip_workflow(models_root, [{"strength": strength,
                                                        "noise_augmentation": noise_augmentation}], cfg=cfg)
    seen = run(settings, workflow)
    model, clip, _ = load_checkpoint(models_root / "checkpoints" / "sd21_unclip.safetensors")
    unclip = [{"clip_vision_output": seen[captures["embedding"]], "strength": strength,
               "noise_augmentation": noise_augmentation}]
    y_positive = comfy_unclip_adm(unclip, 0.05, 32)
    sampling = model.model_sampling
    sigma = sampling.sigma_max.reshape(1)
    noise = prepare_noise(torch.zeros(1, 4, SIZE // 8, SIZE // 8), 42)
    x = sampling.noise_scaling(sigma, noise, torch.zeros_like(noise), True)
    denoiser = model.denoiser()
    with torch.no_grad():
        cond = denoiser(x, sigma, context=clip.encode("a red fox")[0][0], y=y_positive)
        uncond = denoiser(x, sigma, context=clip.encode("blurry")[0][0], y=torch.zeros(1, 2 * PROJECTION))
    expected = model.process_out(uncond + (cond - uncond) * cfg)
    torch.testing.assert_close(seen[captures["latent"]]["samples"], expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("params", ["cpu", "disk"])
def test_the_vision_tower_is_its_own_memory_runtime_module(settings, models_root, params) -> None:
    reference_run, captures = unclip_workflow(models_root, [{"strength": 1.0, "noise_augmentation": 0.0}],
                                              vision_loader="file")
    expected = run(settings, reference_run)[captures["embedding"]].image_embeds
    clear_cache()
    placed, _ = unclip_workflow(models_root, [{"strength": 1.0, "noise_augmentation": 0.0}],
                                vision_loader="file", loader_widgets={"params_backend": params})
    got = run(settings, placed)[captures["embedding"]].image_embeds
    assert any(name.startswith("clip_vision") for name in get_runtime().modules())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_auto_fit_plans_the_vision_towers(settings, models_root) -> None:
    workflow, _ = unclip_workflow(models_root, [{"strength": 1.0, "noise_augmentation": 0.0}],
                                  vision_loader="file")
    problems: list[str] = []
    plan = workflow_plan(workflow, settings, problems=problems)
    assert problems == []
    needs = [choice.need for choice in plan.choices if choice.need.module == "clip_vision"]
    tower = reference("gelu", 0)
    tower_bytes = sum(p.numel() * 4 for p in tower.parameters())
    assert sorted(need.weight_bytes for need in needs) == [tower_bytes, tower_bytes]  # checkpoint's, file's
