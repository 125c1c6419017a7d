"""The GLIGEN nodes through the real registry and executor on a tiny random SD1 checkpoint and a tiny random
GLIGEN file made for its UNet (one fuser per transformer, in the original key layout): ComfyUI's signatures,
GLIGENTextBoxApply's boxes (in latent cells, with the text's pooled CLIP-L feature, chained), and one
sampling step checked against the UNet driven by hand with the boxes' middle patch on the positive side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import nodes.loaders
from engine import telemetry
from engine.graph.document import Workflow
from engine.graph.executor import Executor
from engine.memory.runtime import MemoryRuntime, set_runtime
from engine.models.conditioning import SD1_CLIP_L, encode_weighted
from engine.models.gligen import GLIGENModel, GLIGENPosition, load_gligen
from engine.models.loader import clear_cache, load_checkpoint
from engine.models.unet import SpatialTransformer
from engine.sampling.noise import prepare_noise
from engine.settings import Settings
from nodes.registry import default_registry
from tests.engine.models.sd_checkpoints import write_checkpoint
from tests.engine.models.test_unet_parity import init_random_
from tests.nodes.capture_node import Capture

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SIZE = 64  # pixels: an 8 x 8 latent
BOXES = [("a red fox", 32, 24, 8, 16), ("a tree", 16, 16, 0, 0)]  # text, width, height, x, y in pixels


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for folder in ("checkpoints", "gligen"):
        (root / folder).mkdir()
    write_checkpoint(root / "checkpoints" / "sd1.safetensors", "sd1", seed=3)
    model, clip, _ = load_checkpoint(root / "checkpoints" / "sd1.safetensors")
    transformers = [(name, module) for name, module in model.unet.named_modules()
                    if isinstance(module, SpatialTransformer)]
    width = clip.encoders[0].config.width
    fusers = [(module.proj_in.out_channels, width, 8) for _, module in transformers]
    gligen = GLIGENModel(fusers, width, width, device="cpu")
    init_random_(gligen, seed=9)
    with torch.no_grad():
        for name, parameter in gligen.named_parameters():
            if name.endswith(("alpha_attn", "alpha_dense")):
                parameter.fill_(0.8)
    tensors = {}
    for name, value in gligen.state_dict().items():
        if name.startswith("fusers."):
            _, index, rest = name.split(".", 2)
            name = f"model.diffusion_model.{transformers[int(index)][0]}.transformer_blocks.0.fuser.{rest}"
        tensors[name] = value.contiguous()
    save_file(tensors, str(root / "gligen" / "gligen_tiny.safetensors"), metadata={"sluice.num_heads": "8"})
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


def test_the_nodes_have_comfyuis_signatures() -> None:
    registry = default_registry()
    apply = registry.get("GLIGENTextBoxApply")
    assert [(i.name, i.kind, i.default, i.min, i.step) for i in apply.inputs] == [
        ("conditioning_to", "CONDITIONING", None, None, None), ("clip", "CLIP", None, None, None),
        ("gligen_textbox_model", "GLIGEN", None, None, None), ("text", "STRING", "", None, None),
        ("width", "INT", 64, 8, 8), ("height", "INT", 64, 8, 8), ("x", "INT", 0, 0, 8), ("y", "INT", 0, 0, 8)]
    assert [o.name for o in apply.outputs] == ["CONDITIONING"]
    loader = registry.get("GLIGENLoader")
    assert loader.inputs[0].name == "gligen_name" and [o.name for o in loader.outputs] == ["GLIGEN"]


def test_text_boxes_chain_and_one_step_matches_the_unet_with_the_middle_patch(settings, models_root) -> None:
    cfg = 4.0
    workflow = Workflow()
    checkpoint = add(workflow, "CheckpointLoaderSimple", ckpt_name="sd1.safetensors")
    positive = add(workflow, "CLIPTextEncode", {"clip": (checkpoint, 1, "CLIP")}, text="a meadow")
    negative = add(workflow, "CLIPTextEncode", {"clip": (checkpoint, 1, "CLIP")}, text="blurry")
    loader = add(workflow, "GLIGENLoader", gligen_name="gligen_tiny.safetensors")
    pos = (positive, 0)
    for text, width, height, x, y in BOXES:
        pos = (add(workflow, "GLIGENTextBoxApply", {"conditioning_to": (*pos, "CONDITIONING"),
                                                    "clip": (checkpoint, 1, "CLIP"),
                                                    "gligen_textbox_model": (loader, 0, "GLIGEN")},
                   text=text, width=width, height=height, x=x, y=y), 0)
    latent = add(workflow, "EmptyLatentImage", width=SIZE, height=SIZE, batch_size=1)
    sampled = add(workflow, "KSampler", {"model": (checkpoint, 0, "MODEL"),
                                         "positive": (*pos, "CONDITIONING"),
                                         "negative": (negative, 0, "CONDITIONING"),
                                         "latent_image": (latent, 0, "LATENT")},
                  seed=42, steps=1, cfg=cfg, sampler_name="euler", scheduler="normal", denoise=1.0)
    captures = {"latent": add(workflow, "Capture", {"value": (sampled, 0, "LATENT")}),
                "positive": add(workflow, "Capture", {"value": (*pos, "CONDITIONING")})}
    registry = default_registry()
    registry.register(Capture)
    Capture.seen.clear()
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status == "finished", (result.errors, result.failure)

    model, clip, _ = load_checkpoint(models_root / "checkpoints" / "sd1.safetensors")
    (_, options), = Capture.seen[captures["positive"]]
    kind, gligen, boxes = options["gligen"]
    assert kind == "position" and gligen is load_gligen(models_root / "gligen" / "gligen_tiny.safetensors")
    assert [box[1:] for box in boxes] == [(h // 8, w // 8, y // 8, x // 8) for _, w, h, x, y in BOXES]
    for (text, *_), box in zip(BOXES, boxes, strict=True):
        with torch.no_grad():
            _, pooled = encode_weighted(clip.encoders[0], SD1_CLIP_L, clip.tokenize(text)["clip_l"], None,
                                        return_pooled=True)
        torch.testing.assert_close(box[0], pooled, rtol=0, atol=1e-6)

    sampling = model.model_sampling
    sigma = sampling.sigma_max.reshape(1)
    noise = prepare_noise(torch.zeros(1, 4, SIZE // 8, SIZE // 8), 42)
    x = sampling.noise_scaling(sigma, noise, torch.zeros_like(noise), True)
    denoiser = model.denoiser()
    patch = GLIGENPosition(gligen, boxes).middle_patch(x)
    with torch.no_grad():
        cond = denoiser(x, sigma, context=clip.encode("a meadow")[0][0], middle_patch=patch)
        plain = denoiser(x, sigma, context=clip.encode("a meadow")[0][0])
        uncond = denoiser(x, sigma, context=clip.encode("blurry")[0][0])
    assert (cond - plain).abs().max() > 1e-3  # the boxes change the prediction
    expected = model.process_out(uncond + (cond - uncond) * cfg)
    torch.testing.assert_close(Capture.seen[captures["latent"]]["samples"], expected, rtol=1e-5, atol=1e-4)
