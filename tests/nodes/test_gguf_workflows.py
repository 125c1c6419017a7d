"""Quantised GGUF models through the ordinary workflow path (issue 17's acceptance): ComfyUI-GGUF-style files
of a tiny SD1 UNet and a tiny FLUX transformer (and a llama.cpp-named T5) in Q8_0 and Q4_K, loaded by
ComfyUI-GGUF's nodes, give exactly the images of their dequantised float32 copies loaded by the ordinary
loaders. The files and copies are made by gguf's writer and dequantiser (tests/engine/quant/gguf_models.py),
not by Sluice."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import nodes.loaders
from engine import telemetry
from engine.graph.comfy import from_comfy_api, from_comfy_ui
from engine.graph.executor import Executor
from engine.memory.runtime import MemoryRuntime, set_runtime
from engine.models.loader import clear_cache
from engine.quant.modules import QUANT_LAYERS
from engine.settings import Settings
from nodes.registry import default_registry
from tests.engine.models.flux_checkpoints import write_flux_files
from tests.engine.models.sd_checkpoints import write_checkpoint
from tests.engine.quant.gguf_models import count_types, quant_flux_state, write_quantised_gguf
from tests.nodes.capture_node import Capture

SIZE = 64  # pixels: an 8 x 8 latent
TYPES = ("Q8_0", "Q4_K")
UNET_PREFIX = "model.diffusion_model."
T5_LAYERS = {"layer.0.SelfAttention.q": "attn_q", "layer.0.SelfAttention.k": "attn_k",
             "layer.0.SelfAttention.v": "attn_v", "layer.0.SelfAttention.o": "attn_o",
             "layer.0.SelfAttention.relative_attention_bias": "attn_rel_b", "layer.0.layer_norm": "attn_norm",
             "layer.1.DenseReluDense.wi_0": "ffn_gate", "layer.1.DenseReluDense.wi_1": "ffn_up",
             "layer.1.DenseReluDense.wo": "ffn_down", "layer.1.layer_norm": "ffn_norm"}


def llama_t5_name(key: str) -> str:
    """llama.cpp's name of a transformers T5 encoder key (the names of the T5 GGUFs ComfyUI-GGUF reads)."""
    if key == "shared.weight":
        return "token_embd.weight"
    if key.startswith("encoder.final_layer_norm."):
        return "enc.output_norm." + key.rsplit(".", 1)[1]
    block, layer, suffix = re.fullmatch(r"encoder\.block\.(\d+)\.(.+)\.(weight|bias)", key).groups()
    return f"enc.blk.{block}.{T5_LAYERS[layer]}.{suffix}"


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf") / "models"
    write_flux_files(root)
    write_checkpoint(root / "checkpoints" / "sd1.safetensors", "sd1", size="tiny")
    unet = {k[len(UNET_PREFIX):]: v for k, v in load_file(root / "checkpoints" / "sd1.safetensors").items()
            if k.startswith(UNET_PREFIX)}
    t5 = load_file(root / "text_encoders" / "t5xxl_fp16.safetensors")
    for qtype in TYPES:
        for name, state, arch in (("sd1", unet, "sd1"), ("flux", quant_flux_state(), "flux")):
            folder = root / "diffusion_models"
            copy = write_quantised_gguf(folder / f"{name}-{qtype}.gguf", state, qtype, arch)
            save_file(copy, folder / f"{name}-{qtype}-dequantised.safetensors")
        named = {llama_t5_name(k): v.float() for k, v in t5.items()}
        copy = write_quantised_gguf(root / "text_encoders" / f"t5-{qtype}.gguf", named, qtype, "t5encoder")
        hf_names = {llama_t5_name(k): k for k in t5}
        save_file({hf_names[k]: v for k, v in copy.items()},
                  root / "text_encoders" / f"t5-{qtype}-dequantised.safetensors")
    return root


@pytest.fixture
def settings(models_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setattr(nodes.loaders, "COMPUTE_DEVICE", "cpu")  # float32 references on every machine
    settings = Settings(models_root, tmp_path / "out", None)
    nodes.loaders.configure(settings)
    previous = set_runtime(MemoryRuntime())
    clear_cache()
    yield settings
    clear_cache()
    set_runtime(previous)
    nodes.loaders.configure(None)


def run_prompt(prompt: dict, settings: Settings) -> dict:
    registry = default_registry(settings)
    registry.register(Capture)
    Capture.seen.clear()
    workflow, _ = from_comfy_api(prompt, registry.get)
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status == "finished", result.failure or result.errors
    return dict(Capture.seen)


def sd1_prompt(unet: dict) -> dict:
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sd1.safetensors"}},
        "2": unet,
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red cube", "clip": ["1", 1]}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {
            "seed": 7, "steps": 2, "cfg": 5.0, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0,
            "model": ["2", 0], "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0]}},
        "7": {"class_type": "VAEDecode", "inputs": {"samples": ["6", 0], "vae": ["1", 2]}},
        "8": {"class_type": "Capture", "inputs": {"value": ["7", 0]}},
        "9": {"class_type": "Capture", "inputs": {"value": ["2", 0]}},
    }


def flux_prompt(unet: dict, clip: dict) -> dict:
    return {
        "10": {"class_type": "VAELoader", "inputs": {"vae_name": "ae.safetensors"}},
        "11": clip,
        "12": unet,
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red cube on a table", "clip": ["11", 0]}},
        "26": {"class_type": "FluxGuidance", "inputs": {"guidance": 3.5, "conditioning": ["6", 0]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["11", 0]}},
        "27": {"class_type": "EmptySD3LatentImage", "inputs": {"width": SIZE, "height": SIZE,
                                                               "batch_size": 1}},
        "13": {"class_type": "KSampler", "inputs": {
            "seed": 3, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
            "model": ["12", 0], "positive": ["26", 0], "negative": ["7", 0], "latent_image": ["27", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["13", 0], "vae": ["10", 0]}},
        "9": {"class_type": "Capture", "inputs": {"value": ["8", 0]}},
        "14": {"class_type": "Capture", "inputs": {"value": ["12", 0]}},
    }


@pytest.mark.parametrize("qtype", TYPES)
def test_a_quantised_sd1_unet_gives_the_images_of_its_dequantised_copy(models_root, settings, qtype):
    assert count_types(models_root / "diffusion_models" / f"sd1-{qtype}.gguf")[qtype] > 10
    seen = run_prompt(sd1_prompt({"class_type": "UnetLoaderGGUF",
                                  "inputs": {"unet_name": f"sd1-{qtype}.gguf"}}), settings)
    quantised = seen["8"]
    copy = run_prompt(sd1_prompt({"class_type": "UNETLoader", "inputs": {
        "unet_name": f"sd1-{qtype}-dequantised.safetensors", "weight_dtype": "default"}}), settings)["8"]
    layers = [m for m in seen["9"].unet.modules() if isinstance(m, QUANT_LAYERS)]
    assert len(layers) > 10 and {m.qtype for m in layers} == {qtype}  # the weights rested quantised
    assert quantised.shape[-1] == 3 and torch.isfinite(quantised).all()
    assert torch.equal(quantised, copy)


@pytest.mark.parametrize("qtype", TYPES)
def test_a_quantised_flux_transformer_and_t5_give_the_images_of_their_dequantised_copies(settings, qtype):
    gguf_clip = {"class_type": "DualCLIPLoaderGGUF", "inputs": {
        "clip_name1": f"t5-{qtype}.gguf", "clip_name2": "clip_l.safetensors", "type": "flux"}}
    plain_clip = {"class_type": "DualCLIPLoader", "inputs": {
        "clip_name1": f"t5-{qtype}-dequantised.safetensors", "clip_name2": "clip_l.safetensors",
        "type": "flux"}}
    quantised = run_prompt(flux_prompt({"class_type": "UnetLoaderGGUF",
                                        "inputs": {"unet_name": f"flux-{qtype}.gguf"}}, gguf_clip), settings)
    plain_unet = {"class_type": "UNETLoader", "inputs": {
        "unet_name": f"flux-{qtype}-dequantised.safetensors", "weight_dtype": "default"}}
    copy = run_prompt(flux_prompt(plain_unet, plain_clip), settings)
    layers = [m for m in quantised["14"].unet.modules() if isinstance(m, QUANT_LAYERS)]
    assert len(layers) > 10 and {m.qtype for m in layers} == {qtype}
    assert torch.isfinite(quantised["9"]).all()
    assert torch.equal(quantised["9"], copy["9"])


def test_our_loaders_take_gguf_files_too(models_root, settings):
    """UNETLoader reads the GGUF UnetLoaderGGUF reads, to the same image."""
    gguf_node = run_prompt(sd1_prompt({"class_type": "UnetLoaderGGUF",
                                       "inputs": {"unet_name": "sd1-Q8_0.gguf"}}), settings)["8"]
    clear_cache()
    ours = run_prompt(sd1_prompt({"class_type": "UNETLoader", "inputs": {
        "unet_name": "sd1-Q8_0.gguf", "weight_dtype": "default"}}), settings)["8"]
    assert torch.equal(gguf_node, ours)
    registry = default_registry(settings)  # the text encoder loaders list GGUF files (one load_text_encoders)
    for node, widget in (("CLIPLoader", "clip_name"), ("DualCLIPLoader", "clip_name1")):
        assert "t5-Q8_0.gguf" in registry.get(node).input_named(widget).current_choices()


def test_the_gguf_nodes_have_comfyui_ggufs_names_inputs_and_outputs(settings):
    registry = default_registry(settings)
    placement = ["backend", "params_backend"]
    expected = {"UnetLoaderGGUF": (["unet_name", *placement], ["MODEL"]),
                "UnetLoaderGGUFAdvanced": (["unet_name", "dequant_dtype", "patch_dtype", "patch_on_device",
                                            *placement], ["MODEL"]),
                "CLIPLoaderGGUF": (["clip_name", "type", *placement], ["CLIP"]),
                "DualCLIPLoaderGGUF": (["clip_name1", "clip_name2", "type", *placement], ["CLIP"]),
                "TripleCLIPLoaderGGUF": (["clip_name1", "clip_name2", "clip_name3"], ["CLIP"]),
                "QuadrupleCLIPLoaderGGUF": ([f"clip_name{i}" for i in (1, 2, 3, 4)], ["CLIP"])}
    for name, (inputs, outputs) in expected.items():
        node_type = registry.get(name)
        assert [i.name for i in node_type.inputs] == inputs
        assert [o.type for o in node_type.outputs] == outputs
    advanced = registry.get("UnetLoaderGGUFAdvanced")
    assert advanced.input_named("dequant_dtype").choices == ("default", "target", "float32", "float16",
                                                             "bfloat16")
    assert advanced.default_widget_values()["patch_on_device"] is False
    unet_choices = registry.get("UnetLoaderGGUF").input_named("unet_name").current_choices()
    assert unet_choices and all(choice.endswith(".gguf") for choice in unet_choices)
    clip_choices = registry.get("CLIPLoaderGGUF").input_named("clip_name").current_choices()
    assert "t5-Q8_0.gguf" in clip_choices and "clip_l.safetensors" in clip_choices


@pytest.mark.parametrize(("dequant_dtype", "patch_dtype", "patch_on_device"), [
    ("target", "default", True), ("float32", "float32", False)])
def test_the_advanced_unet_loader_runs_the_compute_dtype_as_the_plain_one(settings, dequant_dtype,
                                                                           patch_dtype, patch_on_device):
    """ComfyUI-GGUF's dequant_dtype / patch_dtype naming the compute dtype (float32 on the CPU), or target,
    give UnetLoaderGGUF's image."""
    plain = run_prompt(sd1_prompt({"class_type": "UnetLoaderGGUF",
                                   "inputs": {"unet_name": "sd1-Q4_K.gguf"}}), settings)["8"]
    advanced = run_prompt(sd1_prompt({"class_type": "UnetLoaderGGUFAdvanced", "inputs": {
        "unet_name": "sd1-Q4_K.gguf", "dequant_dtype": dequant_dtype, "patch_dtype": patch_dtype,
        "patch_on_device": patch_on_device}}), settings)["8"]
    assert torch.equal(plain, advanced)


def failure(prompt: dict, settings: Settings) -> str:
    registry = default_registry(settings)
    registry.register(Capture)
    workflow, _ = from_comfy_api(prompt, registry.get)
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status != "finished"
    return str(result.failure or result.errors)


def test_what_sluice_cannot_apply_of_comfyui_ggufs_loaders_is_refused_by_name(settings):
    advanced = {"class_type": "UnetLoaderGGUFAdvanced", "inputs": {
        "unet_name": "sd1-Q8_0.gguf", "dequant_dtype": "default", "patch_dtype": "bfloat16",
        "patch_on_device": False}}
    message = failure(sd1_prompt(advanced), settings)
    assert "patch_dtype 'bfloat16' is not this model's compute dtype (float32)" in message
    assert "accepted: default, target, float32" in message
    names = {f"clip_name{i}": "clip_l.safetensors" for i in (1, 2, 3, 4)}
    for node, loads in (("TripleCLIPLoaderGGUF", "SD3's text encoders"),
                        ("QuadrupleCLIPLoaderGGUF", "HiDream's text encoders")):
        inputs = dict(list(names.items())[:3]) if node.startswith("Triple") else names
        prompt = {"1": {"class_type": node, "inputs": inputs},
                  "2": {"class_type": "Capture", "inputs": {"value": ["1", 0]}}}
        message = failure(prompt, settings)
        assert f"{node} loads {loads}" in message
        assert "DualCLIPLoaderGGUF (type sdxl, flux)" in message


def test_comfyui_gguf_nodes_import_from_a_comfyui_workflow_file(settings):
    """ComfyUI's saved workflows give each node's widget values by position, in ComfyUI-GGUF's input order."""
    values = {"UnetLoaderGGUF": ["flux-Q8_0.gguf"],
              "UnetLoaderGGUFAdvanced": ["flux-Q8_0.gguf", "target", "float16", True],
              "CLIPLoaderGGUF": ["t5-Q8_0.gguf", "sd1"],
              "DualCLIPLoaderGGUF": ["clip_l.safetensors", "t5-Q8_0.gguf", "flux"],
              "TripleCLIPLoaderGGUF": ["clip_l.safetensors", "clip_l.safetensors", "t5-Q8_0.gguf"],
              "QuadrupleCLIPLoaderGGUF": ["clip_l.safetensors", "clip_l.safetensors", "t5-Q8_0.gguf",
                                          "t5-Q8_0.gguf"]}
    nodes = [{"id": index, "type": name, "pos": [0, 0], "size": [300, 100], "mode": 0, "inputs": [],
              "outputs": [], "widgets_values": widget_values}
             for index, (name, widget_values) in enumerate(values.items(), start=1)]
    registry = default_registry(settings)
    workflow, warnings = from_comfy_ui({"nodes": nodes, "links": [], "version": 0.4}, registry.get)
    assert warnings == []
    for index, (name, widget_values) in enumerate(values.items(), start=1):
        node_type = registry.get(name)
        names = [i.name for i in node_type.widget_inputs()][:len(widget_values)]
        assert {k: workflow.nodes[str(index)].widgets[k] for k in names} == dict(zip(names, widget_values,
                                                                                    strict=True))
