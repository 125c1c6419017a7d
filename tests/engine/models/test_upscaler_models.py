"""engine/models/upscaler.py: tiny random-weight spandrel networks saved as safetensors and .pth, loaded
through our readers; the tiled upscale is compared with spandrel's own whole-image call (the reference)."""

import pytest
import torch
from safetensors.torch import save_file
from spandrel.architectures.Compact import Compact
from spandrel.architectures.ESRGAN import ESRGAN
from spandrel.architectures.SPAN import SPAN

from engine.models.upscaler import UpscalerError, load_upscale_model


def tiny_networks() -> dict[str, tuple[torch.nn.Module, int]]:
    torch.manual_seed(0)
    return {
        "ESRGAN": (ESRGAN(num_filters=8, num_blocks=1, scale=2), 2),
        "RealESRGAN Compact": (Compact(num_feat=8, num_conv=2, upscale=4), 4),
        "SPAN": (SPAN(num_in_ch=3, num_out_ch=3, feature_channels=8, upscale=2), 2),
    }


def save(network: torch.nn.Module, path, fmt: str):
    state = {k: v.contiguous() for k, v in network.state_dict().items()}
    if fmt == "safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)
    return path


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("upscale_models")
    saved = {}
    for index, (architecture, (network, scale)) in enumerate(tiny_networks().items()):
        fmt = ("safetensors", "pth")[index % 2]
        saved[architecture] = (save(network, folder / f"tiny_{index}.{fmt}", fmt), scale, network)
    return saved


@pytest.mark.parametrize("architecture", ["ESRGAN", "RealESRGAN Compact", "SPAN"])
def test_architecture_and_scale_are_detected_from_the_file(saved_models, architecture):
    path, scale, network = saved_models[architecture]
    model = load_upscale_model(path, "cpu")
    assert (model.architecture, model.scale, model.compute_device) == (architecture, scale, "cpu")
    for name, tensor in network.state_dict().items():
        assert torch.equal(model.descriptor.model.state_dict()[name], tensor)


@pytest.mark.parametrize("architecture", ["ESRGAN", "RealESRGAN Compact", "SPAN"])
def test_one_tile_upscale_equals_the_whole_image_model_call(saved_models, architecture):
    path, scale, _ = saved_models[architecture]
    model = load_upscale_model(path, "cpu")
    image = torch.rand(2, 40, 48, 3)
    expected = torch.cat([model.descriptor(image[i:i + 1].movedim(-1, 1)) for i in range(2)]).movedim(1, -1)
    result = model.upscale(image, tile=64, overlap=8)
    assert result.shape == (2, 40 * scale, 48 * scale, 3)
    assert torch.equal(result, expected)


@pytest.mark.parametrize("architecture", ["ESRGAN", "RealESRGAN Compact"])
def test_overlapping_tiles_match_the_whole_image_within_seam_tolerance(saved_models, architecture):
    path, scale, _ = saved_models[architecture]
    model = load_upscale_model(path, "cpu")
    torch.manual_seed(1)
    image = torch.rand(1, 100, 120, 3)
    expected = model.descriptor(image.movedim(-1, 1)).movedim(1, -1)
    progress = []
    result = model.upscale(image, tile=64, overlap=16, on_progress=lambda done, total: progress.append(total))
    error = (result - expected).abs()
    # measured max / mean: 3.2e-3 / 4e-5 (ESRGAN), 6e-3 / 1.3e-4 (Compact)
    assert error.max() < 0.02 and error.mean() < 5e-4
    assert progress and set(progress) == {6}  # 2 rows x 3 columns of 64 px tiles


def test_rgba_image_is_upscaled_as_rgb(saved_models):
    path, scale, _ = saved_models["RealESRGAN Compact"]
    model = load_upscale_model(path, "cpu")
    rgba = torch.rand(1, 16, 16, 4)
    assert torch.equal(model.upscale(rgba), model.upscale(rgba[..., :3].contiguous()))


def test_unknown_architecture_names_the_file_and_the_supported_ones(tmp_path):
    path = tmp_path / "not_an_upscaler.safetensors"
    save_file({"encoder.weight": torch.zeros(4, 4)}, str(path))
    with pytest.raises(UpscalerError) as error:
        load_upscale_model(path, "cpu")
    message = str(error.value)
    assert str(path) in message and "ESRGAN" in message and "SwinIR" in message and "HAT" in message


def test_bad_device_name_is_a_clear_error(saved_models):
    path, _, _ = saved_models["SPAN"]
    with pytest.raises(ValueError, match="unknown device 'tpu7'"):
        load_upscale_model(path, "tpu7")


def test_half_precision_file_loads_into_a_float32_model(tmp_path):
    torch.manual_seed(2)
    network = Compact(num_feat=8, num_conv=2, upscale=2)
    path = tmp_path / "tiny_fp16.safetensors"
    save_file({k: v.half().contiguous() for k, v in network.state_dict().items()}, str(path))
    model = load_upscale_model(path, "cpu")
    assert model.scale == 2 and model.descriptor.dtype == torch.float32
    for name, tensor in network.state_dict().items():
        assert torch.equal(model.descriptor.model.state_dict()[name], tensor.half().float())
