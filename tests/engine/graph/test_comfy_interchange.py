"""ComfyUI interchange: UI workflows (0.4 and 1), API prompts, PNGs with embedded workflows, export.

The ComfyUI files below are written by hand after ComfyUI's own default txt2img graph; the node types are
small stand-ins declared here with ComfyUI's names, input order and display names.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from app.cli import main
from engine.graph.comfy import from_comfy_api, from_comfy_ui
from engine.graph.comfy_export import to_api_prompt, to_comfy_ui
from engine.graph.document import Workflow
from engine.graph.errors import WorkflowError
from engine.graph.interchange import load_any
from engine.graph.spec import (
    INT,
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
from engine.graph.validate import validate
from nodes.registry import default_registry


class ComfyTestNode(NodeType):
    def run(self, ctx: RunContext, **inputs: object) -> tuple:
        return ()


class CheckpointLoaderSimple(ComfyTestNode):
    display_name = "Load Checkpoint"
    inputs = (combo_input("ckpt_name", ("v1-5-pruned-emaonly.safetensors", "other.safetensors")),)
    outputs = (Output("MODEL", "MODEL"), Output("CLIP", "CLIP"), Output("VAE", "VAE"))


class CLIPTextEncode(ComfyTestNode):
    display_name = "CLIP Text Encode (Prompt)"
    inputs = (string_input("text", multiline=True), link_input("clip", "CLIP"))
    outputs = (Output("CONDITIONING", "CONDITIONING"),)


class KSampler(ComfyTestNode):
    inputs = (link_input("model", "MODEL"), seed_input("seed", 0), int_input("steps", 20, min=1, max=10000),
              float_input("cfg", 8.0, min=0.0, max=100.0),
              combo_input("sampler_name", ("euler", "euler_ancestral", "dpmpp_2m")),
              combo_input("scheduler", ("normal", "karras")), link_input("positive", "CONDITIONING"),
              link_input("negative", "CONDITIONING"), link_input("latent_image", "LATENT"),
              float_input("denoise", 1.0, min=0.0, max=1.0))
    outputs = (Output("LATENT", "LATENT"),)


class EmptyLatentImage(ComfyTestNode):
    display_name = "Empty Latent Image"
    inputs = (int_input("width", 512, min=16, max=16384), int_input("height", 512, min=16, max=16384),
              int_input("batch_size", 1, min=1, max=4096))
    outputs = (Output("LATENT", "LATENT"),)


class VAEDecode(ComfyTestNode):
    display_name = "VAE Decode"
    inputs = (link_input("samples", "LATENT"), link_input("vae", "VAE"))
    outputs = (Output("IMAGE", "IMAGE"),)


class SaveImage(ComfyTestNode):
    display_name = "Save Image"
    output_node = True
    inputs = (link_input("images", "IMAGE"), string_input("filename_prefix", "ComfyUI"))


class LoraLoader(ComfyTestNode):
    display_name = "Load LoRA"
    inputs = (link_input("model", "MODEL"), link_input("clip", "CLIP"),
              combo_input("lora_name", ("style.pt",)),
              float_input("strength_model", 1.0, min=-100.0, max=100.0),
              float_input("strength_clip", 1.0, min=-100.0, max=100.0))
    outputs = (Output("MODEL", "MODEL"), Output("CLIP", "CLIP"))


class StepCount(ComfyTestNode):
    inputs = (int_input("value", 30, min=1, max=100),)
    outputs = (Output("INT", INT),)


class NoiseStep(ComfyTestNode):
    """An INT that ComfyUI shows with a control after generate, then a combo whose choices look like one."""

    inputs = (int_input("noise_seed", 0, min=0, max=100), combo_input("mode", ("fixed", "increment")))


LOOKUP = {cls.type_name: cls for cls in (CheckpointLoaderSimple, CLIPTextEncode, KSampler, EmptyLatentImage,
                                         VAEDecode, SaveImage, LoraLoader, StepCount)}.get
POSITIVE = "beautiful scenery nature glass bottle landscape, , purple galaxy bottle,"
NEGATIVE = "text, watermark"
SEED = 156680208700286


def default_graph() -> dict:
    """ComfyUI's default txt2img workflow as its frontend saves it (UI format 0.4)."""
    return {
        "last_node_id": 9, "last_link_id": 9,
        "nodes": [
            {"id": 7, "type": "CLIPTextEncode", "pos": [413, 389], "size": {"0": 425.278, "1": 180.6},
             "flags": {}, "order": 3, "mode": 0, "inputs": [{"name": "clip", "type": "CLIP", "link": 5}],
             "outputs": [{"name": "CONDITIONING", "type": "CONDITIONING", "links": [6], "slot_index": 0}],
             "properties": {"Node name for S&R": "CLIPTextEncode"}, "widgets_values": [NEGATIVE]},
            {"id": 6, "type": "CLIPTextEncode", "pos": [415, 186], "size": {"0": 422.845, "1": 164.3},
             "flags": {}, "order": 2, "mode": 0, "inputs": [{"name": "clip", "type": "CLIP", "link": 3}],
             "outputs": [{"name": "CONDITIONING", "type": "CONDITIONING", "links": [4], "slot_index": 0}],
             "properties": {"Node name for S&R": "CLIPTextEncode"}, "widgets_values": [POSITIVE]},
            {"id": 5, "type": "EmptyLatentImage", "pos": [473, 609], "size": {"0": 315, "1": 106},
             "flags": {}, "order": 1, "mode": 0,
             "outputs": [{"name": "LATENT", "type": "LATENT", "links": [2], "slot_index": 0}],
             "properties": {"Node name for S&R": "EmptyLatentImage"}, "widgets_values": [512, 512, 1]},
            {"id": 3, "type": "KSampler", "pos": [863, 186], "size": {"0": 315, "1": 262}, "flags": {},
             "order": 4, "mode": 0,
             "inputs": [{"name": "model", "type": "MODEL", "link": 1},
                        {"name": "positive", "type": "CONDITIONING", "link": 4},
                        {"name": "negative", "type": "CONDITIONING", "link": 6},
                        {"name": "latent_image", "type": "LATENT", "link": 2}],
             "outputs": [{"name": "LATENT", "type": "LATENT", "links": [7], "slot_index": 0}],
             "properties": {"Node name for S&R": "KSampler"},
             "widgets_values": [SEED, "randomize", 20, 8, "euler", "normal", 1]},
            {"id": 8, "type": "VAEDecode", "pos": [1209, 188], "size": {"0": 210, "1": 46}, "flags": {},
             "order": 5, "mode": 0,
             "inputs": [{"name": "samples", "type": "LATENT", "link": 7},
                        {"name": "vae", "type": "VAE", "link": 8}],
             "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [9], "slot_index": 0}],
             "properties": {"Node name for S&R": "VAEDecode"}},
            {"id": 9, "type": "SaveImage", "pos": [1451, 189], "size": {"0": 210, "1": 58}, "flags": {},
             "order": 6, "mode": 0, "inputs": [{"name": "images", "type": "IMAGE", "link": 9}],
             "properties": {}, "widgets_values": ["ComfyUI"]},
            {"id": 4, "type": "CheckpointLoaderSimple", "pos": [26, 474], "size": {"0": 315, "1": 98},
             "flags": {}, "order": 0, "mode": 0,
             "outputs": [{"name": "MODEL", "type": "MODEL", "links": [1], "slot_index": 0},
                         {"name": "CLIP", "type": "CLIP", "links": [3, 5], "slot_index": 1},
                         {"name": "VAE", "type": "VAE", "links": [8], "slot_index": 2}],
             "properties": {"Node name for S&R": "CheckpointLoaderSimple"},
             "widgets_values": ["v1-5-pruned-emaonly.safetensors"]},
        ],
        "links": [[1, 4, 0, 3, 0, "MODEL"], [2, 5, 0, 3, 3, "LATENT"], [3, 4, 1, 6, 0, "CLIP"],
                  [4, 6, 0, 3, 1, "CONDITIONING"], [5, 4, 1, 7, 0, "CLIP"], [6, 7, 0, 3, 2, "CONDITIONING"],
                  [7, 3, 0, 8, 0, "LATENT"], [8, 4, 2, 8, 1, "VAE"], [9, 8, 0, 9, 0, "IMAGE"]],
        "groups": [], "config": {}, "extra": {}, "version": 0.4,
    }


def default_prompt() -> dict:
    """The same graph as ComfyUI sends it to /prompt (API format)."""
    return {
        "3": {"inputs": {"seed": SEED, "steps": 20, "cfg": 8, "sampler_name": "euler", "scheduler": "normal",
                         "denoise": 1, "model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0],
                         "latent_image": ["5", 0]}, "class_type": "KSampler", "_meta": {"title": "KSampler"}},
        "4": {"inputs": {"ckpt_name": "v1-5-pruned-emaonly.safetensors"},
              "class_type": "CheckpointLoaderSimple", "_meta": {"title": "Load Checkpoint"}},
        "5": {"inputs": {"width": 512, "height": 512, "batch_size": 1}, "class_type": "EmptyLatentImage",
              "_meta": {"title": "Empty Latent Image"}},
        "6": {"inputs": {"text": POSITIVE, "clip": ["4", 1]}, "class_type": "CLIPTextEncode",
              "_meta": {"title": "CLIP Text Encode (Prompt)"}},
        "7": {"inputs": {"text": NEGATIVE, "clip": ["4", 1]}, "class_type": "CLIPTextEncode",
              "_meta": {"title": "CLIP Text Encode (Prompt)"}},
        "8": {"inputs": {"samples": ["3", 0], "vae": ["4", 2]}, "class_type": "VAEDecode",
              "_meta": {"title": "VAE Decode"}},
        "9": {"inputs": {"filename_prefix": "ComfyUI", "images": ["8", 0]}, "class_type": "SaveImage",
              "_meta": {"title": "Save Image"}},
    }


EXPECTED_LINKS = {("4", 0, "3", "model", "MODEL"), ("5", 0, "3", "latent_image", "LATENT"),
                  ("4", 1, "6", "clip", "CLIP"), ("6", 0, "3", "positive", "CONDITIONING"),
                  ("4", 1, "7", "clip", "CLIP"), ("7", 0, "3", "negative", "CONDITIONING"),
                  ("3", 0, "8", "samples", "LATENT"), ("4", 2, "8", "vae", "VAE"),
                  ("8", 0, "9", "images", "IMAGE")}
EXPECTED_WIDGETS = {
    "3": {"seed": SEED, "steps": 20, "cfg": 8, "sampler_name": "euler", "scheduler": "normal", "denoise": 1},
    "4": {"ckpt_name": "v1-5-pruned-emaonly.safetensors"},
    "5": {"width": 512, "height": 512, "batch_size": 1},
    "6": {"text": POSITIVE}, "7": {"text": NEGATIVE}, "8": {}, "9": {"filename_prefix": "ComfyUI"},
}


def link_set(workflow: Workflow) -> set[tuple]:
    return {(link.source, link.output, link.target, link.input, link.type) for link in workflow.links}


def widgets_of(workflow: Workflow) -> dict[str, dict]:
    return {node_id: node.widgets for node_id, node in workflow.nodes.items()}


def png_bytes(**chunks: str) -> bytes:
    info = PngInfo()
    for key, text in chunks.items():
        info.add_text(key, text)
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 30, 30)).save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


# -- UI format --

def test_ui_v04_default_graph_maps_widgets_by_input_order_and_slots_by_name():
    workflow, warnings = from_comfy_ui(default_graph(), LOOKUP)
    assert warnings == []
    assert link_set(workflow) == EXPECTED_LINKS
    assert widgets_of(workflow) == EXPECTED_WIDGETS
    assert workflow.nodes["3"].seed_controls == {"seed": "randomize"}
    assert workflow.nodes["3"].pos == (863.0, 186.0) and workflow.nodes["3"].size == (315.0, 262.0)
    assert all(node.mode == "normal" and node.title == "" for node in workflow.nodes.values())
    assert validate(workflow, LOOKUP) == []


def test_ui_v1_link_objects_give_the_same_graph():
    data = v1_graph()
    data["state"] = {"lastNodeId": 9, "lastLinkId": 9, "lastGroupId": 0, "lastRerouteId": 0}
    for node in data["nodes"]:
        node["pos"] = [node["pos"][0], node["pos"][1]]
        node["size"] = [node["size"]["0"], node["size"]["1"]]
    workflow, warnings = from_comfy_ui(data, LOOKUP)
    assert warnings == []
    assert link_set(workflow) == EXPECTED_LINKS
    assert widgets_of(workflow) == EXPECTED_WIDGETS


def test_groups_titles_colors_and_collapse_carry_over():
    data = default_graph()
    data["groups"] = [{"title": "Prompts", "bounding": [400, 100, 460, 520], "color": "#a1309b",
                       "font_size": 24}]
    data["nodes"][0].update(title="Negative", color="#322", flags={"collapsed": True})
    workflow, _ = from_comfy_ui(data, LOOKUP)
    assert [(g.title, g.rect, g.color) for g in workflow.groups] == [("Prompts", (400.0, 100.0, 460.0, 520.0),
                                                                      "#a1309b")]
    negative = workflow.nodes["7"]
    assert (negative.title, negative.color, negative.collapsed) == ("Negative", "#322", True)


def test_converted_widget_keeps_its_slot_and_a_socket_only_input_has_none():
    for steps_input, values in (
            ({"name": "steps", "type": "INT", "link": 10, "widget": {"name": "steps"}},
             [SEED, "fixed", 20, 7.5, "dpmpp_2m", "karras", 0.5]),
            ({"name": "steps", "type": "INT", "link": 10}, [SEED, "fixed", 7.5, "dpmpp_2m", "karras", 0.5])):
        data = default_graph()
        sampler = next(node for node in data["nodes"] if node["id"] == 3)
        sampler["inputs"].append(steps_input)
        sampler["widgets_values"] = values
        data["nodes"].append({"id": 10, "type": "StepCount", "pos": [600, 800], "mode": 0,
                              "outputs": [{"name": "INT", "type": "INT", "links": [10]}],
                              "widgets_values": [30]})
        data["links"].append([10, 10, 0, 3, 4, "INT"])
        workflow, warnings = from_comfy_ui(data, LOOKUP)
        assert warnings == []
        assert ("10", 0, "3", "steps", "INT") in link_set(workflow)
        widgets = workflow.nodes["3"].widgets
        assert (widgets["cfg"], widgets["sampler_name"], widgets["scheduler"], widgets["denoise"]) == \
            (7.5, "dpmpp_2m", "karras", 0.5)
        assert workflow.nodes["3"].seed_controls == {"seed": "fixed"}


def test_a_control_value_after_a_plain_int_widget_is_skipped():
    data = default_graph()
    data["nodes"].append({"id": 10, "type": "NoiseStep", "pos": [0, 0], "mode": 0,
                          "widgets_values": [7, "randomize", "increment"]})
    workflow, warnings = from_comfy_ui(data, {"NoiseStep": NoiseStep}.get)
    assert warnings[-1].startswith("7 node(s) have types Sluice does not know")  # only the test type is given
    assert workflow.nodes["10"].widgets == {"noise_seed": 7, "mode": "increment"}
    data["nodes"][-1]["widgets_values"] = [7, "increment"]
    workflow, _ = from_comfy_ui(data, {"NoiseStep": NoiseStep}.get)
    assert workflow.nodes["10"].widgets == {"noise_seed": 7, "mode": "increment"}


def test_reroutes_are_bridged_primitives_pushed_into_widgets_and_notes_kept_in_meta():
    data = default_graph()
    sampler = next(node for node in data["nodes"] if node["id"] == 3)
    sampler["inputs"].append({"name": "seed", "type": "INT", "link": 13, "widget": {"name": "seed"}})
    data["nodes"] += [
        {"id": 10, "type": "Reroute", "pos": [400, 100], "mode": 0,
         "inputs": [{"name": "", "type": "*", "link": 10}],
         "outputs": [{"name": "", "type": "MODEL", "links": [11]}], "properties": {"showOutputText": False}},
        {"id": 11, "type": "Reroute", "pos": [700, 100], "mode": 0,
         "inputs": [{"name": "", "type": "*", "link": 11}],
         "outputs": [{"name": "", "type": "MODEL", "links": [1]}], "properties": {}},
        {"id": 12, "type": "PrimitiveNode", "pos": [600, 0], "mode": 0,
         "outputs": [{"name": "INT", "type": "INT", "links": [13], "widget": {"name": "seed"}}],
         "properties": {"Run widget replace on values": False}, "widgets_values": [42, "increment"]},
        {"id": 13, "type": "Note", "pos": [20, 20], "mode": 0, "properties": {"text": ""},
         "widgets_values": ["Use a v1.5 checkpoint."]},
    ]
    data["links"][0] = [1, 11, 0, 3, 0, "*"]  # checkpoint -> reroute 10 -> reroute 11 -> sampler, untyped
    data["links"] += [[10, 4, 0, 10, 0, "*"], [11, 10, 0, 11, 0, "*"], [13, 12, 0, 3, 4, "INT"]]
    workflow, warnings = from_comfy_ui(data, LOOKUP)
    assert warnings == []
    assert sorted(workflow.nodes, key=int) == ["3", "4", "5", "6", "7", "8", "9"]
    assert link_set(workflow) == EXPECTED_LINKS
    assert workflow.nodes["3"].widgets["seed"] == 42
    assert workflow.nodes["3"].seed_controls == {"seed": "increment"}
    assert [(note["text"], note["pos"]) for note in workflow.meta["notes"]] == [("Use a v1.5 checkpoint.",
                                                                                 [20.0, 20.0])]
    assert validate(workflow, LOOKUP) == []


def lora_graph(lora_mode: int) -> dict:
    """The default graph with a LoRA loader after the checkpoint, and a muted second saver."""
    data = default_graph()
    data["nodes"] += [
        {"id": 10, "type": "LoraLoader", "pos": [200, 200], "mode": lora_mode,
         "inputs": [{"name": "model", "type": "MODEL", "link": 10},
                    {"name": "clip", "type": "CLIP", "link": 11}],
         "outputs": [{"name": "MODEL", "type": "MODEL", "links": [1]},
                     {"name": "CLIP", "type": "CLIP", "links": [3, 5]}],
         "widgets_values": ["style.pt", 0.8, 0.6]},
        {"id": 11, "type": "SaveImage", "pos": [1451, 400], "mode": 2,
         "inputs": [{"name": "images", "type": "IMAGE", "link": 12}], "widgets_values": ["muted"]},
    ]
    links = {link[0]: link for link in data["links"]}
    links[1] = [1, 10, 0, 3, 0, "MODEL"]
    links[3] = [3, 10, 1, 6, 0, "CLIP"]
    links[5] = [5, 10, 1, 7, 0, "CLIP"]
    links[10] = [10, 4, 0, 10, 0, "MODEL"]
    links[11] = [11, 4, 1, 10, 1, "CLIP"]
    links[12] = [12, 8, 0, 11, 0, "IMAGE"]
    data["links"] = list(links.values())
    return data


def test_muted_and_bypassed_modes_carry_over_and_the_api_export_resolves_through_them():
    workflow, warnings = from_comfy_ui(lora_graph(lora_mode=4), LOOKUP)
    assert warnings == []
    assert (workflow.nodes["10"].mode, workflow.nodes["11"].mode) == ("bypassed", "muted")
    assert workflow.nodes["10"].widgets == {"lora_name": "style.pt", "strength_model": 0.8,
                                            "strength_clip": 0.6}
    assert validate(workflow, LOOKUP) == []
    assert to_api_prompt(workflow, LOOKUP) == default_prompt()  # LoRA bypassed, muted saver left out


def test_api_export_keeps_an_active_lora():
    workflow, _ = from_comfy_ui(lora_graph(lora_mode=0), LOOKUP)
    prompt = to_api_prompt(workflow, LOOKUP)
    assert prompt["10"] == {"inputs": {"model": ["4", 0], "clip": ["4", 1], "lora_name": "style.pt",
                                       "strength_model": 0.8, "strength_clip": 0.6},
                            "class_type": "LoraLoader", "_meta": {"title": "Load LoRA"}}
    assert (prompt["3"]["inputs"]["model"], prompt["6"]["inputs"]["clip"]) == (["10", 0], ["10", 1])
    assert "11" not in prompt


def test_unknown_types_are_kept_and_named_in_one_warning():
    data = default_graph()
    data["nodes"] += [
        {"id": 10, "type": "UltimateSDUpscale", "pos": [1700, 200], "mode": 0,
         "inputs": [{"name": "image", "type": "IMAGE", "link": 10}],
         "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [11]}],
         "widgets_values": [2, SEED, "fixed"]},
        {"id": 11, "type": "UltimateSDUpscale", "pos": [1900, 200], "mode": 0,
         "inputs": [{"name": "image", "type": "IMAGE", "link": 11}], "outputs": [], "widgets_values": [4]},
        {"id": 12, "type": "ImpactWildcard", "pos": [0, 0], "mode": 0,
         "widgets_values": {"wildcard": "__x__"}},
    ]
    data["links"] += [[10, 8, 0, 10, 0, "IMAGE"], [11, 10, 0, 11, 0, "IMAGE"]]
    workflow, warnings = from_comfy_ui(data, LOOKUP)
    assert len(warnings) == 1
    assert "ImpactWildcard (node 12)" in warnings[0] and "UltimateSDUpscale (nodes 10, 11)" in warnings[0]
    assert {("8", 0, "10", "image", "IMAGE"), ("10", 0, "11", "image", "IMAGE")} <= link_set(workflow)
    assert workflow.nodes["12"].widgets == {"wildcard": "__x__"}
    assert workflow.meta["comfy_widgets_values"] == {"10": [2, SEED, "fixed"], "11": [4]}
    unknown = sorted(e.node_id for e in validate(workflow, LOOKUP) if e.kind == "unknown_type")
    assert unknown == ["10", "11", "12"]


# -- malformed files --

def test_dangling_links_and_short_widgets_values_load_with_warnings():
    data = default_graph()
    data["links"].append([20, 99, 0, 9, 0, "IMAGE"])  # a stale link from a deleted node
    next(node for node in data["nodes"] if node["id"] == 3)["widgets_values"] = [SEED, "fixed", 30]
    workflow, warnings = from_comfy_ui(data, LOOKUP)
    assert any("link 20" in w and "missing node 99" in w for w in warnings)
    assert any("node 3 (KSampler)" in w and "cfg, sampler_name, scheduler, denoise" in w for w in warnings)
    assert workflow.nodes["3"].widgets == {"seed": SEED, "steps": 30, "cfg": 8.0, "sampler_name": "euler",
                                           "scheduler": "normal", "denoise": 1.0}
    assert link_set(workflow) == EXPECTED_LINKS


DELETE = object()


def mangle(data: dict, path: tuple, value: object) -> dict:
    """`data` with the value at `path` replaced by `value` (or removed, for DELETE)."""
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


@pytest.mark.parametrize("path, value, expected", [
    (("links", 3), "oops", r"links\[3\] must be a list or an object"),
    (("links",), {"1": [1, 4, 0, 3, 0, "MODEL"]}, "'links' must be a list"),
    (("links", 0), [1, 4, 0, 3], r"links\[0\] must be \[id, origin_id"),
    (("links", 0, 4), -1, "link 1: target_slot must be an integer 0 or more"),
    (("nodes", 3, "type"), None, r"node 3: field 'type' must be a non-empty string"),
    (("nodes", 3, "pos"), ["a", 2], r"node 3 \(KSampler\): field 'pos' must be two numbers"),
    (("nodes", 3, "mode"), 7, r"node 3 \(KSampler\): unknown mode 7"),
    (("nodes", 3, "widgets_values"), "20", r"node 3 \(KSampler\): field 'widgets_values' must be a list"),
    (("nodes", 2), [], r"nodes\[2\] must be an object"),
    (("nodes", 1, "id"), 7, "duplicate node id 7"),
    (("groups",), [{"title": "x", "bounding": [1, 2]}], r"groups\[0\]: field 'bounding' must be"),
])
def test_malformed_ui_files_raise_a_workflow_error_naming_the_field(path, value, expected):
    with pytest.raises(WorkflowError, match=expected):
        from_comfy_ui(mangle(default_graph(), path, value), LOOKUP)


@pytest.mark.parametrize("mangled, expected", [
    ({"3": {"class_type": "KSampler", "inputs": {"model": ["40", 0]}}}, r"node 3 \(KSampler\): input 'model' "
                                                                        r"links to missing node '40'"),
    ({"3": {"class_type": "", "inputs": {}}}, "node 3: field 'class_type' must be a non-empty string"),
    ({"3": {"class_type": "KSampler", "inputs": [1]}},
     r"node 3 \(KSampler\): field 'inputs' must be an object"),
])
def test_malformed_api_prompts_raise_a_workflow_error_naming_the_node(mangled, expected):
    with pytest.raises(WorkflowError, match=expected):
        from_comfy_api(mangled, LOOKUP)


def value_paths(value: object, path: tuple = ()) -> list[tuple]:
    """The path of every value inside nested lists and dicts."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return [path] + [sub for key, item in items for sub in value_paths(item, (*path, key))]


def v1_graph() -> dict:
    data = default_graph()
    fields = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")
    data["links"] = [dict(zip(fields, link, strict=True)) for link in data["links"]]
    data["version"] = 1
    return data


@pytest.mark.parametrize("make, read", [(default_graph, from_comfy_ui), (v1_graph, from_comfy_ui),
                                        (default_prompt, from_comfy_api)])
def test_junk_anywhere_gives_a_workflow_error_or_warnings_never_a_crash(make, read):
    rng = random.Random(0)
    junk = [DELETE, None, -1, 3.5, "x", [], {}, [1], ["4", 9], {"0": "a"}, True, 10**30]
    for path in value_paths(make())[1:]:
        for value in rng.sample(junk, 3):
            try:
                workflow, _ = read(mangle(make(), path, value), LOOKUP)
            except WorkflowError:
                continue
            to_api_prompt(workflow, LOOKUP)
            from_comfy_ui(json.loads(json.dumps(to_comfy_ui(workflow, LOOKUP))), LOOKUP)


@pytest.mark.parametrize("text, expected", [
    ("[1, 2]", "found a JSON list"),
    ('{"foo": 1}', "found an object with keys 'foo'"),
    ('{"nodes": [', "invalid JSON at line 1"),
])
def test_unrecognised_json_names_the_accepted_formats(text, expected):
    with pytest.raises(WorkflowError, match=expected):
        load_any(text.encode(), LOOKUP)


# -- API format --

def test_api_prompt_gives_the_same_graph_laid_out_left_to_right():
    workflow, warnings = from_comfy_api(default_prompt(), LOOKUP)
    assert warnings == []
    assert link_set(workflow) == EXPECTED_LINKS
    assert widgets_of(workflow) == EXPECTED_WIDGETS
    assert all(node.title == "" and node.seed_controls == {} for node in workflow.nodes.values())
    for link in workflow.links:
        assert workflow.nodes[link.source].pos[0] < workflow.nodes[link.target].pos[0]
    positions = [node.pos for node in workflow.nodes.values()]
    assert len(set(positions)) == len(positions)
    assert validate(workflow, LOOKUP) == []


def test_api_prompt_types_links_of_unknown_nodes_as_any_and_warns_once():
    prompt = default_prompt()
    prompt["10"] = {"inputs": {"image": ["8", 0], "scale": 2}, "class_type": "ImageScaleBy2000"}
    prompt["11"] = {"inputs": {"images": ["10", 0], "filename_prefix": "up"}, "class_type": "SaveImage"}
    workflow, warnings = from_comfy_api(prompt, LOOKUP)
    assert len(warnings) == 1 and "ImageScaleBy2000 (node 10)" in warnings[0]
    assert {("8", 0, "10", "image", "IMAGE"), ("10", 0, "11", "images", "IMAGE")} <= link_set(workflow)
    assert workflow.nodes["10"].widgets == {"scale": 2}


def test_api_export_then_import_round_trips():
    workflow, _ = from_comfy_api(default_prompt(), LOOKUP)
    assert to_api_prompt(workflow, LOOKUP) == default_prompt()
    again, _ = from_comfy_api(json.loads(json.dumps(to_api_prompt(workflow, LOOKUP))), LOOKUP)
    assert again.to_dict() == workflow.to_dict()


def test_ui_import_exports_the_api_prompt_comfyui_would_send():
    workflow, _ = from_comfy_ui(default_graph(), LOOKUP)
    assert to_api_prompt(workflow, LOOKUP) == default_prompt()


def test_ui_export_writes_comfyui_slots_and_reimports_to_the_same_document():
    data = default_graph()
    data["nodes"].append({"id": 13, "type": "Note", "pos": [20, 20], "mode": 0, "widgets_values": ["hello"]})
    data["nodes"][0]["mode"] = 4
    workflow, _ = from_comfy_ui(data, LOOKUP)
    exported = json.loads(json.dumps(to_comfy_ui(workflow, LOOKUP)))
    by_id = {node["id"]: node for node in exported["nodes"]}
    assert by_id[3]["widgets_values"] == [SEED, "randomize", 20, 8, "euler", "normal", 1]
    assert by_id[7]["mode"] == 4 and by_id[13]["type"] == "Note"
    exported_links = {tuple(link[1:]) for link in exported["links"]}  # (from, slot, to, slot, type)
    assert exported_links == {tuple(link[1:]) for link in default_graph()["links"]}
    again, warnings = from_comfy_ui(exported, LOOKUP)
    assert warnings == []
    assert again.to_dict() == workflow.to_dict()


# -- load_any: files, text, PNGs --

def test_load_any_reads_sluice_and_comfy_json_from_paths_and_text(tmp_path):
    sluice, _ = from_comfy_ui(default_graph(), LOOKUP)
    sluice.save(tmp_path / "sluice.json")
    (tmp_path / "comfy.json").write_text(json.dumps(default_graph()), encoding="utf-8")
    (tmp_path / "api.json").write_text(json.dumps(default_prompt()), encoding="utf-8")
    loaded, warnings = load_any(tmp_path / "sluice.json", LOOKUP)
    assert loaded.to_dict() == sluice.to_dict() and warnings == []
    assert link_set(load_any(str(tmp_path / "comfy.json"), LOOKUP)[0]) == EXPECTED_LINKS
    assert link_set(load_any(tmp_path / "api.json", LOOKUP)[0]) == EXPECTED_LINKS
    assert link_set(load_any(json.dumps(default_prompt()), LOOKUP)[0]) == EXPECTED_LINKS
    with pytest.raises(WorkflowError, match="cannot read workflow .*absent.json"):
        load_any(tmp_path / "absent.json", LOOKUP)


def test_comfyui_png_prefers_the_workflow_chunk_over_the_prompt(tmp_path):
    path = tmp_path / "ComfyUI_00001_.png"
    path.write_bytes(png_bytes(prompt=json.dumps(default_prompt()), workflow=json.dumps(default_graph())))
    workflow, warnings = load_any(path, LOOKUP)
    assert warnings == [] and link_set(workflow) == EXPECTED_LINKS
    assert workflow.nodes["3"].pos == (863.0, 186.0)
    assert workflow.nodes["3"].seed_controls == {"seed": "randomize"}


def test_png_with_only_a_prompt_or_a_broken_workflow_chunk_reads_the_prompt():
    workflow, warnings = load_any(png_bytes(prompt=json.dumps(default_prompt())), LOOKUP)
    assert warnings == [] and widgets_of(workflow) == EXPECTED_WIDGETS
    broken = png_bytes(prompt=json.dumps(default_prompt()), workflow="{not json")
    workflow, warnings = load_any(broken, LOOKUP)
    assert link_set(workflow) == EXPECTED_LINKS
    assert len(warnings) == 1 and "text chunk 'workflow'" in warnings[0] and "invalid JSON" in warnings[0]


def test_sluice_png_loads_its_own_workflow_chunk():
    sluice, _ = from_comfy_ui(default_graph(), LOOKUP)
    workflow, warnings = load_any(png_bytes(workflow=sluice.dumps()), LOOKUP)
    assert warnings == [] and workflow.to_dict() == sluice.to_dict()


def test_png_without_a_workflow_names_the_chunks_it_has():
    with pytest.raises(WorkflowError, match="holds no workflow.*'parameters'"):
        load_any(png_bytes(parameters="a photo of a cat, Steps: 20"), LOOKUP)
    with pytest.raises(WorkflowError, match="cannot read the PNG"):
        load_any(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20, LOOKUP)


def test_cli_validate_reads_a_comfyui_prompt_and_prints_import_warnings(tmp_path, capsys):
    prompt = {"1": {"class_type": "NoSuchComfyNode", "inputs": {"value": 3}}}
    (tmp_path / "api.json").write_text(json.dumps(prompt), encoding="utf-8")
    code = main(["--plugins", str(tmp_path / "plugins"), "--models", str(tmp_path / "models"),
                 "--output", str(tmp_path / "out"), "validate", str(tmp_path / "api.json")])
    out, err = capsys.readouterr()
    assert code == 1
    assert "sluice: warning:" in err and "NoSuchComfyNode (node 1)" in err
    assert "unknown node type 'NoSuchComfyNode'" in out



# -- ComfyUI's own default workflow, with Sluice's real node types --

DEFAULT_FIXTURE = Path(__file__).parent / "fixtures" / "comfyui_default.json"
DEFAULT_WIDGETS = {
    "4": {"ckpt_name": "v1-5-pruned-emaonly-fp16.safetensors"},
    "6": {"text": "beautiful scenery nature glass bottle landscape, , purple galaxy bottle,"},
    "7": {"text": "text, watermark"},
    "5": {"width": 512, "height": 512, "batch_size": 1},
    "3": {"seed": 156680208700286, "steps": 20, "cfg": 8, "sampler_name": "euler", "scheduler": "normal",
          "denoise": 1},
    "9": {"filename_prefix": "ComfyUI"},
}


def _frontend_default_graph() -> dict:
    """The frontend's defaultGraph.ts: the seed followed by `true`, SaveImage without widgets_values."""
    data = json.loads(DEFAULT_FIXTURE.read_text(encoding="utf-8"))
    for node in data["nodes"]:
        if node["type"] == "KSampler":
            node["widgets_values"][1] = True
        if node["type"] in ("SaveImage", "VAEDecode"):
            del node["widgets_values"]
    return data


@pytest.mark.parametrize("variant", ["saved", "frontend_default_graph"])
def test_comfyuis_default_workflow_imports_with_its_widget_values(variant):
    registry = default_registry()
    data = json.loads(DEFAULT_FIXTURE.read_text(encoding="utf-8")) if variant == "saved" \
        else _frontend_default_graph()
    workflow, warnings = from_comfy_ui(data, registry.get)
    expected = dict(DEFAULT_WIDGETS)
    if variant == "frontend_default_graph":  # no value: Sluice's default prefix, with a warning
        default_prefix = registry.get("SaveImage").default_widget_values()["filename_prefix"]
        expected["9"] = {"filename_prefix": default_prefix}
        assert warnings == ["node 9 (SaveImage): widgets_values has no value for filename_prefix; using the "
                            "default"]
    else:
        assert warnings == []
    for node_id, values in expected.items():
        node = workflow.nodes[node_id]
        assert {name: node.widgets[name] for name in values} == values, node.type
    assert workflow.nodes["3"].seed_controls == {"seed": "randomize"}
    assert len(workflow.links) == 9
    errors = validate(workflow, registry.get)
    assert [(e.node_id, e.input_name) for e in errors] == [("4", "ckpt_name")]
    assert "v1-5-pruned-emaonly-fp16.safetensors" in str(errors[0])


def test_a_boolean_seed_control_reads_as_comfyuis_toggle():
    data = _frontend_default_graph()
    data["nodes"][3]["widgets_values"][1] = False
    workflow, _ = from_comfy_ui(data, default_registry().get)
    assert workflow.nodes["3"].seed_controls == {"seed": "fixed"}
    assert workflow.nodes["3"].widgets["steps"] == 20


def test_cli_validate_on_comfyuis_default_workflow_reports_only_the_missing_model(tmp_path, capsys):
    code = main(["--plugins", str(tmp_path / "plugins"), "--models", str(tmp_path / "models"),
                 "--output", str(tmp_path / "out"), "validate", str(DEFAULT_FIXTURE)])
    out, _ = capsys.readouterr()
    assert code == 1
    assert out.strip().splitlines() == [line for line in out.strip().splitlines()
                                        if "v1-5-pruned-emaonly-fp16.safetensors" in line]
    assert len(out.strip().splitlines()) == 1


def test_exports_write_sd_cpp_sampler_and_scheduler_names_as_comfyuis():
    """ComfyUI refuses `dpm++2m` or `discrete`; an export writes ComfyUI's name of the same sampler."""
    workflow, _ = from_comfy_ui(default_graph(), LOOKUP)
    workflow.nodes["3"].widgets.update(sampler_name="dpm++2m", scheduler="discrete")
    inputs = to_api_prompt(workflow, LOOKUP)["3"]["inputs"]
    assert (inputs["sampler_name"], inputs["scheduler"]) == ("dpmpp_2m", "normal")
    ui = {node["id"]: node for node in to_comfy_ui(workflow, LOOKUP)["nodes"]}
    assert ui[3]["widgets_values"][4:6] == ["dpmpp_2m", "normal"]  # after seed, control, steps, cfg
    workflow.nodes["3"].widgets["sampler_name"] = "euler_a"
    assert to_api_prompt(workflow, LOOKUP)["3"]["inputs"]["sampler_name"] == "euler_ancestral"
