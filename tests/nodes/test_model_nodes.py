"""The model nodes run through the real registry and executor on tiny random-weight checkpoints, compared
with our models driven directly (weights read by safetensors itself, not by the loader)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import nodes.loaders
from app.cli import main
from engine import telemetry
from engine.graph.document import Workflow
from engine.graph.executor import Executor, JobResult
from engine.images import png_text
from engine.models.clip import CLIPTextModel, component_prefix
from engine.models.conditioning import SD1Conditioner, SD2Conditioner, SDXLConditioner
from engine.models.loader import load_checkpoint
from engine.models.tokenizer import CLIPTokenizer
from engine.models.vae import AutoencoderKL
from engine.sampling.guidance import Conditioning
from engine.sampling.sample import sample
from engine.settings import Settings
from nodes.registry import default_registry

sys.path.insert(0, str(Path(__file__).parents[1] / "engine" / "models"))
from sd_checkpoints import write_checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from capture_node import Capture  # noqa: E402

CONDITIONERS = {"sd1": SD1Conditioner, "sd2": SD2Conditioner, "sdxl": SDXLConditioner}


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for folder in ("checkpoints", "diffusion_models", "text_encoders", "vae"):
        (root / folder).mkdir()
    for index, family in enumerate(("sd1", "sd2", "sdxl")):
        write_checkpoint(root / "checkpoints" / f"{family}.safetensors", family, seed=10 + index)
    tensors = load_file(root / "checkpoints" / "sd1.safetensors")
    for folder, prefix in (("diffusion_models", "model.diffusion_model."), ("vae", "first_stage_model."),
                           ("text_encoders", "cond_stage_model.transformer.")):
        part = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        save_file(part, root / folder / "sd1_part.safetensors")
    write_checkpoint(root / "checkpoints" / "unet_only.safetensors", "sd1", components=("diffusion",))
    (root / "checkpoints" / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    return root


@pytest.fixture(autouse=True)
def compute_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The references run in float32 on the CPU; so do the nodes, also on a machine with a GPU."""
    monkeypatch.setattr(nodes.loaders, "COMPUTE_DEVICE", "cpu")


@pytest.fixture
def settings(models_root: Path, tmp_path: Path) -> Settings:
    settings = Settings(models_root, tmp_path / "output", None)
    nodes.loaders.configure(settings)
    yield settings
    nodes.loaders.configure(None)


def run(settings: Settings, workflow: Workflow) -> JobResult:
    registry = default_registry()
    registry.register(Capture)
    Capture.seen.clear()
    return Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)


def add(workflow: Workflow, node_type: str, inputs: dict[str, Any] | None = None, **widgets: Any) -> str:
    """Add a node; `inputs` maps input name -> (source node id, output index, type)."""
    node = workflow.add_node(node_type, widgets)
    for name, (source, output, type_name) in (inputs or {}).items():
        workflow.connect(source, output, node.id, name, type_name)
    return node.id


def capture(workflow: Workflow, source: str, output: int, type_name: str) -> str:
    return add(workflow, "Capture", {"value": (source, output, type_name)})


def direct_models(path: Path, family: str) -> dict[str, Any]:
    """Our models bound straight from the file's tensors (safetensors' reader) with the loader's configs."""
    tensors = load_file(path)
    model, clip, vae = load_checkpoint(path)
    encoders = []
    for encoder in clip.encoders:
        reference = CLIPTextModel(encoder.config, device="meta")
        prefix = component_prefix(encoder.config)
        reference.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)
                                   and k[len(prefix):] in reference.state_dict()}, assign=True)
        encoders.append(reference)
    scale = 0.13025 if family == "sdxl" else 0.18215
    config = dataclasses.replace(vae.autoencoder.config, scale_factor=scale)
    autoencoder = AutoencoderKL(config, device="meta")
    autoencoder.load_state_dict({k[len("first_stage_model."):]: v for k, v in tensors.items()
                                 if k.startswith("first_stage_model.")}, assign=True)
    return {"conditioner": CONDITIONERS[family](*encoders), "encoders": encoders, "model": model,
            "autoencoder": autoencoder, "scale": scale, "vae": vae}


def direct_encode(models: dict[str, Any], text: str, clip_skip: int | None = None) -> Any:
    kinds = [e.config.kind for e in models["encoders"]]
    nothing = lambda name: None  # noqa: E731 - the nodes' lookup finds none: references are dropped
    chunks = {kind: CLIPTokenizer("eos" if kind == "clip_l" else "zero").tokenize_weighted(text, nothing)
              for kind in kinds}
    per_encoder = chunks if len(chunks) == 2 else next(iter(chunks.values()))
    return models["conditioner"].encode(per_encoder, clip_skip)


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_checkpoint_loader_text_encode_and_vae_match_the_models_run_directly(
        settings: Settings, family: str) -> None:
    workflow = Workflow()
    ckpt = add(workflow, "CheckpointLoaderSimple", ckpt_name=f"{family}.safetensors")
    prompt = "a (red:1.3) fox, embedding:nope"
    text = add(workflow, "CLIPTextEncode", {"clip": (ckpt, 1, "CLIP")}, text=prompt)
    latent = add(workflow, "EmptyLatentImage", width=64, height=48, batch_size=2)
    decoded = add(workflow, "VAEDecode", {"samples": (latent, 0, "LATENT"), "vae": (ckpt, 2, "VAE")})
    encoded = add(workflow, "VAEEncode", {"pixels": (decoded, 0, "IMAGE"), "vae": (ckpt, 2, "VAE")})
    captured = [capture(workflow, text, 0, "CONDITIONING"), capture(workflow, decoded, 0, "IMAGE"),
                capture(workflow, encoded, 0, "LATENT")]
    result = run(settings, workflow)
    assert result.status == "finished", result.failure
    [[context, extras]], image, latent_out = (Capture.seen[n] for n in captured)

    models = direct_models(settings.models_root / "checkpoints" / f"{family}.safetensors", family)
    expected = direct_encode(models, prompt)
    torch.testing.assert_close(context, expected.context, atol=1e-5, rtol=1e-5)
    if family == "sdxl":
        torch.testing.assert_close(extras["pooled_output"], expected.pooled, atol=1e-5, rtol=1e-5)
    autoencoder, scale = models["autoencoder"], models["scale"]
    pixels = autoencoder.decode(torch.zeros(2, 4, 6, 8) * scale)
    torch.testing.assert_close(image, ((pixels + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1), atol=1e-5, rtol=0)
    reference_latent = autoencoder.encode(image.permute(0, 3, 1, 2) * 2 - 1) / scale  # raw (unscaled) latent
    torch.testing.assert_close(latent_out["samples"], reference_latent, atol=1e-5, rtol=1e-5)


def test_split_loaders_and_clip_set_last_layer(settings: Settings) -> None:
    workflow = Workflow()
    unet = add(workflow, "UNETLoader", unet_name="sd1_part.safetensors", weight_dtype="bf16")
    clip = add(workflow, "CLIPLoader", clip_name="sd1_part.safetensors", type="stable_diffusion")
    vae = add(workflow, "VAELoader", vae_name="sd1_part.safetensors")
    skip = add(workflow, "CLIPSetLastLayer", {"clip": (clip, 0, "CLIP")}, stop_at_clip_layer=-2)
    text = add(workflow, "CLIPTextEncode", {"clip": (skip, 0, "CLIP")}, text="a lighthouse")
    captured = [capture(workflow, unet, 0, "MODEL"), capture(workflow, vae, 0, "VAE"),
                capture(workflow, text, 0, "CONDITIONING")]
    result = run(settings, workflow)
    assert result.status == "finished", result.failure
    model, vae_model, [[context, _]] = (Capture.seen[n] for n in captured)
    single = direct_models(settings.models_root / "checkpoints" / "sd1.safetensors", "sd1")
    assert model.dtype == torch.bfloat16
    for name, tensor in single["model"].unet.state_dict().items():
        assert torch.equal(model.unet.state_dict()[name], tensor.to(torch.bfloat16)), name
    for name, tensor in single["vae"].autoencoder.state_dict().items():
        assert torch.equal(vae_model.autoencoder.state_dict()[name], tensor), name
    expected = direct_encode(single, "a lighthouse", clip_skip=2)
    torch.testing.assert_close(context, expected.context, atol=1e-5, rtol=1e-5)

    workflow.nodes[skip].widgets["stop_at_clip_layer"] = -3  # the tiny CLIP has 2 layers
    failed = run(settings, workflow)
    assert failed.status == "failed"
    assert "stop_at_clip_layer -3 is out of range" in failed.failure.message
    assert "accepted: -1 to -2" in failed.failure.message


def test_model_choices_list_the_models_folder_and_validation_rejects_others(settings: Settings) -> None:
    from engine.graph.validate import validate

    registry = default_registry()
    choices = registry.get("CheckpointLoaderSimple").input_named("ckpt_name").current_choices()
    embedded = ["sluice-shapes.safetensors"]  # resources/models ships the embedded model
    assert choices == sorted(["broken.safetensors", "sd1.safetensors", "sd2.safetensors", "sdxl.safetensors",
                              "unet_only.safetensors", *embedded])
    workflow = Workflow()
    ckpt = add(workflow, "CheckpointLoaderSimple", ckpt_name="missing.safetensors")
    add(workflow, "VAEDecode", {"vae": (ckpt, 2, "VAE")})
    messages = [str(e) for e in validate(workflow, registry.get)]
    assert any("'missing.safetensors' is not one of the choices" in m for m in messages)


def test_broken_file_and_missing_vae_fail_with_clear_node_errors(settings: Settings) -> None:
    workflow = Workflow()
    ckpt = add(workflow, "CheckpointLoaderSimple", ckpt_name="broken.safetensors")
    capture(workflow, ckpt, 0, "MODEL")
    failed = run(settings, workflow)
    assert failed.status == "failed" and failed.failure.node_type == "CheckpointLoaderSimple"
    assert "broken.safetensors" in failed.failure.message and "corrupt" in failed.failure.message

    workflow = Workflow()
    ckpt = add(workflow, "CheckpointLoaderSimple", ckpt_name="unet_only.safetensors")
    latent = add(workflow, "EmptyLatentImage", width=64, height=64, batch_size=1)
    decoded = add(workflow, "VAEDecode", {"samples": (latent, 0, "LATENT"), "vae": (ckpt, 2, "VAE")})
    capture(workflow, decoded, 0, "IMAGE")
    failed = run(settings, workflow)
    assert failed.status == "failed" and failed.failure.node_type == "VAEDecode"
    assert "'unet_only.safetensors' has no VAE; add a VAELoader" in failed.failure.message


def test_load_image_save_image_and_preview_through_the_executor(settings: Settings) -> None:
    input_dir = settings.output_dir.parent / "input"
    input_dir.mkdir()
    rgba = Image.new("RGBA", (20, 12), (200, 40, 10, 255))
    rgba.putpixel((3, 4), (0, 0, 0, 0))
    rgba.save(input_dir / "fox.png")
    workflow = Workflow()
    load = add(workflow, "LoadImage", image="fox.png")
    add(workflow, "SaveImage", {"images": (load, 0, "IMAGE")}, filename_prefix="tests/fox")
    add(workflow, "PreviewImage", {"images": (load, 0, "IMAGE")})
    mask = capture(workflow, load, 1, "MASK")
    events = telemetry.EventRecorder(telemetry.bus)
    try:
        assert run(settings, workflow).status == "finished"
        workflow.nodes[load].widgets["image"] = str(input_dir / "fox.png")  # an absolute path reruns
        assert run(settings, workflow).status == "finished"
    finally:
        telemetry.bus._subscribers.remove(events)
    saved = [Path(e["path"]) for e in events.of_kind("image_saved")]
    assert [p.name for p in saved] == ["fox_00001_.png", "fox_00002_.png"]
    assert len(events.of_kind("image_preview")) == 2
    with Image.open(saved[0]) as image:
        assert image.mode == "RGB" and image.getpixel((0, 0)) == (200, 40, 10)
    assert Workflow.loads(png_text(saved[1])["sluice-workflow"]).to_dict() == workflow.to_dict()
    prompt = json.loads(png_text(saved[1])["prompt"])
    assert prompt[load] == {"class_type": "LoadImage", "inputs": {"image": str(input_dir / "fox.png")},
                            "_meta": {"title": "Load Image"}}
    expected_mask = torch.zeros(1, 12, 20)
    expected_mask[0, 4, 3] = 1.0
    assert torch.equal(Capture.seen[mask], expected_mask)


def _txt2img_workflow(path: Path, sampler: str) -> None:
    workflow = Workflow()
    ckpt = add(workflow, "CheckpointLoaderSimple", ckpt_name="sd1.safetensors")
    positive = add(workflow, "CLIPTextEncode", {"clip": (ckpt, 1, "CLIP")}, text="a watercolor fox")
    negative = add(workflow, "CLIPTextEncode", {"clip": (ckpt, 1, "CLIP")}, text="blurry")
    latent = add(workflow, "EmptyLatentImage", width=64, height=64, batch_size=1)
    links = {"model": (ckpt, 0, "MODEL"), "positive": (positive, 0, "CONDITIONING"),
             "negative": (negative, 0, "CONDITIONING"), "latent_image": (latent, 0, "LATENT")}
    sampled = add(workflow, "KSampler", links,
                  seed=7, steps=3, cfg=5.0, sampler_name=sampler, scheduler="karras", denoise=1.0)
    decoded = add(workflow, "VAEDecode", {"samples": (sampled, 0, "LATENT"), "vae": (ckpt, 2, "VAE")})
    add(workflow, "SaveImage", {"images": (decoded, 0, "IMAGE")}, filename_prefix="txt2img")
    workflow.save(path)


@pytest.mark.parametrize("sampler", ["euler_ancestral", "dpmpp_2m"])
def test_txt2img_through_the_cli_matches_sampling_directly(
        models_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        sampler: str) -> None:
    monkeypatch.setenv("SLUICE_MODELS", str(models_root))  # model choices are validated without the flags
    monkeypatch.setenv("SLUICE_SETTINGS", str(tmp_path / "no-settings.json"))
    _txt2img_workflow(tmp_path / "txt2img.json", sampler)
    code = main(["run", str(tmp_path / "txt2img.json"), "--models", str(models_root),
                 "--output", str(tmp_path / "out"), "--quiet"])
    assert code == 0, capsys.readouterr().err
    [saved] = capsys.readouterr().out.split()
    assert Path(saved) == tmp_path / "out" / "txt2img_00001_.png"
    assert Workflow.loads(png_text(saved)["sluice-workflow"]).nodes["5"].widgets["sampler_name"] == sampler

    models = direct_models(models_root / "checkpoints" / "sd1.safetensors", "sd1")
    model = models["model"]
    positive, negative = direct_encode(models, "a watercolor fox"), direct_encode(models, "blurry")
    latent = sample(model.denoiser(), torch.zeros(1, 4, 8, 8), Conditioning(positive.context),
                    Conditioning(negative.context), 5.0, sampler, "karras", 3, 7)
    pixels = models["autoencoder"].decode(latent)  # the model-space latent: the LDM decode unscales it
    expected = ((pixels + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1)[0]
    with Image.open(saved) as image:
        written = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)
    assert (written - expected).abs().max() <= 1 / 255 + 1e-6

    code = main(["run", saved, "--models", str(models_root), "--output", str(tmp_path / "out"), "--quiet"])
    assert code == 0, capsys.readouterr().err  # the PNG's embedded workflow runs again: same image
    [again] = capsys.readouterr().out.split()
    assert Path(again).name == "txt2img_00002_.png"
    with Image.open(saved) as first, Image.open(again) as second:
        assert np.array_equal(np.asarray(first), np.asarray(second))


def test_ksampler_advanced_in_two_halves_equals_one_ksampler(settings: Settings) -> None:
    workflow = Workflow()
    ckpt = add(workflow, "CheckpointLoaderSimple", ckpt_name="sdxl.safetensors")
    positive = add(workflow, "CLIPTextEncodeSDXL", {"clip": (ckpt, 1, "CLIP")}, width=64, height=64,
                   target_width=64, target_height=64, text_g="a castle", text_l="oil painting")
    negative = add(workflow, "CLIPTextEncode", {"clip": (ckpt, 1, "CLIP")}, text="")
    latent = add(workflow, "EmptyLatentImage", width=64, height=64, batch_size=1)
    links = {"model": (ckpt, 0, "MODEL"), "positive": (positive, 0, "CONDITIONING"),
             "negative": (negative, 0, "CONDITIONING")}
    common = {"steps": 4, "cfg": 4.0, "sampler_name": "euler", "scheduler": "normal"}
    whole = add(workflow, "KSampler", {**links, "latent_image": (latent, 0, "LATENT")}, seed=3, denoise=1.0,
                **common)
    first = add(workflow, "KSamplerAdvanced", {**links, "latent_image": (latent, 0, "LATENT")},
                add_noise="enable", noise_seed=3, start_at_step=0, end_at_step=2,
                return_with_leftover_noise="enable", **common)
    second = add(workflow, "KSamplerAdvanced", {**links, "latent_image": (first, 0, "LATENT")},
                 add_noise="disable", noise_seed=0, start_at_step=2, end_at_step=10000,
                 return_with_leftover_noise="disable", **common)
    captured = [capture(workflow, whole, 0, "LATENT"), capture(workflow, second, 0, "LATENT")]
    recorder = telemetry.EventRecorder()
    registry = default_registry()
    registry.register(Capture)
    bus = telemetry.EventBus()
    bus.subscribe(recorder)
    result = Executor(registry.get, bus=bus, settings=settings).run(workflow)
    assert result.status == "finished", result.failure
    torch.testing.assert_close(Capture.seen[captured[1]]["samples"], Capture.seen[captured[0]]["samples"],
                               atol=1e-4, rtol=1e-4)
    progress = [(e["value"], e["max"]) for e in recorder.of_kind("progress") if e["node_id"] == whole]
    assert progress == [(1, 4), (2, 4), (3, 4), (4, 4)]
    previews = [e["image"] for e in recorder.of_kind("preview") if e["node_id"] == whole]
    assert len(previews) == 4 and previews[0].shape == (8, 8, 3)
