"""engine/models/taesd.py and engine/previews.py: the TAESD decoder against diffusers' AutoencoderTiny decoder
on random weights, the preview options, and decoders made for one checkpoint's VAE (the embedded model's).

Key map (explicit): the reference taesd_decoder layout is an nn.Sequential whose index 0 is Clamp, while
diffusers' DecoderTiny applies the clamp in forward() and numbers its `layers` from the first conv, so
reference key "{i}.rest" == diffusers "decoder.layers.{i - 1}.rest". diffusers returns the image in -1..1
(x * 2 - 1); the reference decoder returns 0..1.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderTiny
from safetensors.torch import save_file

from engine.graph.spec import RunContext
from engine.models.formats import open_checkpoint
from engine.models.taesd import (
    TAESDDecoder,
    TAESDError,
    find_checkpoint_decoder,
    find_taesd_decoder,
    load_taesd_decoder,
    taesd_preview,
)
from engine.previews import make_previewer, preview_options
from engine.sampling.preview import latent_to_rgb
from engine.settings import Settings, embedded_models_dir
from nodes import loaders
from nodes.preview import TAESDDecode, taesd_choices, taesd_family


def reference_layout(diffusers_decoder: torch.nn.Module) -> dict[str, torch.Tensor]:
    """diffusers DecoderTiny state -> taesd_decoder.safetensors keys ("layers.{j}.x" -> "{j + 1}.x")."""
    state = {}
    for key, value in diffusers_decoder.state_dict().items():
        layer, rest = key.removeprefix("layers.").split(".", 1)
        state[f"{int(layer) + 1}.{rest}"] = value.contiguous()
    return state


@pytest.fixture(scope="module")
def tiny_autoencoder() -> AutoencoderTiny:
    torch.manual_seed(0)
    return AutoencoderTiny().eval()  # SD1 TAESD configuration, random weights


@pytest.fixture(scope="module")
def models_root(tmp_path_factory, tiny_autoencoder) -> Path:
    root = tmp_path_factory.mktemp("models")
    (root / "vae_approx").mkdir()
    path = root / "vae_approx" / "taesd_decoder.safetensors"
    save_file(reference_layout(tiny_autoencoder.decoder), str(path))
    return root


def test_decoder_matches_diffusers_autoencoder_tiny(models_root, tiny_autoencoder):
    decoder = load_taesd_decoder(models_root / "vae_approx" / "taesd_decoder.safetensors")
    assert "3.conv.0.weight" in decoder.state_dict() and "1.weight" in decoder.state_dict()
    latent = torch.randn(2, 4, 6, 5) * 2
    with torch.no_grad():
        expected = ((tiny_autoencoder.decoder(latent) + 1) / 2).clamp(0, 1)
    result = decoder.decode(latent)
    assert result.shape == (2, 3, 48, 40)
    torch.testing.assert_close(result, expected, atol=1e-5, rtol=0)  # measured max error 1.5e-8


def test_wrong_layout_names_the_file_and_the_missing_keys(tmp_path):
    path = tmp_path / "taesd_decoder.safetensors"
    save_file({"1.weight": torch.zeros(64, 4, 3, 3)}, str(path))
    with pytest.raises(TAESDError, match=r"taesd_decoder.safetensors does not match .* missing: 1.bias"):
        load_taesd_decoder(path)


def test_decoder_file_is_found_per_family(models_root):
    settings = Settings(models_root, models_root / "out", None)
    assert find_taesd_decoder(settings, "sd1").name == "taesd_decoder.safetensors"
    assert find_taesd_decoder(settings, "sdxl") is None


def test_auto_preview_uses_taesd_when_present_and_stays_small(models_root):
    settings = Settings(models_root, models_root / "out", None)
    previewer = make_previewer({}, "sd1", settings)
    latent = torch.randn(1, 4, 48, 24)  # a 384 x 192 image
    frame = previewer(0, 10, latent)
    assert frame.dtype == np.uint8 and frame.shape == (256, 128, 3)  # area-shrunk to 32 x 16, decoded at 8x
    decoder = load_taesd_decoder(models_root / "vae_approx" / "taesd_decoder.safetensors")
    np.testing.assert_array_equal(frame, taesd_preview(decoder, latent))


def test_auto_without_decoder_is_the_latent_to_rgb_projection():
    previewer = make_previewer(None, "sdxl", None)
    latent = torch.randn(1, 4, 16, 24)
    np.testing.assert_array_equal(previewer(0, 4, latent), latent_to_rgb(latent, "sdxl"))
    assert previewer(0, 4, torch.randn(1, 4, 128, 128)).shape == (128, 128, 3)
    assert previewer(0, 4, torch.randn(1, 4, 400, 200)).shape == (256, 128, 3)


def test_every_n_steps_and_always_the_last_one():
    previewer = make_previewer({"preview": {"method": "latent2rgb", "every": 3}}, "sd1", None)
    shown = [step for step in range(8) if previewer(step, 8, torch.zeros(1, 4, 8, 8)) is not None]
    assert shown == [0, 3, 6, 7]


def test_none_turns_previews_off_and_bad_options_are_clear_errors(tmp_path):
    assert make_previewer({"preview": {"method": "none"}}, "sd1", None) is None
    with pytest.raises(ValueError, match="method 'vae'; accepted: auto, latent2rgb, taesd, none"):
        preview_options({"preview": {"method": "vae"}})
    with pytest.raises(ValueError, match="every must be a whole number of steps >= 1; got 0"):
        preview_options({"preview": {"every": 0}})
    with pytest.raises(ValueError, match="needs taesdxl_decoder.safetensors for latent family 'sdxl'"):
        make_previewer({"preview": {"method": "taesd"}}, "sdxl", Settings(tmp_path, tmp_path, None))


def test_taesd_decode_node_scales_raw_latents_into_the_model_space(models_root):
    context = RunContext("1", settings=Settings(models_root, models_root / "out", None))
    raw = torch.randn(2, 4, 4, 6)
    (images,) = TAESDDecode().run(context, {"samples": raw}, "taesd_decoder.safetensors")
    decoder = load_taesd_decoder(models_root / "vae_approx" / "taesd_decoder.safetensors")
    torch.testing.assert_close(images, decoder.decode(raw * 0.18215).movedim(1, -1))
    assert images.shape == (2, 32, 48, 3)
    assert taesd_family("sub/taesdxl_decoder.pth") == "sdxl"
    with pytest.raises(ValueError, match="cannot tell the latent family of TAESD file 'tiny.safetensors'"):
        taesd_family("tiny.safetensors")


def narrow_decoder_file(path: Path, scale: float | None) -> TAESDDecoder:
    """A width-16, one-Block-per-stage decoder with random weights saved at `path` (scale in the metadata)."""
    torch.manual_seed(1)
    decoder = TAESDDecoder(latent_channels=4, width=16, blocks=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in decoder.state_dict().items()}, str(path),
              metadata=None if scale is None else {"sluice.vae_scale_factor": str(scale)})
    return decoder.eval()


def test_a_narrow_decoder_loads_with_its_width_blocks_and_latent_scale(tmp_path):
    path = tmp_path / "vae_approx" / "tiny_taesd_decoder.safetensors"
    reference = narrow_decoder_file(path, 0.5)
    decoder = load_taesd_decoder(path)
    assert decoder.latent_scale == 0.5 and decoder[1].weight.shape == (16, 4, 3, 3)
    assert len(decoder) == 3 + 3 * 3 + 2  # Clamp, conv, ReLU, 3 x (1 Block, upsample, conv), Block, conv
    latent = torch.randn(1, 4, 3, 5)
    torch.testing.assert_close(decoder.decode(latent), reference.decode(latent))
    narrow_decoder_file(tmp_path / "plain" / "taesd_decoder.safetensors", None)
    assert load_taesd_decoder(tmp_path / "plain" / "taesd_decoder.safetensors").latent_scale is None


def test_a_checkpoints_own_decoder_is_preferred_for_its_previews(models_root, tmp_path):
    root = tmp_path / "models"
    own = root / "vae_approx" / "mine_taesd_decoder.safetensors"
    narrow_decoder_file(own, 0.5)
    (root / "vae_approx" / "taesd_decoder.safetensors").write_bytes(
        (models_root / "vae_approx" / "taesd_decoder.safetensors").read_bytes())
    settings = Settings(root, root / "out", None, embedded_models=False)
    checkpoint = root / "checkpoints" / "mine.safetensors"
    assert find_checkpoint_decoder(settings, checkpoint) == own
    assert find_checkpoint_decoder(settings, root / "checkpoints" / "other.safetensors") is None
    latent = torch.randn(1, 4, 6, 6)
    frame = make_previewer({}, "sd1", settings, checkpoint)(0, 4, latent)
    np.testing.assert_array_equal(frame, taesd_preview(load_taesd_decoder(own), latent))
    other = root / "checkpoints" / "other.safetensors"
    family_frame = make_previewer({}, "sd1", settings, other)(0, 4, latent)
    family = load_taesd_decoder(root / "vae_approx" / "taesd_decoder.safetensors")
    np.testing.assert_array_equal(family_frame, taesd_preview(family, latent))


def test_taesd_decode_node_scales_by_the_decoders_own_latent_scale(tmp_path):
    root = tmp_path / "models"
    path = root / "vae_approx" / "mine_taesd_decoder.safetensors"
    decoder = narrow_decoder_file(path, 0.5)
    context = RunContext("1", settings=Settings(root, root / "out", None, embedded_models=False))
    raw = torch.randn(1, 4, 4, 4)
    (images,) = TAESDDecode().run(context, {"samples": raw}, "mine_taesd_decoder.safetensors")
    torch.testing.assert_close(images, decoder.decode(raw * 0.5).movedim(1, -1))


def test_the_embedded_model_ships_a_preview_decoder_listed_for_taesd_decode(tmp_path, monkeypatch):
    monkeypatch.setattr(loaders, "_settings", Settings(tmp_path, tmp_path, None))  # an empty models root
    path = embedded_models_dir() / "vae_approx" / "sluice-shapes_taesd_decoder.safetensors"
    assert path.stat().st_size < 1024 * 1024
    checkpoint = embedded_models_dir() / "checkpoints" / "sluice-shapes.safetensors"
    with open_checkpoint(checkpoint) as reader:
        scale = float(reader.metadata()["sluice.vae_scale_factor"])
    assert load_taesd_decoder(path).latent_scale == pytest.approx(scale, abs=1e-6)
    assert "sluice-shapes_taesd_decoder.safetensors" in taesd_choices()
