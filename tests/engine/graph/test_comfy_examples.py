"""ComfyUI's published example workflows (comfyanonymous.github.io/ComfyUI_examples, and the templates ComfyUI
once shipped in comfy/web/templates), written into fixtures by hand from their UI JSON: they import with their
widget values and `sluice validate` passes once the models they name exist."""

from __future__ import annotations

import json
from pathlib import Path

from app.cli import main
from engine.graph.comfy import from_comfy_ui
from engine.graph.validate import validate
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
