"""ComfyUI subgraphs flatten into one graph; ComfyUI's FLUX widget quirks translate both ways; ComfyUI's
official FLUX templates (the comfyui-workflow-templates-json package, when installed) import with their
wiring.

The hand-built workflows follow the frontend's serialisation (ComfyUI_frontend, litegraph `subgraph/`):
definitions.subgraphs with inputs/outputs, inner links from node -10 and to node -20, promoted widget values
in the instance's widgets_values.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from app.cli import apply_overrides
from engine.graph.comfy import from_comfy_api, from_comfy_ui
from engine.graph.comfy_export import to_api_prompt, to_comfy_ui
from engine.graph.comfy_subgraph import MAX_DEPTH
from engine.graph.document import Workflow
from engine.graph.errors import WorkflowError
from engine.graph.spec import (
    NodeType,
    Output,
    RunContext,
    combo_input,
    float_input,
    int_input,
    link_input,
    seed_input,
    string_input,
)
from engine.models.loader import parse_dtype
from nodes.loaders import CLIPLoader, DualCLIPLoader, UNETLoader

A_ID = "aaaaaaaa-0000-4000-8000-000000000001"  # outer subgraph: prompt + sampler, holds B
B_ID = "bbbbbbbb-0000-4000-8000-000000000002"  # inner subgraph: the negative prompt


class StandIn(NodeType):
    def run(self, ctx: RunContext, **inputs: object) -> tuple:
        return ()


class CheckpointLoaderSimple(StandIn):
    inputs = (combo_input("ckpt_name", ("model.safetensors",)),)
    outputs = (Output("MODEL", "MODEL"), Output("CLIP", "CLIP"), Output("VAE", "VAE"))


class CLIPTextEncode(StandIn):
    inputs = (string_input("text", multiline=True), link_input("clip", "CLIP"))
    outputs = (Output("CONDITIONING", "CONDITIONING"),)


class KSampler(StandIn):
    inputs = (link_input("model", "MODEL"), seed_input("seed", 0), int_input("steps", 20, min=1, max=10000),
              float_input("cfg", 8.0, min=0.0, max=100.0), link_input("positive", "CONDITIONING"),
              link_input("negative", "CONDITIONING"), link_input("latent_image", "LATENT"))
    outputs = (Output("LATENT", "LATENT"),)


class EmptyLatentImage(StandIn):
    inputs = (int_input("width", 512, min=16, max=16384), int_input("height", 512, min=16, max=16384))
    outputs = (Output("LATENT", "LATENT"),)


class VAEDecode(StandIn):
    inputs = (link_input("samples", "LATENT"), link_input("vae", "VAE"))
    outputs = (Output("IMAGE", "IMAGE"),)


class SaveImage(StandIn):
    output_node = True
    inputs = (link_input("images", "IMAGE"), string_input("filename_prefix", "ComfyUI"))


TYPES = {cls.__name__: cls for cls in (CheckpointLoaderSimple, CLIPTextEncode, KSampler, EmptyLatentImage,
                                       VAEDecode, SaveImage, CLIPLoader, DualCLIPLoader, UNETLoader)}
lookup = TYPES.get


def node(node_id: int, type_name: str, pos: tuple[float, float], inputs: list[dict[str, Any]],
         values: list[Any], mode: int = 0, size: tuple[float, float] = (300, 100)) -> dict[str, Any]:
    return {"id": node_id, "type": type_name, "pos": list(pos), "size": list(size), "mode": mode,
            "inputs": inputs, "outputs": [], "widgets_values": values}


def slot(name: str, link: int | None, widget: bool = False) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "type": "*", "link": link}
    if widget:
        entry["widget"] = {"name": name}
    return entry


def link(link_id: int, origin: int, origin_slot: int, target: int, target_slot: int, type_name: str) -> dict:
    return {"id": link_id, "origin_id": origin, "origin_slot": origin_slot, "target_id": target,
            "target_slot": target_slot, "type": type_name}


def subgraph_b() -> dict[str, Any]:
    """CLIP in, the negative prompt's CONDITIONING out; the text widget is not promoted."""
    return {"id": B_ID, "name": "Negative", "inputs": [{"name": "clip", "type": "CLIP", "linkIds": [1]}],
            "outputs": [{"name": "CONDITIONING", "type": "CONDITIONING", "linkIds": [2]}],
            "nodes": [node(3, "CLIPTextEncode", (0, 0), [slot("clip", 1)], ["bad"])],
            "links": [link(1, -10, 0, 3, 0, "CLIP"), link(2, 3, 0, -20, 0, "CONDITIONING")], "groups": []}


def subgraph_a() -> dict[str, Any]:
    """MODEL, CLIP, text and seed in (text and seed promoted), LATENT out; node 7 is an instance of B."""
    inputs = [{"name": name, "type": kind, "linkIds": []}
              for name, kind in (("model", "MODEL"), ("clip", "CLIP"), ("text", "STRING"), ("seed", "INT"))]
    return {
        "id": A_ID, "name": "Sample", "inputs": inputs,
        "outputs": [{"name": "LATENT", "type": "LATENT", "linkIds": [16]}],
        "nodes": [
            node(5, "CLIPTextEncode", (100, 100), [slot("clip", 10), slot("text", 11, widget=True)],
                 ["inner"]),
            node(6, "KSampler", (500, 100), [slot("model", 12), slot("positive", 13), slot("negative", 14),
                                             slot("latent_image", 15), slot("seed", 17, widget=True)],
                 [7, "randomize", 30, 6.5]),
            node(7, B_ID, (100, 300), [slot("clip", 18)], []),
            node(8, "EmptyLatentImage", (100, 500), [], [768, 512]),
        ],
        "links": [link(10, -10, 1, 5, 0, "CLIP"), link(11, -10, 2, 5, 1, "STRING"),
                  link(12, -10, 0, 6, 0, "MODEL"), link(13, 5, 0, 6, 1, "CONDITIONING"),
                  link(14, 7, 0, 6, 2, "CONDITIONING"), link(15, 8, 0, 6, 3, "LATENT"),
                  link(16, 6, 0, -20, 0, "LATENT"), link(17, -10, 3, 6, 4, "INT"),
                  link(18, -10, 1, 7, 0, "CLIP")],
        "groups": [{"title": "Prompt", "bounding": [80, 60, 400, 200]}],
    }


def workflow_json(instance_values: list[Any] | None = None, instance_mode: int = 0) -> dict[str, Any]:
    """Loader -> instance 10 of A -> VAEDecode -> SaveImage; the instance promotes text and seed."""
    instance = node(10, A_ID, (400, 0), [slot("model", 1), slot("clip", 2), slot("text", None, widget=True),
                                         slot("seed", None, widget=True)],
                    ["a cat", 42, "fixed"] if instance_values is None else instance_values, instance_mode,
                    size=(300, 200))
    return {
        "nodes": [node(1, "CheckpointLoaderSimple", (0, 0), [], ["model.safetensors"]), instance,
                  node(2, "VAEDecode", (800, 0), [slot("samples", 3), slot("vae", 4)], []),
                  node(3, "SaveImage", (1100, 0), [slot("images", 5)], ["out"])],
        "links": [[1, 1, 0, 10, 0, "MODEL"], [2, 1, 1, 10, 1, "CLIP"], [3, 10, 0, 2, 0, "LATENT"],
                  [4, 1, 2, 2, 1, "VAE"], [5, 2, 0, 3, 0, "IMAGE"]],
        "groups": [], "definitions": {"subgraphs": [subgraph_a(), subgraph_b()]}, "version": 0.4,
    }


def edges(workflow: Workflow) -> set[tuple[str, int, str, str]]:
    return {(link.source, link.output, link.target, link.input) for link in workflow.links}


def test_nested_subgraphs_flatten_into_inner_nodes_named_like_comfyui_prompt_ids():
    workflow, warnings = from_comfy_ui(workflow_json(), lookup)
    assert warnings == []
    assert set(workflow.nodes) == {"1", "2", "3", "10:5", "10:6", "10:7:3", "10:8"}
    assert edges(workflow) == {
        ("1", 0, "10:6", "model"), ("1", 1, "10:5", "clip"), ("1", 1, "10:7:3", "clip"),
        ("10:5", 0, "10:6", "positive"), ("10:7:3", 0, "10:6", "negative"),
        ("10:8", 0, "10:6", "latent_image"),
        ("10:6", 0, "2", "samples"), ("1", 2, "2", "vae"), ("2", 0, "3", "images")}
    assert {link.type for link in workflow.links if link.target == "10:7:3"} == {"CLIP"}
    assert workflow.meta["comfy_subgraphs"] == {"10": "Sample", "10:7": "Negative"}


def test_promoted_widget_values_of_the_instance_reach_the_inner_inputs_they_proxy():
    workflow, _ = from_comfy_ui(workflow_json(), lookup)
    assert workflow.nodes["10:5"].widgets["text"] == "a cat"
    sampler = workflow.nodes["10:6"]
    assert sampler.widgets == {"seed": 42, "steps": 30, "cfg": 6.5}
    assert sampler.seed_controls == {"seed": "fixed"}
    assert workflow.nodes["10:7:3"].widgets["text"] == "bad"  # not promoted: the inner node's own value
    assert workflow.nodes["10:8"].widgets == {"width": 768, "height": 512}


def test_an_instance_without_values_leaves_the_inner_nodes_their_own_as_proxy_widgets_do():
    data = workflow_json(instance_values=[])
    data["nodes"][1]["properties"] = {"proxyWidgets": [["5", "text"], ["6", "seed"]]}
    workflow, warnings = from_comfy_ui(data, lookup)
    assert warnings == []
    assert workflow.nodes["10:5"].widgets["text"] == "inner"
    assert workflow.nodes["10:6"].widgets["seed"] == 7
    assert workflow.nodes["10:6"].seed_controls == {"seed": "randomize"}


def test_a_link_into_a_promoted_input_beats_the_instance_value():
    data = workflow_json()
    data["nodes"].append(node(20, "PrimitiveNode", (0, 300), [], [1234, "increment"]))
    data["nodes"][1]["inputs"][3]["link"] = 6
    data["links"].append([6, 20, 0, 10, 3, "INT"])
    workflow, warnings = from_comfy_ui(data, lookup)
    assert warnings == []
    assert workflow.nodes["10:6"].widgets["seed"] == 1234
    assert workflow.nodes["10:6"].seed_controls == {"seed": "increment"}
    assert "20" not in workflow.nodes


def test_inner_nodes_sit_at_the_instance_and_nodes_to_its_right_make_room():
    workflow, _ = from_comfy_ui(workflow_json(), lookup)
    assert workflow.nodes["10:5"].pos == (400.0, 0.0)  # the inner box's corner at the instance's position
    assert workflow.nodes["10:6"].pos == (800.0, 0.0)
    assert workflow.nodes["10:7:3"].pos == (400.0, 200.0)
    grown = 700 - 300  # the inner box is 700 wide (100..800), the instance was 300
    assert workflow.nodes["2"].pos == (800.0 + grown, 0.0)
    assert workflow.nodes["1"].pos == (0.0, 0.0)
    titles = {group.title: group.rect for group in workflow.groups}
    assert titles["Prompt"][:2] == (380.0, -40.0)
    assert set(titles) == {"Prompt", "Sample", "Negative"}


@pytest.mark.parametrize("mode, expected", [(4, "bypassed"), (2, "muted")])
def test_a_bypassed_or_muted_instance_passes_its_mode_to_its_inner_nodes(mode, expected):
    workflow, _ = from_comfy_ui(workflow_json(instance_mode=mode), lookup)
    assert {workflow.nodes[i].mode for i in ("10:5", "10:6", "10:7:3", "10:8")} == {expected}
    assert {workflow.nodes[i].mode for i in ("1", "2", "3")} == {"normal"}


def test_flattened_ids_export_to_the_api_prompt_and_take_set_overrides():
    workflow, _ = from_comfy_ui(workflow_json(), lookup)
    apply_overrides(workflow, ["10:6.seed=5", "10:7:3.text=blurry"], lookup)
    prompt = to_api_prompt(workflow, lookup)
    assert prompt["10:6"]["inputs"]["seed"] == 5
    assert prompt["10:6"]["inputs"]["model"] == ["1", 0]
    assert prompt["10:7:3"]["inputs"]["text"] == "blurry"
    again, _ = from_comfy_api(prompt, lookup)
    assert edges(again) == edges(workflow)
    assert Workflow.from_dict(workflow.to_dict()).nodes.keys() == workflow.nodes.keys()


def test_a_subgraph_that_contains_itself_is_refused_by_name():
    data = workflow_json()
    data["definitions"]["subgraphs"][1]["nodes"].append(node(9, A_ID, (0, 200), [], []))
    with pytest.raises(WorkflowError,
                       match=r"subgraph 'Sample'.*contains itself \(Sample -> Negative -> Sample\)"):
        from_comfy_ui(data, lookup)


def test_subgraphs_nested_too_deep_are_refused():
    ids = [f"{index:08x}-0000-4000-8000-000000000000" for index in range(MAX_DEPTH + 2)]
    definitions = [{"id": ids[i], "name": f"level {i}", "inputs": [], "outputs": [], "links": [],
                    "nodes": [node(1, ids[i + 1], (0, 0), [], [])] if i + 1 < len(ids) else []}
                   for i in range(len(ids))]
    data = {"nodes": [node(1, ids[0], (0, 0), [], [])], "links": [],
            "definitions": {"subgraphs": definitions}}
    with pytest.raises(WorkflowError, match=f"nested more than {MAX_DEPTH} subgraphs deep"):
        from_comfy_ui(data, lookup)


def test_an_undefined_subgraph_type_is_kept_as_an_unknown_node_with_a_warning():
    data = workflow_json()
    del data["definitions"]
    workflow, warnings = from_comfy_ui(data, lookup)
    assert workflow.nodes["10"].type == A_ID
    assert any(A_ID in warning and "defines no such subgraph" in warning for warning in warnings)


def test_a_link_from_a_missing_subgraph_input_is_dropped_naming_the_subgraph():
    data = workflow_json()
    data["definitions"]["subgraphs"][0]["links"][0]["origin_slot"] = 9
    workflow, warnings = from_comfy_ui(data, lookup)
    assert "clip" not in workflow.links_into("10:5")
    assert any("subgraph 'Sample'" in warning and "input slot 9" in warning and "4 input(s)" in warning
               for warning in warnings)


@pytest.mark.parametrize("damage, message", [
    (lambda data: data["definitions"].update(subgraphs={"x": 1}), "definitions.subgraphs must be a list"),
    (lambda data: data["definitions"]["subgraphs"][0]["inputs"].append({"type": "INT"}),
     r"subgraph 'Sample' \(aaaaaaaa.*\): inputs\[4\] must be an object with a 'name'"),
    (lambda data: data["definitions"]["subgraphs"][0].update(nodes="none"),
     r"subgraph 'Sample' .*field 'nodes' must be a list"),
    (lambda data: data["definitions"]["subgraphs"][0]["links"].append({"id": 99}),
     r"subgraph 'Sample' .*links\[9\] must be"),
])
def test_malformed_subgraph_definitions_raise_workflow_errors_naming_them(damage, message):
    data = copy.deepcopy(workflow_json())
    damage(data)
    with pytest.raises(WorkflowError, match=message):
        from_comfy_ui(data, lookup)


# -- FLUX widget quirks --

def loader_workflow(type_name: str, values: list[Any]) -> dict[str, Any]:
    return {"nodes": [node(1, type_name, (0, 0), [], values)], "links": [], "version": 0.4}


@pytest.mark.parametrize("device, backend", [("default", "auto"), ("cpu", "cpu")])
def test_comfyui_device_widget_becomes_backend_and_exports_back(device, backend):
    values = ["clip_l.safetensors", "t5xxl_fp16.safetensors", "sdxl", device]
    workflow, warnings = from_comfy_ui(loader_workflow("DualCLIPLoader", values), lookup)
    assert warnings == []
    widgets = workflow.nodes["1"].widgets
    assert widgets == {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp16.safetensors",
                       "type": "sdxl", "backend": backend, "params_backend": "auto"}
    exported = to_comfy_ui(workflow, lookup)["nodes"][0]["widgets_values"]
    assert exported[:4] == values  # what ComfyUI reads; Sluice's own widgets follow
    assert from_comfy_ui(to_comfy_ui(workflow, lookup), lookup)[0].nodes["1"].widgets == widgets
    prompt = to_api_prompt(workflow, lookup)
    assert prompt["1"]["inputs"]["device"] == device
    assert from_comfy_api(prompt, lookup)[0].nodes["1"].widgets == widgets


def test_sluice_only_backends_survive_a_comfyui_round_trip():
    workflow, _ = from_comfy_ui(loader_workflow("CLIPLoader", ["clip_l.safetensors", "sd1", "default"]),
                                lookup)
    workflow.nodes["1"].widgets.update(backend="cuda1", params_backend="disk")
    exported = to_comfy_ui(workflow, lookup)
    assert exported["nodes"][0]["widgets_values"] == ["clip_l.safetensors", "sd1", "default", "cuda1", "disk"]
    assert from_comfy_ui(exported, lookup)[0].nodes["1"].widgets == workflow.nodes["1"].widgets
    prompt = {"1": {"class_type": "CLIPLoader", "inputs": {"clip_name": "a", "type": "sd1", "device": "cpu"}}}
    assert from_comfy_api(prompt, lookup)[0].nodes["1"].widgets["backend"] == "cpu"


def test_an_unknown_comfyui_device_keeps_the_default_backend_with_a_warning():
    workflow, warnings = from_comfy_ui(loader_workflow("CLIPLoader", ["a", "sd1", "gpu"]), lookup)
    assert workflow.nodes["1"].widgets["backend"] == "auto"
    assert any("device 'gpu' is not one of ComfyUI's values" in warning for warning in warnings)


def test_comfyui_fp8_weight_dtypes_import_as_float8_storage():
    workflow, warnings = from_comfy_ui(loader_workflow("UNETLoader", ["flux1-dev.safetensors", "fp8_e4m3fn"]),
                                       lookup)
    assert warnings == []  # no "no value for backend, params_backend": ComfyUI files never have them
    assert workflow.nodes["1"].widgets["weight_dtype"] == "fp8_e4m3fn"
    assert UNETLoader.input_named("weight_dtype").check_value("fp8_e5m2") is None
    assert to_comfy_ui(workflow, lookup)["nodes"][0]["widgets_values"][:2] == ["flux1-dev.safetensors",
                                                                               "fp8_e4m3fn"]
    assert parse_dtype("fp8_e4m3fn") is parse_dtype("fp8_e4m3fn_fast") is torch.float8_e4m3fn
    assert parse_dtype("fp8_e5m2") is torch.float8_e5m2


# -- ComfyUI's official templates --

# The types these templates use; the unknown-types warning may name only these (none once Sluice has them).
FLUX_TYPES = {"UNETLoader", "DualCLIPLoader", "CLIPTextEncodeFlux", "ConditioningZeroOut",
              "EmptySD3LatentImage", "SamplerCustomAdvanced", "VAELoader", "KSampler", "CLIPTextEncode",
              "VAEDecode", "SaveImage", "CheckpointLoaderSimple"}


def template(name: str) -> dict[str, Any]:
    package = pytest.importorskip("comfyui_workflow_templates_json",
                                  reason="ComfyUI's templates are test data from the "
                                         "comfyui-workflow-templates-json package (pip install -e .[dev])")
    return json.loads((Path(package.__file__).parent / "templates" / name).read_text(encoding="utf-8"))


def registry_lookup():
    from nodes.registry import default_registry

    return default_registry().get


def unknown_types(warnings: list[str]) -> set[str]:
    """The types the unknown-types warning names (empty once Sluice has them all)."""
    named = [warning for warning in warnings if "have types Sluice does not know" in warning]
    if not named:
        return set()
    listed = named[0].split(": ", 1)[1].split(". They are kept")[0]
    return {part.split(" (node")[0] for part in listed.split("; ")}


def source_of(workflow: Workflow, node_id: str, input_name: str) -> str:
    return workflow.nodes[workflow.links_into(node_id)[input_name].source].type


@pytest.mark.parametrize("name, sampler", [("flux_dev_full_text_to_image.json", "194:50"),
                                           ("flux_dev_checkpoint_example.json", "56:52")])
def test_official_flux_dev_templates_flatten_their_subgraph(name, sampler):
    lookup_real = registry_lookup()
    workflow, warnings = from_comfy_ui(template(name), lookup_real)
    assert not [warning for warning in warnings if "subgraph" in warning.lower()]
    assert unknown_types(warnings) <= FLUX_TYPES
    assert Counter(node.type for node in workflow.nodes.values()) == Counter(
        ["SaveImage", "VAELoader", "UNETLoader", "DualCLIPLoader", "EmptySD3LatentImage", "CLIPTextEncode",
         "KSampler", "VAEDecode", "ConditioningZeroOut"])
    assert all(node_id.startswith(sampler.split(":")[0] + ":") for node_id, node in workflow.nodes.items()
               if node.type != "SaveImage")
    assert source_of(workflow, sampler, "model") == "UNETLoader"
    assert source_of(workflow, sampler, "positive") == "CLIPTextEncode"
    assert source_of(workflow, sampler, "negative") == "ConditioningZeroOut"
    assert source_of(workflow, sampler, "latent_image") == "EmptySD3LatentImage"
    zero_out = workflow.links_into(sampler)["negative"].source
    assert source_of(workflow, zero_out, "conditioning") == "CLIPTextEncode"
    encoder = workflow.links_into(sampler)["positive"].source
    assert source_of(workflow, encoder, "clip") == "DualCLIPLoader"
    decode = next(node_id for node_id, node in workflow.nodes.items() if node.type == "VAEDecode")
    assert source_of(workflow, decode, "samples") == "KSampler"
    assert source_of(workflow, decode, "vae") == "VAELoader"
    save = next(node_id for node_id, node in workflow.nodes.items() if node.type == "SaveImage")
    assert workflow.links_into(save)["images"].source == decode
    clip = workflow.links_into(encoder)["clip"].source
    assert workflow.nodes[clip].widgets["clip_name2"] == "t5xxl_fp16.safetensors"
    assert workflow.nodes[clip].widgets["backend"] == "auto"
    assert workflow.nodes[sampler].widgets["cfg"] == 1
    assert len(workflow.links) == 9


def test_official_flux_schnell_template_imports_its_loaders_and_wiring():
    lookup_real = registry_lookup()
    workflow, warnings = from_comfy_ui(template("flux_schnell_full_text_to_image.json"), lookup_real)
    assert unknown_types(warnings) <= FLUX_TYPES
    assert Counter(node.type for node in workflow.nodes.values()) == Counter(
        ["VAELoader", "DualCLIPLoader", "EmptySD3LatentImage", "ConditioningZeroOut", "VAEDecode",
         "SaveImage", "UNETLoader", "KSampler", "CLIPTextEncodeFlux"])
    assert source_of(workflow, "31", "model") == "UNETLoader"
    assert source_of(workflow, "31", "positive") == "CLIPTextEncodeFlux"
    assert source_of(workflow, "31", "negative") == "ConditioningZeroOut"
    assert source_of(workflow, "41", "clip") == "DualCLIPLoader"
    assert workflow.nodes["40"].widgets["type"] == "flux"
    assert workflow.nodes["38"].widgets["unet_name"] == "flux1-schnell.safetensors"


def test_official_flux_schnell_checkpoint_template_imports():
    lookup_real = registry_lookup()
    workflow, warnings = from_comfy_ui(template("flux_schnell.json"), lookup_real)
    assert unknown_types(warnings) <= FLUX_TYPES
    assert Counter(node.type for node in workflow.nodes.values()) == Counter(
        ["CLIPTextEncode", "CLIPTextEncode", "EmptySD3LatentImage", "VAEDecode", "SaveImage", "KSampler",
         "CheckpointLoaderSimple"])
    assert source_of(workflow, "31", "model") == "CheckpointLoaderSimple"
    assert workflow.links_into("31")["model"].output == 0
    assert workflow.links_into("8")["vae"].output == 2


def test_an_official_template_of_known_types_validates_after_flattening_but_for_model_files():
    from engine.graph.validate import validate

    lookup_real = registry_lookup()
    workflow, warnings = from_comfy_ui(template("image_anima_preview.json"), lookup_real)
    assert warnings == []
    assert Counter(node.type for node in workflow.nodes.values()) == Counter(
        ["SaveImage", "CLIPLoader", "VAELoader", "VAEDecode", "EmptyLatentImage", "CLIPTextEncode",
         "CLIPTextEncode", "KSampler", "UNETLoader"])
    errors = validate(workflow, lookup_real)
    assert {error.node_id for error in errors} <= {node_id for node_id, node in workflow.nodes.items()
                                                   if node.type.endswith("Loader")}
    assert all("is not one of the choices" in error.message for error in errors)
