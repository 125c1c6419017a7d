"""nodes/upscale.py: ComfyUI's upscaling nodes, checked against torch / PIL resizing done here directly and
against spandrel's whole-image call on a tiny random-weight ESRGAN."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file
from spandrel.architectures.ESRGAN import ESRGAN

from engine.graph.spec import RunContext
from engine.models.upscaler import UpscaleModel
from engine.resize import bislerp
from engine.settings import Settings
from nodes.registry import default_registry
from nodes.upscale import (
    ImageScale,
    ImageScaleBy,
    ImageUpscaleWithModel,
    LatentUpscale,
    LatentUpscaleBy,
    UpscaleModelLoader,
)

COMFY_INPUTS = {
    "UpscaleModelLoader": ["model_name", "backend"],
    "ImageUpscaleWithModel": ["upscale_model", "image"],
    "ImageScale": ["image", "upscale_method", "width", "height", "crop"],
    "ImageScaleBy": ["image", "upscale_method", "scale_by"],
    "LatentUpscale": ["samples", "upscale_method", "width", "height", "crop"],
    "LatentUpscaleBy": ["samples", "upscale_method", "scale_by"],
}


@pytest.fixture()
def context(tmp_path: Path) -> RunContext:
    (tmp_path / "models" / "upscale_models").mkdir(parents=True)
    return RunContext("1", settings=Settings(tmp_path / "models", tmp_path / "output", None))


def test_nodes_are_registered_with_comfyui_input_order_and_defaults():
    registry = default_registry()
    for name, inputs in COMFY_INPUTS.items():
        assert [i.name for i in registry.get(name).inputs] == inputs
    assert ImageScale.default_widget_values() == {"upscale_method": "nearest-exact", "width": 512,
                                                  "height": 512, "crop": "disabled"}
    assert LatentUpscaleBy.default_widget_values() == {"upscale_method": "nearest-exact", "scale_by": 1.5}
    assert "bislerp" in LatentUpscale.input_named("upscale_method").current_choices()
    assert "lanczos" in ImageScaleBy.input_named("upscale_method").current_choices()


def test_loader_and_upscale_node_match_the_model_on_the_whole_image(context):
    torch.manual_seed(0)
    network = ESRGAN(num_filters=8, num_blocks=1, scale=2)
    folder = context.settings.models_root / "upscale_models"
    state = {k: v.contiguous() for k, v in network.state_dict().items()}
    save_file(state, str(folder / "tiny_x2.safetensors"))
    (model,) = UpscaleModelLoader().run(context, "tiny_x2.safetensors", "cpu")
    assert isinstance(model, UpscaleModel) and model.scale == 2
    image = torch.rand(1, 24, 32, 3)
    (upscaled,) = ImageUpscaleWithModel().run(context, model, image)
    with torch.no_grad():
        expected = network.eval()(image.movedim(-1, 1)).clamp(0, 1).movedim(1, -1)
    torch.testing.assert_close(upscaled, expected, atol=1e-6, rtol=0)


def test_missing_model_file_is_a_clear_error(context):
    with pytest.raises(ValueError, match="model 'absent.pth' \\(upscale_models\\) not found"):
        UpscaleModelLoader().run(context, "absent.pth", "auto")


@pytest.mark.parametrize("method", ["nearest-exact", "bilinear", "area", "bicubic"])
def test_image_scale_is_torch_interpolate(context, method):
    image = torch.rand(2, 30, 40, 3)
    (result,) = ImageScale().run(context, image, method, 64, 48, "disabled")
    expected = F.interpolate(image.movedim(-1, 1), size=(48, 64), mode=method).movedim(1, -1)
    torch.testing.assert_close(result, expected)


def test_image_scale_lanczos_is_pils(context):
    image = torch.rand(1, 30, 40, 3)
    (result,) = ImageScale().run(context, image, "lanczos", 64, 48, "disabled")
    pil = Image.fromarray((image[0].numpy() * 255).round().astype(np.uint8)).resize((64, 48), Image.LANCZOS)
    torch.testing.assert_close(result[0], torch.from_numpy(np.array(pil)).float() / 255)


def test_image_scale_zero_side_keeps_aspect_and_center_crop_cuts_the_long_side(context):
    image = torch.rand(1, 30, 60, 3)
    (kept,) = ImageScale().run(context, image, "bilinear", 0, 60, "disabled")
    assert kept.shape == (1, 60, 120, 3)
    (cropped,) = ImageScale().run(context, image, "nearest-exact", 30, 30, "center")
    torch.testing.assert_close(cropped, image[:, :, 15:45])
    (same,) = ImageScale().run(context, image, "bilinear", 0, 0, "disabled")
    assert same is image


def test_image_scale_by_rounds_the_size(context):
    (result,) = ImageScaleBy().run(context, torch.rand(1, 30, 41, 3), "bicubic", 1.5)
    assert result.shape == (1, 45, 62, 3)


def test_latent_upscale_sizes_in_pixels_and_keeps_other_keys(context):
    latent = {"samples": torch.randn(1, 4, 8, 12), "batch_index": [0]}
    (result,) = LatentUpscale().run(context, latent, "bilinear", 192, 128, "disabled")
    expected = F.interpolate(latent["samples"], size=(16, 24), mode="bilinear")
    torch.testing.assert_close(result["samples"], expected)
    assert result["batch_index"] == [0]
    (by,) = LatentUpscaleBy().run(context, latent, "nearest-exact", 1.5)
    assert by["samples"].shape == (1, 4, 12, 18)


def test_bislerp_keeps_a_constant_latent_and_interpolates_norms_linearly(context):
    vector = torch.randn(4)
    constant = vector.view(1, 4, 1, 1).expand(1, 4, 6, 6).contiguous()
    (result,) = LatentUpscaleBy().run(context, {"samples": constant}, "bislerp", 2.0)
    torch.testing.assert_close(result["samples"], vector.view(1, 4, 1, 1).expand(1, 4, 12, 12))
    # two orthogonal unit vectors: the midpoint of a slerp is their normalised sum, length 1
    two = torch.zeros(1, 4, 1, 2)
    two[0, 0, 0, 0], two[0, 1, 0, 1] = 1.0, 1.0
    (wide,) = LatentUpscale().run(context, {"samples": two}, "bislerp", 0, 0, "disabled")
    assert wide["samples"] is two
    middle = bislerp(two, 3, 1)[0, :, 0, 1]
    torch.testing.assert_close(middle, torch.tensor([0.5 ** 0.5, 0.5 ** 0.5, 0, 0]))


def test_unknown_method_is_a_clear_error(context):
    with pytest.raises(ValueError, match="unknown upscale method 'cubic'; accepted: nearest-exact"):
        ImageScale().run(context, torch.rand(1, 8, 8, 3), "cubic", 16, 16, "disabled")
