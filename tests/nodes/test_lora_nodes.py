"""LoraLoader and LoraLoaderModelOnly through the real registry and executor on a tiny SD1 checkpoint and
a random kohya LoRA: the strength changes the sampled latent; strength 0 gives exactly the latent without it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import nodes.loaders
from engine import telemetry
from engine.graph.document import Workflow
from engine.graph.executor import Executor, JobResult
from engine.graph.spec import FLOAT
from engine.models.loader import load_checkpoint
from engine.settings import Settings
from nodes.registry import default_registry

sys.path.insert(0, str(Path(__file__).parents[1] / "engine" / "models"))
from sd_checkpoints import write_checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from capture_node import Capture  # noqa: E402

TARGETS = (
    "input_blocks.1.1.transformer_blocks.0.attn2.to_v",
    "middle_block.1.transformer_blocks.0.ff.net.2",
    "output_blocks.1.0.in_layers.2",
)  # two Linears and a 3x3 convolution (LoCon)
TE_TARGETS = ("text_model.encoder.layers.1.self_attn.v_proj",)


def _pair(weight: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    down = torch.randn(4, *weight.shape[1:], generator=generator) * 0.3
    up = torch.randn(weight.shape[0], 4, *(1,) * (weight.ndim - 2), generator=generator) * 0.3
    return down, up


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    (root / "checkpoints").mkdir()
    (root / "loras").mkdir()
    write_checkpoint(root / "checkpoints" / "sd1.safetensors", "sd1", size="tiny", seed=21)
    model, clip, _ = load_checkpoint(root / "checkpoints" / "sd1.safetensors", components=("diffusion", "te"))
    generator = torch.Generator().manual_seed(22)
    tensors = {}
    for prefix, module, names in (
        ("lora_unet_", model.unet, TARGETS),
        ("lora_te_", clip.encoders[0], TE_TARGETS),
    ):
        for name in names:
            down, up = _pair(module.get_submodule(name).weight, generator)
            key = prefix + name.replace(".", "_")
            tensors |= {
                f"{key}.lora_down.weight": down,
                f"{key}.lora_up.weight": up,
                f"{key}.alpha": torch.tensor(4.0),
            }
    save_file(tensors, root / "loras" / "style.safetensors")
    return root


@pytest.fixture
def settings(models_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setattr(nodes.loaders, "COMPUTE_DEVICE", "cpu")
    settings = Settings(models_root, tmp_path / "output", None)
    nodes.loaders.configure(settings)
    yield settings
    nodes.loaders.configure(None)


def add(workflow: Workflow, node_type: str, inputs: dict[str, Any] | None = None, **widgets: Any) -> str:
    node = workflow.add_node(node_type, widgets)
    for name, (source, output, type_name) in (inputs or {}).items():
        workflow.connect(source, output, node.id, name, type_name)
    return node.id


def sampled_latent(settings: Settings, lora: dict[str, Any] | None, model_only: bool = False) -> torch.Tensor:
    """ckpt -> [LoRA] -> text encode + KSampler (2 steps, 32x32) -> the LATENT's samples."""
    workflow = Workflow()
    ckpt = add(workflow, "CheckpointLoaderSimple", ckpt_name="sd1.safetensors")
    model, clip = (ckpt, 0, "MODEL"), (ckpt, 1, "CLIP")
    if lora is not None and model_only:
        node = add(workflow, "LoraLoaderModelOnly", {"model": model}, lora_name="style.safetensors", **lora)
        model = (node, 0, "MODEL")
    elif lora is not None:
        node = add(
            workflow, "LoraLoader", {"model": model, "clip": clip}, lora_name="style.safetensors", **lora
        )
        model, clip = (node, 0, "MODEL"), (node, 1, "CLIP")
    positive = add(workflow, "CLIPTextEncode", {"clip": clip}, text="a lighthouse at dusk")
    negative = add(workflow, "CLIPTextEncode", {"clip": clip}, text="")
    latent = add(workflow, "EmptyLatentImage", width=32, height=32, batch_size=1)
    sampled = add(
        workflow,
        "KSampler",
        {
            "model": model,
            "positive": (positive, 0, "CONDITIONING"),
            "negative": (negative, 0, "CONDITIONING"),
            "latent_image": (latent, 0, "LATENT"),
        },
        seed=5,
        steps=2,
        cfg=4.0,
        sampler_name="euler",
        scheduler="normal",
        denoise=1.0,
    )
    capture = add(workflow, "Capture", {"value": (sampled, 0, "LATENT")})
    registry = default_registry()
    registry.register(Capture)
    result: JobResult = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status == "finished", result.failure
    return Capture.seen[capture]["samples"]


def test_lora_nodes_are_registered_with_comfyui_inputs_in_order():
    registry = default_registry()
    loader, model_only = registry.get("LoraLoader"), registry.get("LoraLoaderModelOnly")
    assert [(i.name, i.kind) for i in loader.inputs] == [
        ("model", "MODEL"),
        ("clip", "CLIP"),
        ("lora_name", "COMBO"),
        ("strength_model", FLOAT),
        ("strength_clip", FLOAT),
    ]
    assert [o.type for o in loader.outputs] == ["MODEL", "CLIP"]
    assert [(i.name, i.kind) for i in model_only.inputs] == [
        ("model", "MODEL"),
        ("lora_name", "COMBO"),
        ("strength_model", FLOAT),
    ]
    strength = loader.input_named("strength_model")
    assert (strength.default, strength.min, strength.max, strength.step) == (1.0, -100.0, 100.0, 0.01)


def test_lora_strength_changes_the_sample_and_strength_zero_is_exactly_no_lora(settings: Settings):
    without = sampled_latent(settings, None)
    zero = sampled_latent(settings, {"strength_model": 0.0, "strength_clip": 0.0})
    full = sampled_latent(settings, {"strength_model": 1.0, "strength_clip": 1.0})
    clip_only = sampled_latent(settings, {"strength_model": 0.0, "strength_clip": 1.0})
    model_only = sampled_latent(settings, {"strength_model": 0.5}, model_only=True)
    model_half = sampled_latent(settings, {"strength_model": 0.5, "strength_clip": 0.0})
    assert torch.equal(zero, without)
    for changed in (full, clip_only, model_only):
        assert (changed - without).abs().max() > 1e-3
    assert (full - model_only).abs().max() > 1e-3
    assert torch.equal(model_only, model_half)  # LoraLoaderModelOnly = LoraLoader with strength_clip 0


def test_unknown_lora_name_fails_validation_naming_the_choices(settings: Settings):
    workflow = Workflow()
    ckpt = add(workflow, "CheckpointLoaderSimple", ckpt_name="sd1.safetensors")
    add(
        workflow,
        "LoraLoaderModelOnly",
        {"model": (ckpt, 0, "MODEL")},
        lora_name="nope.safetensors",
        strength_model=1.0,
    )
    result = Executor(default_registry().get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status == "invalid"
    messages = " ".join(error.message for error in result.errors)
    assert "'nope.safetensors' is not one of the choices (style.safetensors)" in messages
