"""/object_info describes Sluice's node types in ComfyUI's schema. The expected entries of KSampler,
CheckpointLoaderSimple and CLIPTextEncode are written out by hand from ComfyUI's documented INPUT_TYPES
(nodes.py): input names and order, types, defaults and ranges; a list stands for a choice input, checked by
the values ComfyUI's list has that Sluice's must have too."""

import json

from serve_client import request

from app.server.schema import object_info

SEED_MAX = 0xFFFFFFFFFFFFFFFF

# ComfyUI's nodes.py, by hand: (name, type or choice values that must be offered, options that must match)
KSAMPLER_REQUIRED = [
    ("model", "MODEL", {}),
    ("seed", "INT", {"default": 0, "min": 0, "max": SEED_MAX, "control_after_generate": True}),
    ("steps", "INT", {"default": 20, "min": 1, "max": 10000}),
    ("cfg", "FLOAT", {"default": 8.0, "min": 0.0, "max": 100.0, "step": 0.1}),
    ("sampler_name", ["euler", "euler_ancestral", "heun", "dpm_2", "lms", "dpmpp_2m", "dpmpp_sde", "ddim",
                      "uni_pc"], {}),
    ("scheduler", ["normal", "karras", "exponential", "sgm_uniform", "simple", "ddim_uniform", "beta"], {}),
    ("positive", "CONDITIONING", {}),
    ("negative", "CONDITIONING", {}),
    ("latent_image", "LATENT", {}),
    ("denoise", "FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01}),
]
CHECKPOINT_REQUIRED = [("ckpt_name", ["sluice-shapes.safetensors"], {})]
CLIP_TEXT_ENCODE_REQUIRED = [("text", "STRING", {"multiline": True}), ("clip", "CLIP", {})]

EXPECTED = {
    "KSampler": (KSAMPLER_REQUIRED, ["LATENT"], ["LATENT"], "sampling", "KSampler"),
    "CheckpointLoaderSimple": (CHECKPOINT_REQUIRED, ["MODEL", "CLIP", "VAE"], ["MODEL", "CLIP", "VAE"],
                               "loaders", "Load Checkpoint"),
    "CLIPTextEncode": (CLIP_TEXT_ENCODE_REQUIRED, ["CONDITIONING"], ["CONDITIONING"], "conditioning",
                       "CLIP Text Encode (Prompt)"),
}
SCHEMA_KEYS = {"input", "input_order", "output", "output_is_list", "output_name", "name", "display_name",
               "description", "python_module", "category", "output_node"}


def check_inputs(section, expected):
    assert list(section) == [name for name, _, _ in expected]
    for name, kind, options in expected:
        given = section[name]
        if isinstance(kind, list):
            assert isinstance(given[0], list) and set(kind) <= set(given[0]), name
        else:
            assert given[0] == kind, name
        given_options = given[1] if len(given) > 1 else {}
        for key, value in options.items():
            assert given_options.get(key) == value, (name, key)


def test_ksampler_checkpoint_loader_and_clip_text_encode_match_comfyui(start_server):
    url, _ = start_server()
    info = {}
    for name, (required, outputs, output_names, category, display_name) in EXPECTED.items():
        info.update(request("GET", f"{url}/object_info/{name}").json())
        entry = info[name]
        check_inputs(entry["input"]["required"], required)
        assert entry["input_order"]["required"] == [input_name for input_name, _, _ in required]
        assert entry["output"] == outputs and entry["output_name"] == output_names
        assert entry["output_is_list"] == [False] * len(outputs)
        assert entry["name"] == name and entry["display_name"] == display_name
        assert entry["category"] == category and entry["output_node"] is False
        assert entry["python_module"] == "nodes"
    # Sluice's placement widgets (not in ComfyUI's loaders) are optional: ComfyUI prompts need not name them
    assert list(info["CheckpointLoaderSimple"]["input"]["optional"]) == ["backend", "params_backend"]
    assert info["CheckpointLoaderSimple"]["input_order"]["optional"] == ["backend", "params_backend"]
    assert "optional" not in info["KSampler"]["input"]
    # a choice without a default starts at its first value in ComfyUI's clients: euler, as in ComfyUI
    assert info["KSampler"]["input"]["required"]["sampler_name"][0][0] == "euler"
    assert request("GET", f"{url}/object_info").json()["KSampler"] == info["KSampler"]


def test_every_node_type_is_described_in_comfyuis_schema(serve_registry, serve_settings):
    info = json.loads(json.dumps(object_info(serve_registry, serve_settings)))  # JSON all the way
    assert set(info) == {node_type.type_name for node_type in serve_registry.types()}
    for name, entry in info.items():
        assert SCHEMA_KEYS <= set(entry), name
        assert set(entry["input"]) <= {"required", "optional"}
        assert entry["input_order"] == {section: list(inputs) for section, inputs in entry["input"].items()}
        assert len(entry["output"]) == len(entry["output_name"]) == len(entry["output_is_list"])
        for section in entry["input"].values():
            for input_name, config in section.items():
                kind = config[0]
                assert isinstance(kind, (str, list)), (name, input_name)
                options = config[1] if len(config) > 1 else {}
                if "default" in options and isinstance(kind, list) and kind:
                    assert options["default"] in kind, (name, input_name)
                if "default" in options and kind in ("INT", "FLOAT"):
                    assert options.get("min", options["default"]) <= options["default"] \
                        <= options.get("max", options["default"]), (name, input_name)
    assert info["SaveImage"]["output_node"] is True
    assert info["LoadImage"]["input"]["required"]["image"][1] == {"image_upload": True}
