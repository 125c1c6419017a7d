"""ComfyUI's published example workflows (comfyanonymous.github.io/ComfyUI_examples, and the templates ComfyUI
once shipped in comfy/web/templates), written into fixtures by hand from their UI JSON: they import with their
widget values and `sluice validate` passes once the models they name exist."""

from __future__ import annotations

import json
from pathlib import Path

from app.cli import main
from engine.graph.comfy import from_comfy_ui
from engine.graph.validate import validate
from engine.settings import load_settings
from nodes.registry import default_registry

FIXTURES = Path(__file__).parent / "fixtures"
UNCLIP_EXAMPLE = FIXTURES / "comfyui_unclip_example.json"  # unclip/unclip_workflow.json: two images


def test_comfyuis_unclip_example_imports_with_its_widget_values():
    registry = default_registry()
    workflow, warnings = from_comfy_ui(json.loads(UNCLIP_EXAMPLE.read_text(encoding="utf-8")), registry.get)
    # the example predates CLIPVisionEncode's crop widget: ComfyUI's default (center) fills it in
    assert warnings == [f"node {n} (CLIPVisionEncode): widgets_values has no value for crop; using the "
                        f"default" for n in (10, 11)]
    widgets = {node_id: node.widgets for node_id, node in workflow.nodes.items()}
    assert widgets["10"] == widgets["11"] == {"crop": "center"}
    assert widgets["15"] == {"strength": 0.45, "noise_augmentation": 0.4}
    assert widgets["16"] == {"strength": 0.55, "noise_augmentation": 0.4}
    assert widgets["14"]["ckpt_name"] == "sd21-unclip-h.ckpt"
    assert widgets["3"]["sampler_name"] == "uni_pc_bh2" and widgets["3"]["steps"] == 26
    assert len(workflow.links) == 17
    errors = validate(workflow, registry.get)
    assert [(e.node_id, e.input_name) for e in errors] == [("14", "ckpt_name")]


def test_cli_validate_passes_on_comfyuis_unclip_example_with_its_checkpoint(tmp_path, capsys):
    models = tmp_path / "models"
    (models / "checkpoints").mkdir(parents=True)
    (models / "checkpoints" / "sd21-unclip-h.ckpt").write_bytes(b"")  # validation reads names, not files
    code = main(["--plugins", str(tmp_path / "plugins"), "--models", str(models), "--output",
                 str(tmp_path / "out"), "validate", str(UNCLIP_EXAMPLE)])
    out, _ = capsys.readouterr()
    assert code == 0, out


GLIGEN_EXAMPLE = FIXTURES / "comfyui_gligen_example.json"  # ComfyUI's gligen_textbox_example template


def test_comfyuis_gligen_example_imports_and_validates_with_its_models(tmp_path, capsys):
    registry = default_registry()
    workflow, warnings = from_comfy_ui(json.loads(GLIGEN_EXAMPLE.read_text(encoding="utf-8")), registry.get)
    assert warnings == []
    assert workflow.nodes["21"].widgets == {"text": "purple galaxy bottle", "width": 192, "height": 304,
                                            "x": 176, "y": 272}
    assert workflow.nodes["27"].widgets == {"text": "sun", "width": 144, "height": 144, "x": 416, "y": 16}
    assert [(e.node_id, e.input_name) for e in validate(workflow, registry.get)] == [("4", "ckpt_name"),
                                                                                   ("10", "gligen_name")]
    models = tmp_path / "models"
    for folder, name in (("checkpoints", "v1-5-pruned-emaonly-fp16.safetensors"),
                         ("gligen", "gligen_sd14_textbox_pruned.safetensors")):
        (models / folder).mkdir(parents=True)
        (models / folder / name).write_bytes(b"")
    code = main(["--plugins", str(tmp_path / "plugins"), "--models", str(models), "--output",
                 str(tmp_path / "out"), "validate", str(GLIGEN_EXAMPLE)])
    out, _ = capsys.readouterr()
    assert code == 0, out


def _cli_validate(tmp_path, capsys, workflow_file: Path, models: dict[str, list[str]]) -> tuple[int, str]:
    """`sluice validate` on a workflow file, with empty model files of those names in those folders."""
    root = tmp_path / "models"
    for folder, names in models.items():
        (root / folder).mkdir(parents=True)
        for name in names:
            (root / folder / name).write_bytes(b"")  # validation reads names, not files
    code = main(["--plugins", str(tmp_path / "plugins"), "--models", str(root), "--output",
                 str(tmp_path / "out"), "validate", str(workflow_file)])
    out, _ = capsys.readouterr()
    return code, out


def _import(workflow_file: Path, tmp_path: Path):
    """The imported workflow, its warnings, and (node, input) of each validation error with no models yet
    (with a registry for an empty models folder: an earlier `main` call leaves its folder as the choices)."""
    registry = default_registry(load_settings(models_root=tmp_path / "models", output_dir=tmp_path / "out",
                                              plugins_dir=tmp_path / "plugins", env={},
                                              settings_file=tmp_path / "settings.json"))
    workflow, warnings = from_comfy_ui(json.loads(workflow_file.read_text(encoding="utf-8")), registry.get)
    errors = [(e.node_id, e.input_name) for e in validate(workflow, registry.get)]
    return workflow, warnings, errors


# ComfyUI_examples' images (github.com/comfyanonymous/ComfyUI_examples at f9431bb): the "workflow" text chunk
# of each PNG, with every node, link and widgets_values as published; positions, sizes and groups left out
HIRESFIX_EXAMPLE = FIXTURES / "comfyui_hiresfix_example.json"  # 2_pass_txt2img/hiresfix_latent_workflow.png
LORA_EXAMPLE = FIXTURES / "comfyui_lora_example.json"  # lora/lora.png
# textual_inversion_embeddings/embedding_example.png
EMBEDDING_EXAMPLE = FIXTURES / "comfyui_embedding_example.json"
UPSCALE_EXAMPLE = FIXTURES / "comfyui_upscale_example.json"  # upscale_models/esrgan_example.png
INPAINT_EXAMPLE = FIXTURES / "comfyui_inpaint_example.json"  # inpaint/inpaint_example.png
OUTPAINT_EXAMPLE = FIXTURES / "comfyui_outpaint_example.json"  # inpaint/yosemite_outpaint_example.png
# area_composition/square_area_for_subject.png
AREA_EXAMPLE = FIXTURES / "comfyui_area_composition_example.json"
CONTROLNET_EXAMPLE = FIXTURES / "comfyui_controlnet_example.json"  # controlnet/controlnet_example.png


def test_comfyuis_hiresfix_example_imports_and_validates_with_its_checkpoint(tmp_path, capsys):
    workflow, warnings, errors = _import(HIRESFIX_EXAMPLE, tmp_path)
    assert warnings == []
    assert workflow.nodes["10"].widgets == {"upscale_method": "nearest-exact", "width": 1152, "height": 1152,
                                            "crop": "disabled"}
    assert workflow.nodes["11"].widgets["denoise"] == 0.5 and workflow.nodes["11"].widgets["steps"] == 14
    assert workflow.nodes["3"].widgets["sampler_name"] == "dpmpp_sde"
    assert len(workflow.links) == 17
    assert errors == [("16", "ckpt_name")]
    code, out = _cli_validate(tmp_path, capsys, HIRESFIX_EXAMPLE,
                              {"checkpoints": ["v2-1_768-ema-pruned.ckpt"]})
    assert code == 0, out


def test_comfyuis_lora_example_imports_and_validates_with_its_models(tmp_path, capsys):
    workflow, warnings, errors = _import(LORA_EXAMPLE, tmp_path)
    assert warnings == []
    assert workflow.nodes["10"].widgets == {"lora_name": "epiNoiseoffset_v2.safetensors", "strength_model": 1,
                                            "strength_clip": 1}
    assert workflow.nodes["3"].widgets["seed"] == 851616030078638
    assert errors == [("4", "ckpt_name"), ("10", "lora_name")]
    code, out = _cli_validate(tmp_path, capsys, LORA_EXAMPLE, {"checkpoints": ["v1-5-pruned-emaonly.ckpt"],
                                                              "loras": ["epiNoiseoffset_v2.safetensors"]})
    assert code == 0, out


def test_comfyuis_embedding_example_imports_and_validates_with_its_checkpoint(tmp_path, capsys):
    workflow, warnings, errors = _import(EMBEDDING_EXAMPLE, tmp_path)
    assert warnings == []
    assert workflow.nodes["6"].widgets["text"] == ("photograph in the style of embedding:SDA768.pt girl with "
                                                   "blonde hair\nlandscape scenery view")
    assert workflow.nodes["5"].widgets == {"width": 768, "height": 768, "batch_size": 1}
    assert errors == [("4", "ckpt_name")]
    code, out = _cli_validate(tmp_path, capsys, EMBEDDING_EXAMPLE,
                              {"checkpoints": ["v2-1_768-ema-pruned.ckpt"], "embeddings": ["SDA768.pt"]})
    assert code == 0, out


def test_comfyuis_upscale_model_example_imports_and_validates_with_its_models(tmp_path, capsys):
    workflow, warnings, errors = _import(UPSCALE_EXAMPLE, tmp_path)
    assert warnings == []
    assert workflow.nodes["13"].widgets["model_name"] == "RealESRGAN_x2.pth"  # and Sluice's backend widget
    assert workflow.nodes["14"].widgets == {}
    assert errors == [("4", "ckpt_name"), ("13", "model_name")]
    code, out = _cli_validate(tmp_path, capsys, UPSCALE_EXAMPLE, {"checkpoints": ["v1-5-pruned-emaonly.ckpt"],
                                                                 "upscale_models": ["RealESRGAN_x2.pth"]})
    assert code == 0, out


def test_comfyuis_inpaint_example_imports_and_validates_with_its_checkpoint(tmp_path, capsys):
    workflow, warnings, errors = _import(INPAINT_EXAMPLE, tmp_path)
    # the example predates VAEEncodeForInpaint's grow_mask_by widget: ComfyUI's default (6) fills it in
    assert warnings == ["node 26 (VAEEncodeForInpaint): widgets_values has no value for grow_mask_by; "
                        "using the default"]
    assert workflow.nodes["26"].widgets == {"grow_mask_by": 6}
    assert workflow.nodes["20"].widgets["image"] == "yosemite_inpaint_example.png"
    assert workflow.nodes["3"].widgets["seed"] == 1040111309094545
    assert errors == [("29", "ckpt_name")]
    code, out = _cli_validate(tmp_path, capsys, INPAINT_EXAMPLE,
                              {"checkpoints": ["512-inpainting-ema.safetensors"]})
    assert code == 0, out


def test_comfyuis_outpaint_example_imports_and_validates_with_its_checkpoint(tmp_path, capsys):
    workflow, warnings, errors = _import(OUTPAINT_EXAMPLE, tmp_path)
    assert warnings == []
    assert workflow.nodes["30"].widgets == {"left": 0, "top": 128, "right": 0, "bottom": 128,
                                            "feathering": 40}
    assert workflow.nodes["26"].widgets == {"grow_mask_by": 8}
    assert len(workflow.links) == 13
    assert errors == [("29", "ckpt_name")]
    code, out = _cli_validate(tmp_path, capsys, OUTPAINT_EXAMPLE,
                              {"checkpoints": ["512-inpainting-ema.safetensors"]})
    assert code == 0, out


def test_comfyuis_area_composition_example_imports_and_validates_with_its_models(tmp_path, capsys):
    workflow, warnings, errors = _import(AREA_EXAMPLE, tmp_path)
    assert warnings == []
    assert workflow.nodes["46"].widgets == {"width": 640, "height": 640, "x": 0, "y": 64, "strength": 1}
    assert workflow.nodes["49"].widgets == {"stop_at_clip_layer": -2}
    assert workflow.nodes["24"].widgets["denoise"] == 0.52
    assert len(workflow.links) == 24
    assert errors == [("20", "vae_name"), ("48", "ckpt_name")]
    code, out = _cli_validate(tmp_path, capsys, AREA_EXAMPLE,
                              {"checkpoints": ["Anything-V3.0.ckpt"],
                               "vae": ["vae-ft-mse-840000-ema-pruned.safetensors"]})
    assert code == 0, out


def test_comfyuis_controlnet_example_imports_and_validates_with_its_models(tmp_path, capsys):
    workflow, warnings, errors = _import(CONTROLNET_EXAMPLE, tmp_path)
    assert warnings == []
    assert workflow.nodes["10"].widgets == {"strength": 0.8999999999999999}
    assert workflow.nodes["12"].widgets["control_net_name"] == "control_scribble.safetensors"
    assert workflow.nodes["11"].widgets["image"] == "input_scribble_example.png"
    assert errors == [("12", "control_net_name"), ("13", "vae_name"), ("14", "ckpt_name")]
    code, out = _cli_validate(tmp_path, capsys, CONTROLNET_EXAMPLE,
                              {"checkpoints": ["Anything-V3.0.ckpt"],
                               "controlnet": ["control_scribble.safetensors"],
                               "vae": ["vae-ft-mse-840000-ema-pruned.safetensors"]})
    assert code == 0, out
