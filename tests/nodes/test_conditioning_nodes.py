"""The conditioning combinators and the model patch, guider, merge and save nodes: ComfyUI's declarations
(names, input order, defaults, ranges, outputs), their CONDITIONING edits against ComfyUI's code re-derived by
hand, and a ComfyUI API prompt of all of them run through the executor on the embedded model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import safetensors
import torch

from engine import telemetry
from engine.graph.comfy import from_comfy_api
from engine.graph.executor import Executor
from engine.graph.spec import RunContext
from engine.models.loader import clear_cache, load_checkpoint
from engine.sampling.guidance import RescaleCfg
from engine.sampling.model_sampling import VPrediction
from engine.settings import load_settings
from nodes import conditioning as cn
from nodes import model_patches as mp
from nodes.registry import default_registry

sys.path.insert(0, str(Path(__file__).parent))
from capture_node import Capture  # noqa: E402

CTX = RunContext("test")
MAX = 16384

# ComfyUI's declarations: (type, category, [(input, kind, default, min, max, step)], outputs)
DECLARATIONS = {
    "ConditioningCombine": (
        "conditioning",
        [("conditioning_1", "CONDITIONING"), ("conditioning_2", "CONDITIONING")],
        ["CONDITIONING"],
    ),
    "ConditioningConcat": (
        "conditioning",
        [("conditioning_to", "CONDITIONING"), ("conditioning_from", "CONDITIONING")],
        ["CONDITIONING"],
    ),
    "ConditioningAverage": (
        "conditioning",
        [
            ("conditioning_to", "CONDITIONING"),
            ("conditioning_from", "CONDITIONING"),
            ("conditioning_to_strength", "FLOAT", 1.0, 0.0, 1.0, 0.01),
        ],
        ["CONDITIONING"],
    ),
    "ConditioningSetArea": (
        "conditioning",
        [
            ("conditioning", "CONDITIONING"),
            ("width", "INT", 64, 64, MAX, 8),
            ("height", "INT", 64, 64, MAX, 8),
            ("x", "INT", 0, 0, MAX, 8),
            ("y", "INT", 0, 0, MAX, 8),
            ("strength", "FLOAT", 1.0, 0.0, 10.0, 0.01),
        ],
        ["CONDITIONING"],
    ),
    "ConditioningSetAreaPercentage": (
        "conditioning",
        [
            ("conditioning", "CONDITIONING"),
            ("width", "FLOAT", 1.0, 0.0, 1.0, 0.01),
            ("height", "FLOAT", 1.0, 0.0, 1.0, 0.01),
            ("x", "FLOAT", 0.0, 0.0, 1.0, 0.01),
            ("y", "FLOAT", 0.0, 0.0, 1.0, 0.01),
            ("strength", "FLOAT", 1.0, 0.0, 10.0, 0.01),
        ],
        ["CONDITIONING"],
    ),
    "ConditioningSetAreaStrength": (
        "conditioning",
        [("conditioning", "CONDITIONING"), ("strength", "FLOAT", 1.0, 0.0, 10.0, 0.01)],
        ["CONDITIONING"],
    ),
    "ConditioningSetMask": (
        "conditioning",
        [
            ("conditioning", "CONDITIONING"),
            ("mask", "MASK"),
            ("strength", "FLOAT", 1.0, 0.0, 10.0, 0.01),
            ("set_cond_area", "COMBO", "default"),
        ],
        ["CONDITIONING"],
    ),
    "ConditioningSetTimestepRange": (
        "advanced/conditioning",
        [
            ("conditioning", "CONDITIONING"),
            ("start", "FLOAT", 0.0, 0.0, 1.0, 0.001),
            ("end", "FLOAT", 1.0, 0.0, 1.0, 0.001),
        ],
        ["CONDITIONING"],
    ),
    "ModelSamplingDiscrete": (
        "advanced/model",
        [("model", "MODEL"), ("sampling", "COMBO", "eps"), ("zsnr", "BOOLEAN", False)],
        ["MODEL"],
    ),
    "RescaleCFG": (
        "advanced/model",
        [("model", "MODEL"), ("multiplier", "FLOAT", 0.7, 0.0, 1.0, 0.01)],
        ["MODEL"],
    ),
    "PerpNeg": (
        "_for_testing",
        [
            ("model", "MODEL"),
            ("empty_conditioning", "CONDITIONING"),
            ("neg_scale", "FLOAT", 1.0, 0.0, 100.0, 0.01),
        ],
        ["MODEL"],
    ),
    "PerpNegGuider": (
        "_for_testing",
        [
            ("model", "MODEL"),
            ("positive", "CONDITIONING"),
            ("negative", "CONDITIONING"),
            ("empty_conditioning", "CONDITIONING"),
            ("cfg", "FLOAT", 8.0, 0.0, 100.0, 0.1),
            ("neg_scale", "FLOAT", 1.0, 0.0, 100.0, 0.01),
        ],
        ["GUIDER"],
    ),
    "DualCFGGuider": (
        "sampling/custom_sampling/guiders",
        [
            ("model", "MODEL"),
            ("cond1", "CONDITIONING"),
            ("cond2", "CONDITIONING"),
            ("negative", "CONDITIONING"),
            ("cfg_conds", "FLOAT", 8.0, 0.0, 100.0, 0.1),
            ("cfg_cond2_negative", "FLOAT", 8.0, 0.0, 100.0, 0.1),
            ("style", "COMBO", "regular"),
        ],
        ["GUIDER"],
    ),
    "FreeU_V2": (
        "model_patches/unet",
        [
            ("model", "MODEL"),
            ("b1", "FLOAT", 1.3, 0.0, 10.0, 0.01),
            ("b2", "FLOAT", 1.4, 0.0, 10.0, 0.01),
            ("s1", "FLOAT", 0.9, 0.0, 10.0, 0.01),
            ("s2", "FLOAT", 0.2, 0.0, 10.0, 0.01),
        ],
        ["MODEL"],
    ),
    "ModelMergeSimple": (
        "advanced/model_merging",
        [("model1", "MODEL"), ("model2", "MODEL"), ("ratio", "FLOAT", 1.0, 0.0, 1.0, 0.01)],
        ["MODEL"],
    ),
    "CheckpointSave": (
        "advanced/model_merging",
        [
            ("model", "MODEL"),
            ("clip", "CLIP"),
            ("vae", "VAE"),
            ("filename_prefix", "STRING", "checkpoints/ComfyUI"),
        ],
        [],
    ),
    "VAESave": (
        "advanced/model_merging",
        [("vae", "VAE"), ("filename_prefix", "STRING", "vae/ComfyUI_vae")],
        [],
    ),
}
CHOICES = {
    ("ConditioningSetMask", "set_cond_area"): ["default", "mask bounds"],
    ("ModelSamplingDiscrete", "sampling"): ["eps", "v_prediction", "lcm", "x0"],
    ("DualCFGGuider", "style"): ["regular", "nested"],
}


@pytest.mark.parametrize("name", sorted(DECLARATIONS))
def test_declarations_are_comfyuis(name):
    node = default_registry().get(name)
    category, inputs, outputs = DECLARATIONS[name]
    assert node.category == category
    assert [o.type for o in node.outputs] == outputs
    assert [i.name for i in node.inputs] == [spec[0] for spec in inputs]
    for spec, declared in zip(inputs, node.inputs, strict=True):
        assert declared.kind == spec[1], spec
        if len(spec) > 2:
            assert declared.default == spec[2], spec
        if len(spec) > 3:
            assert (declared.min, declared.max, declared.step) == spec[3:], spec
        if (name, spec[0]) in CHOICES:
            assert declared.current_choices() == CHOICES[name, spec[0]]
    assert node.output_node == (name in ("CheckpointSave", "VAESave"))


def entry(value: float, tokens: int = 4, **options) -> list:
    return [torch.full((1, tokens, 3), value), options]


def test_combine_concat_and_average_edit_as_comfyui():
    a, b = (
        [entry(1.0, pooled_output=torch.ones(1, 2))],
        [entry(2.0, 6, pooled_output=torch.full((1, 2), 4.0)), entry(9.0)],
    )
    (combined,) = cn.ConditioningCombine().run(CTX, a, b)
    assert len(combined) == 3 and all(x is y for x, y in zip(combined, a + b, strict=True))
    (concat,) = cn.ConditioningConcat().run(CTX, a, b)
    assert torch.equal(concat[0][0], torch.cat([a[0][0], b[0][0]], dim=1)) and concat[0][1] is not a[0][1]
    (average,) = cn.ConditioningAverage().run(
        CTX, [entry(1.0, 8), entry(3.0, 2, pooled_output=None)], b, 0.25
    )
    expected = torch.cat([torch.full((1, 6, 3), 0.25 * 1 + 0.75 * 2), torch.full((1, 2, 3), 0.25)], dim=1)
    torch.testing.assert_close(average[0][0], expected)  # `from` cut to the length, zero-padded beyond it
    torch.testing.assert_close(
        average[0][1]["pooled_output"], torch.full((1, 2), 4.0)
    )  # `to` had none: from's
    torch.testing.assert_close(average[1][0], torch.full((1, 2, 3), 0.25 * 3 + 0.75 * 2))
    assert torch.equal(average[1][1]["pooled_output"], torch.full((1, 2), 4.0))  # a None pooled takes from's
    (mixed,) = cn.ConditioningAverage().run(CTX, a, b, 0.25)
    torch.testing.assert_close(mixed[0][1]["pooled_output"], torch.full((1, 2), 0.25 + 3.0))
    assert torch.equal(a[0][0], torch.ones(1, 4, 3)) and set(a[0][1]) == {"pooled_output"}  # inputs untouched


def test_area_mask_strength_and_range_nodes_set_comfyuis_options():
    base = [entry(1.0, pooled_output=None, width=512)]
    (area,) = cn.ConditioningSetArea().run(CTX, base, 100, 64, 20, 9, 0.5)
    assert area[0][1] == {
        "pooled_output": None,
        "width": 512,
        "area": (8, 12, 1, 2),
        "strength": 0.5,
        "set_area_to_bounds": False,
    }
    (percent,) = cn.ConditioningSetAreaPercentage().run(CTX, base, 0.5, 0.25, 0.1, 0.2, 2.0)
    assert percent[0][1]["area"] == ("percentage", 0.25, 0.5, 0.2, 0.1)
    (strength,) = cn.ConditioningSetAreaStrength().run(CTX, area, 3.0)
    assert strength[0][1]["strength"] == 3.0 and strength[0][1]["area"] == (8, 12, 1, 2)
    (masked,) = cn.ConditioningSetMask().run(CTX, base, torch.ones(5, 7), 0.3, "mask bounds")
    assert masked[0][1]["mask"].shape == (1, 5, 7) and masked[0][1]["mask_strength"] == 0.3
    assert masked[0][1]["set_area_to_bounds"] is True
    (ranged,) = cn.ConditioningSetTimestepRange().run(CTX, base, 0.2, 0.8)
    assert (ranged[0][1]["start_percent"], ranged[0][1]["end_percent"]) == (0.2, 0.8)
    assert base[0][1] == {"pooled_output": None, "width": 512}
    with pytest.raises(ValueError, match="expected a CONDITIONING"):
        cn.ConditioningSetArea().run(CTX, "text", 64, 64, 0, 0, 1.0)
    with pytest.raises(ValueError, match="conditioning_from is empty"):
        cn.ConditioningConcat().run(CTX, base, [])


def api_prompt() -> dict:
    """Every node of this change in one ComfyUI API prompt, as ComfyUI would queue it."""

    def text(words: str) -> dict:
        return {"class_type": "CLIPTextEncode", "inputs": {"text": words, "clip": ["2", 0]}}

    def custom(guider: str) -> dict:
        return {
            "class_type": "SamplerCustomAdvanced",
            "inputs": {
                "noise": ["43", 0],
                "guider": [guider, 0],
                "sampler": ["41", 0],
                "sigmas": ["42", 0],
                "latent_image": ["30", 0],
            },
        }

    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sluice-shapes.safetensors"}},
        "2": {
            "class_type": "CLIPLoader",
            "inputs": {"clip_name": "sluice-shapes-clip.safetensors", "type": "stable_diffusion"},
        },
        "3": text("a red circle in the center"),
        "4": text("a blue square"),
        "5": text(""),
        "6": {
            "class_type": "ConditioningSetArea",
            "inputs": {"conditioning": ["4", 0], "width": 64, "height": 64, "x": 64, "y": 0, "strength": 0.8},
        },
        "7": {
            "class_type": "ConditioningCombine",
            "inputs": {"conditioning_1": ["3", 0], "conditioning_2": ["6", 0]},
        },
        "8": {"class_type": "SolidMask", "inputs": {"value": 1.0, "width": 64, "height": 64}},
        "9": {
            "class_type": "ConditioningSetMask",
            "inputs": {
                "conditioning": ["3", 0],
                "mask": ["8", 0],
                "strength": 0.5,
                "set_cond_area": "mask bounds",
            },
        },
        "10": {
            "class_type": "ConditioningSetTimestepRange",
            "inputs": {"conditioning": ["9", 0], "start": 0.0, "end": 0.5},
        },
        "11": {
            "class_type": "ConditioningAverage",
            "inputs": {
                "conditioning_to": ["7", 0],
                "conditioning_from": ["4", 0],
                "conditioning_to_strength": 0.7,
            },
        },
        "12": {
            "class_type": "ConditioningConcat",
            "inputs": {"conditioning_to": ["11", 0], "conditioning_from": ["5", 0]},
        },
        "13": {
            "class_type": "ConditioningCombine",
            "inputs": {"conditioning_1": ["12", 0], "conditioning_2": ["10", 0]},
        },
        "14": {
            "class_type": "ConditioningSetAreaPercentage",
            "inputs": {
                "conditioning": ["5", 0],
                "width": 0.5,
                "height": 0.5,
                "x": 0.5,
                "y": 0.25,
                "strength": 1.0,
            },
        },
        "15": {
            "class_type": "ConditioningSetAreaStrength",
            "inputs": {"conditioning": ["14", 0], "strength": 0.5},
        },
        "16": {
            "class_type": "ConditioningCombine",
            "inputs": {"conditioning_1": ["5", 0], "conditioning_2": ["15", 0]},
        },
        "20": {
            "class_type": "ModelSamplingDiscrete",
            "inputs": {"model": ["1", 0], "sampling": "v_prediction", "zsnr": True},
        },
        "21": {"class_type": "RescaleCFG", "inputs": {"model": ["20", 0], "multiplier": 0.7}},
        "22": {
            "class_type": "FreeU_V2",
            "inputs": {"model": ["21", 0], "b1": 1.3, "b2": 1.4, "s1": 0.9, "s2": 0.2},
        },
        "23": {
            "class_type": "ModelMergeSimple",
            "inputs": {"model1": ["22", 0], "model2": ["1", 0], "ratio": 0.5},
        },
        "30": {"class_type": "EmptyLatentImage", "inputs": {"width": 128, "height": 64, "batch_size": 1}},
        "31": {
            "class_type": "KSampler",
            "inputs": {
                "model": ["23", 0],
                "seed": 7,
                "steps": 1,
                "cfg": 5.0,
                "sampler_name": "euler",
                "scheduler": "normal",
                "positive": ["13", 0],
                "negative": ["16", 0],
                "latent_image": ["30", 0],
                "denoise": 1.0,
            },
        },
        "32": {"class_type": "Capture", "inputs": {"value": ["31", 0]}},
        "33": {"class_type": "Capture", "inputs": {"value": ["23", 0]}},
        "40": {
            "class_type": "PerpNegGuider",
            "inputs": {
                "model": ["1", 0],
                "positive": ["7", 0],
                "negative": ["4", 0],
                "empty_conditioning": ["5", 0],
                "cfg": 4.0,
                "neg_scale": 1.0,
            },
        },
        "41": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "42": {
            "class_type": "BasicScheduler",
            "inputs": {"model": ["1", 0], "scheduler": "normal", "steps": 1, "denoise": 1.0},
        },
        "43": {"class_type": "RandomNoise", "inputs": {"noise_seed": 3}},
        "44": custom("40"),
        "45": {"class_type": "Capture", "inputs": {"value": ["44", 0]}},
        "50": {
            "class_type": "DualCFGGuider",
            "inputs": {
                "model": ["1", 0],
                "cond1": ["3", 0],
                "cond2": ["4", 0],
                "negative": ["5", 0],
                "cfg_conds": 3.0,
                "cfg_cond2_negative": 5.0,
                "style": "nested",
            },
        },
        "51": custom("50"),
        "52": {"class_type": "Capture", "inputs": {"value": ["51", 0]}},
        "60": {
            "class_type": "PerpNeg",
            "inputs": {"model": ["1", 0], "empty_conditioning": ["5", 0], "neg_scale": 1.0},
        },
        "61": {
            "class_type": "KSampler",
            "inputs": {
                "model": ["60", 0],
                "seed": 7,
                "steps": 1,
                "cfg": 4.0,
                "sampler_name": "euler",
                "scheduler": "normal",
                "positive": ["7", 0],
                "negative": ["4", 0],
                "latent_image": ["30", 0],
                "denoise": 1.0,
            },
        },
        "62": {"class_type": "Capture", "inputs": {"value": ["61", 0]}},
        "70": {
            "class_type": "CheckpointSave",
            "inputs": {
                "model": ["23", 0],
                "clip": ["2", 0],
                "vae": ["1", 2],
                "filename_prefix": "checkpoints/api",
            },
        },
        "71": {"class_type": "VAESave", "inputs": {"vae": ["1", 2], "filename_prefix": "vae/api"}},
    }


def test_a_comfyui_api_prompt_of_these_nodes_runs_and_saves_a_checkpoint_that_loads_back(tmp_path):
    settings = load_settings(output_dir=tmp_path / "output")
    registry = default_registry(settings)
    registry.register(Capture)
    workflow, warnings = from_comfy_api(api_prompt(), registry.get)
    assert warnings == []
    Capture.seen.clear()
    clear_cache()
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status == "finished", result.failure or result.errors
    for node in ("32", "45", "52", "62"):
        samples = Capture.seen[node]["samples"]
        assert samples.shape == (1, 4, 8, 16) and bool(torch.isfinite(samples).all()), node
    model = Capture.seen["33"]
    assert isinstance(model.model_sampling, VPrediction) and model.model_sampling.zsnr
    assert model.options["sampler_cfg_function"] == RescaleCfg(0.7) and model.options["output_block_patches"]
    saved = tmp_path / "output" / "checkpoints" / "api_00001_.safetensors"
    with safetensors.safe_open(str(saved), "pt") as file:
        assert {"v_pred", "ztsnr"} <= set(file.keys()) and "prompt" in file.metadata()
    clear_cache()
    reloaded, clip, vae = load_checkpoint(saved)
    original = dict(model.unet.named_parameters())  # the embedded model merged with itself: its own weights
    assert all(torch.equal(p, original[n]) for n, p in reloaded.unet.named_parameters())
    assert isinstance(reloaded.model_sampling, VPrediction) and clip is not None and vae is not None
    assert (tmp_path / "output" / "vae" / "api_00001_.safetensors").is_file()


def test_patch_nodes_refuse_links_that_are_not_a_model():
    for node, widgets in (
        (mp.FreeU_V2(), (1.3, 1.4, 0.9, 0.2)),
        (mp.RescaleCFG(), (0.7,)),
        (mp.ModelSamplingDiscrete(), ("eps", False)),
    ):
        with pytest.raises(ValueError, match="expected a MODEL input, got str"):
            node.run(CTX, "not a model", *widgets)
