"""The latent nodes and SDTurboScheduler against hand values and numpy re-derivations of ComfyUI's code, the
.latent file format both ways, and a ComfyUI API prompt of the new image, mask and latent nodes through the
executor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from engine import telemetry
from engine.graph.comfy import from_comfy_api
from engine.graph.executor import Executor
from engine.graph.spec import RunContext
from engine.models.bundles import DiffusionModel
from engine.sampling.model_sampling import EpsPrediction
from engine.settings import load_settings
from nodes import latent_ops as lo
from nodes.custom_sampling import SDTurboScheduler
from nodes.registry import default_registry

sys.path.insert(0, str(Path(__file__).parent))
from capture_node import Capture  # noqa: E402

CTX = RunContext("test")


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference_latent_composite(to: np.ndarray, frm: np.ndarray, x: int, y: int, feather: int) -> np.ndarray:
    """ComfyUI's LatentComposite, its mask built row by row and column by column."""
    x, y, feather = x // 8, y // 8, feather // 8
    s = to.copy()
    frm = frm[:, :, :to.shape[2] - y, :to.shape[3] - x]
    h, w = frm.shape[2:]
    mask = np.ones_like(frm)
    for t in range(feather):
        rate = (1.0 / feather) * (t + 1)
        if y != 0:
            mask[:, :, t:1 + t, :] *= rate
        if y + h < to.shape[2]:
            mask[:, :, h - 1 - t:h - t, :] *= rate
        if x != 0:
            mask[:, :, :, t:1 + t] *= rate
        if x + w < to.shape[3]:
            mask[:, :, :, w - 1 - t:w - t] *= rate
    s[:, :, y:y + h, x:x + w] = frm * mask + s[:, :, y:y + h, x:x + w] * (1 - mask)
    return s


@pytest.mark.parametrize("x, y, feather", [(0, 0, 0), (16, 8, 0), (16, 8, 16), (8, 0, 24), (40, 40, 8)])
def test_latent_composite_matches_comfyui(x, y, feather):
    to, frm = rand(2, 4, 6, 7), rand(2, 4, 4, 4, seed=1)
    got = lo.LatentComposite().run(CTX, {"samples": to, "batch_index": [3, 4]}, {"samples": frm}, x, y,
                                   feather)[0]
    expected = reference_latent_composite(to.numpy(), frm.numpy(), x, y, feather)
    np.testing.assert_allclose(got["samples"].numpy(), expected, atol=1e-6)
    assert got["batch_index"] == [3, 4]  # samples_to's other keys carry over
    with pytest.raises(ValueError, match="source has 3 latents, the destination 2"):
        lo.LatentComposite().run(CTX, {"samples": to}, {"samples": rand(3, 4, 4, 4)}, 0, 0, 0)


def test_latent_composite_masked_by_hand():
    destination, source = torch.zeros(1, 4, 4, 5), torch.ones(1, 4, 2, 2)
    mask = torch.tensor([[[1.0, 0.5], [0.0, 0.25]]])  # the source's own size: no resizing
    got = lo.LatentCompositeMasked().run(CTX, {"samples": destination}, {"samples": source}, 24, 8, False,
                                         mask)[0]["samples"]
    expected = torch.zeros(1, 4, 4, 5)
    expected[:, :, 1:3, 3:5] = mask  # x = 24 px = 3 cells, y = 8 px = 1 cell
    assert torch.equal(got, expected)
    edge = lo.LatentCompositeMasked().run(CTX, {"samples": destination}, {"samples": source}, 32, 24, False)
    assert edge[0]["samples"].sum() == 4 * 1  # only the top-left source cell lands inside (4 channels)
    stretched = lo.LatentCompositeMasked().run(CTX, {"samples": destination}, {"samples": source}, 0, 0, True)
    assert torch.allclose(stretched[0]["samples"], torch.ones(1, 4, 4, 5))


def test_latent_blend_and_batch_nodes_by_hand():
    a, b = rand(2, 4, 3, 3), rand(2, 4, 3, 3, seed=1)
    blended = lo.LatentBlend().run(CTX, {"samples": a}, {"samples": b}, 0.3)[0]["samples"]
    assert torch.allclose(blended, 0.3 * a + 0.7 * b)
    assert lo.LatentBlend().run(CTX, {"samples": a}, {"samples": rand(2, 4, 6, 6)}, 0.5)[0]["samples"].shape \
        == (2, 4, 3, 3)
    masks = torch.stack([torch.zeros(1, 8, 8), torch.ones(1, 8, 8)])  # (2, 1, H, W)
    latent = {"samples": a, "batch_index": [5, 6], "noise_mask": masks}
    repeated = lo.RepeatLatentBatch().run(CTX, latent, 3)[0]
    assert torch.equal(repeated["samples"], torch.cat([a, a, a]))
    assert repeated["batch_index"] == [5, 6, 7, 8, 9, 10]  # offset max - min + 1 = 2 per repeat
    assert repeated["noise_mask"].shape == (6, 1, 8, 8)
    picked = lo.LatentFromBatch().run(CTX, repeated, 4, 5)[0]  # only 2 left from index 4
    assert torch.equal(picked["samples"], a) and picked["batch_index"] == [9, 10]
    assert torch.equal(picked["noise_mask"], masks)
    plain = lo.LatentFromBatch().run(CTX, {"samples": a}, 63, 1)[0]  # index clamped to the last latent
    assert torch.equal(plain["samples"], a[1:]) and plain["batch_index"] == [1]
    noised = lo.SetLatentNoiseMask().run(CTX, {"samples": a}, torch.ones(2, 8, 8))[0]
    assert noised["noise_mask"].shape == (2, 1, 8, 8) and noised["samples"] is a
    assert "ignore" not in lo.SetLatentNoiseMask.description and "do not apply" in \
        lo.SetLatentNoiseMask.description


def test_save_latent_writes_comfyuis_format_and_load_latent_reads_it(tmp_path):
    settings = load_settings(output_dir=tmp_path / "output")
    ctx = RunContext("test", settings=settings)
    samples = rand(1, 4, 2, 3)
    lo.SaveLatent().run(ctx, {"samples": samples}, "latents/test")
    path = tmp_path / "output" / "latents" / "test_00001_.latent"
    tensors = safetensors.torch.load_file(str(path))
    assert set(tensors) == {"latent_tensor", "latent_format_version_0"}
    assert torch.equal(tensors["latent_tensor"], samples) and tensors["latent_format_version_0"].numel() == 0
    (tmp_path / "input").mkdir()
    (tmp_path / "input" / "a.latent").write_bytes(path.read_bytes())
    assert torch.equal(lo.LoadLatent().run(ctx, "a.latent")[0]["samples"], samples)
    safetensors.torch.save_file({"latent_tensor": samples}, str(tmp_path / "input" / "old.latent"))
    old = lo.LoadLatent().run(ctx, "old.latent")[0]["samples"]
    assert torch.allclose(old, samples / 0.18215)  # ComfyUI's pre-versioned files were scaled
    torch.save({"latent_tensor": samples}, tmp_path / "input" / "pickled.latent")
    with pytest.raises(ValueError, match="cannot read latent"):
        lo.LoadLatent().run(ctx, "pickled.latent")
    with pytest.raises(ValueError, match="not a .latent file name"):
        lo.LoadLatent().run(ctx, "../output/latents/test_00001_.latent")


def test_sd_turbo_scheduler_picks_comfyuis_timesteps():
    model = DiffusionModel.__new__(DiffusionModel)  # only the noise schedule is read
    model.model_sampling = EpsPrediction()
    betas = np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=np.float64) ** 2
    cumprod = np.cumprod(1 - betas)
    table = np.sqrt((1 - cumprod) / cumprod)
    node = SDTurboScheduler()
    np.testing.assert_allclose(node.run(CTX, model, 1, 1.0)[0].numpy(), [table[999], 0], rtol=1e-5)
    half = node.run(CTX, model, 4, 0.5)[0].numpy()  # start 10 - 5 = 5: timesteps 499, 399, 299, 199
    np.testing.assert_allclose(half, [*table[[499, 399, 299, 199]], 0], rtol=1e-5)
    assert len(node.run(CTX, model, 10, 0.3)[0]) == 4  # 3 timesteps left (299, 199, 99), then 0


def api_prompt() -> dict:
    """New nodes in a ComfyUI API prompt, as ComfyUI would queue it."""
    return {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 32, "height": 24, "batch_size": 1,
                                                     "color": 0xFF0000}},
        "2": {"class_type": "ImagePadForOutpaint", "inputs": {"image": ["1", 0], "left": 8, "top": 0,
                                                              "right": 8, "bottom": 0, "feathering": 4}},
        "3": {"class_type": "GrowMask", "inputs": {"mask": ["2", 1], "expand": 2, "tapered_corners": True}},
        "4": {"class_type": "InvertMask", "inputs": {"mask": ["3", 0]}},
        "5": {"class_type": "ImageInvert", "inputs": {"image": ["2", 0]}},
        "6": {"class_type": "ImageCompositeMasked", "inputs": {"destination": ["2", 0], "source": ["5", 0],
                                                               "x": 0, "y": 0, "resize_source": False,
                                                               "mask": ["4", 0]}},
        "7": {"class_type": "ImageBatch", "inputs": {"image1": ["6", 0], "image2": ["1", 0]}},
        "8": {"class_type": "Capture", "inputs": {"value": ["7", 0]}},
        "9": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "10": {"class_type": "RepeatLatentBatch", "inputs": {"samples": ["9", 0], "amount": 3}},
        "11": {"class_type": "LatentFromBatch", "inputs": {"samples": ["10", 0], "batch_index": 1,
                                                           "length": 2}},
        "12": {"class_type": "SolidMask", "inputs": {"value": 1.0, "width": 64, "height": 64}},
        "13": {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["11", 0], "mask": ["12", 0]}},
        "14": {"class_type": "SaveLatent", "inputs": {"samples": ["13", 0],
                                                      "filename_prefix": "latents/api"}},
        "15": {"class_type": "Capture", "inputs": {"value": ["13", 0]}},
    }


def test_a_comfyui_api_prompt_of_the_new_nodes_imports_and_runs(tmp_path):
    settings = load_settings(output_dir=tmp_path / "output")
    registry = default_registry(settings)
    registry.register(Capture)
    workflow, warnings = from_comfy_api(api_prompt(), registry.get)
    assert warnings == []
    Capture.seen.clear()
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status == "finished", result.failure or result.errors
    images = Capture.seen["8"]
    assert images.shape == (2, 24, 48, 3)
    assert torch.allclose(images[1, 0, 0], torch.tensor([1.0, 0, 0]))  # the red EmptyImage, batched
    # inside the image, far from the padding, the grown feather mask is 0: InvertMask makes it 1 -> inverted
    assert torch.allclose(images[0, 12, 24], torch.tensor([0.0, 1, 1]))
    assert torch.allclose(images[0, 12, 0], torch.tensor([0.5, 0.5, 0.5]))  # padding: mask 1 -> kept grey
    latent = Capture.seen["15"]
    assert latent["samples"].shape == (2, 4, 8, 8) and latent["batch_index"] == [1, 2]
    saved = tmp_path / "output" / "latents" / "api_00001_.latent"
    with safetensors.safe_open(str(saved), "pt") as file:
        metadata = file.metadata()
    assert json.loads(metadata["prompt"])  # the API prompt embedded, as ComfyUI's SaveLatent does
