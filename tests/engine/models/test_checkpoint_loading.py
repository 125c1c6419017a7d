"""Loading SD checkpoints into our models: every tensor bound from its prefixed key, dtypes, split files,
the per-process cache and the errors. The reference for each tensor is the file as safetensors reads it."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.memory.runtime import MemoryRuntime
from engine.models import loader
from engine.models.bundles import MissingComponentError
from engine.models.clip import UNUSED_CHECKPOINT_KEYS, component_prefix
from engine.models.detect import UnsupportedModelError, detect
from engine.models.formats import CheckpointError
from engine.models.vae import AutoencoderKL
from engine.sampling.model_sampling import EpsPrediction, VPrediction

sys.path.insert(0, str(Path(__file__).parent))
from sd_checkpoints import SD1_TE, XL_TE_G, XL_TE_L, save_state_dict, write_checkpoint  # noqa: E402

UNET_PREFIX, VAE_PREFIX = "model.diffusion_model.", "first_stage_model."


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("checkpoints")
    paths = {}
    for family in ("sd1", "sd2", "sdxl"):
        paths[family] = folder / f"{family}.safetensors"
        write_checkpoint(paths[family], family, seed=1)
    paths["sd1_fp16"] = folder / "sd1_fp16.safetensors"
    write_checkpoint(paths["sd1_fp16"], "sd1", dtype=torch.float16, seed=2)
    return paths


def _assert_bound_from(module: torch.nn.Module, file_tensors: dict[str, torch.Tensor], prefix: str,
                       unused: tuple[str, ...] = ()) -> None:
    """Every parameter equals the file tensor at prefix + its name, and every such file tensor is used."""
    state = module.state_dict()
    assert not any(t.is_meta for t in state.values())
    for name, tensor in state.items():
        expected = file_tensors[prefix + name].to(tensor.dtype)
        assert torch.equal(tensor, expected), name
    component_keys = {k for k in file_tensors if k.startswith(prefix)}
    used = {prefix + n for n in state} | {prefix + n for n in unused if prefix + n in file_tensors}
    assert component_keys == used


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_every_component_tensor_is_bound_from_its_prefixed_key(files: dict[str, Path], family: str) -> None:
    tensors = load_file(files[family])
    model, clip, vae = loader.load_checkpoint(files[family])
    _assert_bound_from(model.unet, tensors, UNET_PREFIX)
    _assert_bound_from(vae.autoencoder, tensors, VAE_PREFIX)
    for encoder in clip.encoders:
        _assert_bound_from(encoder, tensors, component_prefix(encoder.config), UNUSED_CHECKPOINT_KEYS)
    assert model.family == clip.family == family
    assert len(clip.encoders) == (2 if family == "sdxl" else 1)
    assert model.latent_scale == (0.13025 if family == "sdxl" else 0.18215)


def test_weights_are_converted_to_the_requested_dtype(files: dict[str, Path]) -> None:
    tensors = load_file(files["sd1_fp16"])
    model, clip, vae = loader.load_checkpoint(files["sd1_fp16"])  # default on the CPU: float32
    assert {p.dtype for p in model.unet.parameters()} == {torch.float32}
    _assert_bound_from(model.unet, tensors, UNET_PREFIX)
    model_bf16 = loader.load_diffusion_model(files["sd1_fp16"], dtype="bf16")
    assert {p.dtype for p in model_bf16.unet.parameters()} == {torch.bfloat16}
    _assert_bound_from(model_bf16.unet, tensors, UNET_PREFIX)
    with pytest.raises(ValueError, match="unknown weight dtype 'fp8'; accepted: default, fp32, fp16, bf16"):
        loader.load_diffusion_model(files["sd1_fp16"], dtype="fp8")
    with pytest.raises(CheckpointError, match="float8_e4m3fn is not supported for the sd1 UNet"):
        loader.load_diffusion_model(files["sd1_fp16"], dtype="fp8_e4m3fn")  # ComfyUI's choice: storage only


def _strip(tensors: dict[str, torch.Tensor], prefix: str, new_prefix: str = "") -> dict[str, torch.Tensor]:
    return {new_prefix + k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def test_split_files_load_the_same_weights_as_the_single_file(files: dict[str, Path], tmp_path: Path) -> None:
    tensors = load_file(files["sd1"])
    save_file(_strip(tensors, UNET_PREFIX), tmp_path / "unet.safetensors")
    save_file(_strip(tensors, VAE_PREFIX), tmp_path / "vae.safetensors")
    save_file(_strip(tensors, "cond_stage_model.transformer."), tmp_path / "clip_l.safetensors")
    model = loader.load_diffusion_model(tmp_path / "unet.safetensors")
    vae = loader.load_vae(tmp_path / "vae.safetensors")
    clip = loader.load_text_encoders([tmp_path / "clip_l.safetensors"])
    _assert_bound_from(model.unet, tensors, UNET_PREFIX)
    _assert_bound_from(vae.autoencoder, tensors, VAE_PREFIX)
    _assert_bound_from(clip.encoders[0], tensors, "cond_stage_model.transformer.", UNUSED_CHECKPOINT_KEYS)
    assert (model.family, clip.family) == ("sd1", "sd1")
    _, single_clip, _ = loader.load_checkpoint(files["sd1"])
    assert torch.equal(clip.encode("a red fox")[0][0], single_clip.encode("a red fox")[0][0])


def test_sdxl_text_encoders_from_two_files_encode_like_the_checkpoint(files: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    tensors = load_file(files["sdxl"])
    save_file(_strip(tensors, XL_TE_L, "text_model."), tmp_path / "clip_l.safetensors")
    save_file(_strip(tensors, XL_TE_G), tmp_path / "clip_g.safetensors")
    paths = [tmp_path / "clip_g.safetensors", tmp_path / "clip_l.safetensors"]
    clip = loader.load_text_encoders(paths, "sdxl")
    _, single, _ = loader.load_checkpoint(files["sdxl"])
    assert clip.kinds == single.kinds == ("clip_l", "openclip_g")
    [[context, extras]] = clip.encode("a (lighthouse:1.3) at dusk")
    [[reference_context, reference_extras]] = single.encode("a (lighthouse:1.3) at dusk")
    assert torch.equal(context, reference_context)
    assert torch.equal(extras["pooled_output"], reference_extras["pooled_output"])


@pytest.mark.parametrize("params", ["device", "disk"])
def test_sd1_clip_keys_without_text_model_load_like_the_normal_file(files: dict[str, Path], tmp_path: Path,
                                                                   params: str) -> None:
    # Older transformers wrote `cond_stage_model.transformer.embeddings...`; ComfyUI renames them.
    tensors = load_file(files["sd1"])
    bare = {k.replace(SD1_TE, "cond_stage_model.transformer."): v for k, v in tensors.items()}
    assert bare.keys() != tensors.keys() and not any("text_model." in k for k in bare)
    save_file(bare, tmp_path / "bare.safetensors")
    info, reference_info = detect(bare), detect(tensors)
    assert (info.layout, info.family) == ("sd1", reference_info.family)
    assert [x.key_prefix for x in info.text_encoders] == ["cond_stage_model.transformer."]
    runtime = MemoryRuntime() if params == "disk" else None
    _, clip, _ = loader.load_checkpoint(tmp_path / "bare.safetensors", params=params, runtime=runtime)
    _, reference, _ = loader.load_checkpoint(files["sd1"])
    [[context, _]] = clip.encode("a (red:1.2) fox")
    assert torch.equal(context, reference.encode("a (red:1.2) fox")[0][0])


def test_torch_zip_checkpoint_loads_like_safetensors(tmp_path: Path) -> None:
    tensors = write_checkpoint(tmp_path / "sd2.ckpt", "sd2", fmt="ckpt", seed=3)
    model, clip, vae = loader.load_checkpoint(tmp_path / "sd2.ckpt")
    _assert_bound_from(model.unet, tensors, UNET_PREFIX)
    _assert_bound_from(clip.encoders[0], tensors, "cond_stage_model.model.", UNUSED_CHECKPOINT_KEYS)


def test_loading_a_file_twice_returns_the_cached_models_until_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    write_checkpoint(path, "sd1", seed=4)
    first = loader.load_checkpoint(path)
    assert all(a is b for a, b in zip(first, loader.load_checkpoint(path), strict=True))
    assert loader.load_vae(path) is first[2]
    write_checkpoint(path, "sd1", seed=5)
    reloaded = loader.load_checkpoint(path)
    assert reloaded[0] is not first[0]
    assert not torch.equal(reloaded[0].unet.out[2].weight, first[0].unet.out[2].weight)


def test_prediction_type_and_latent_scale_come_from_the_file(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "v.safetensors", "sd2", components=("diffusion",),
                     metadata={"sluice.prediction": "v"})
    model = loader.load_diffusion_model(tmp_path / "v.safetensors")
    assert isinstance(model.model_sampling, VPrediction)
    write_checkpoint(tmp_path / "xl.safetensors", "sdxl", components=("diffusion",))
    model = loader.load_diffusion_model(tmp_path / "xl.safetensors")
    assert type(model.model_sampling) is EpsPrediction
    assert (model.latent_scale, model.latent_format) == (0.13025, "sdxl")


def test_vae_works_in_raw_latents_and_the_model_applies_the_scale(files: dict[str, Path]) -> None:
    """ComfyUI's LATENT convention: VAEModel.decode(z) == the LDM decode of the scaled latent z * scale."""
    tensors = load_file(files["sd1"])
    _, _, vae = loader.load_checkpoint(files["sd1"])
    config = dataclasses.replace(vae.autoencoder.config, scale_factor=0.18215)
    reference = AutoencoderKL(config, device="meta")
    reference.load_state_dict(_strip(tensors, VAE_PREFIX), assign=True)
    latent = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    expected = ((reference.decode(latent * 0.18215) + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1)
    torch.testing.assert_close(vae.decode(latent), expected, atol=1e-5, rtol=0)
    image = torch.rand(1, 19, 21, 3, generator=torch.Generator().manual_seed(1))  # cropped to the factor 2
    pixels = image[:, :18, :20, :].permute(0, 3, 1, 2) * 2 - 1
    torch.testing.assert_close(vae.encode(image), reference.encode(pixels) / 0.18215, atol=1e-5, rtol=1e-5)


def test_a_file_without_sd_components_is_named_in_a_clear_error(tmp_path: Path) -> None:
    save_file({"blocks.0.weight": torch.zeros(2, 2)}, tmp_path / "other.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"not a model file Sluice reads .*other.safetensors"):
        loader.load_checkpoint(tmp_path / "other.safetensors")


def test_a_missing_component_says_which_loader_to_add(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "unet.safetensors", "sd1", components=("diffusion",))
    model, clip, vae = loader.load_checkpoint(tmp_path / "unet.safetensors")
    assert model is not None and clip is None and vae is None
    with pytest.raises(MissingComponentError, match="unet.safetensors has no VAE; add a VAELoader"):
        loader.load_vae(tmp_path / "unet.safetensors")
    with pytest.raises(MissingComponentError, match="has no text encoder \\(CLIP, T5\\); add a CLIPLoader"):
        loader.load_text_encoders([tmp_path / "unet.safetensors"])


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path: Path) -> None:
    tensors = write_checkpoint(tmp_path / "good.safetensors", "sd1", components=("diffusion",))
    tensors["out.0.weight"] = torch.ones(7)  # the final GroupNorm; detection does not read it
    save_state_dict(tmp_path / "bad.safetensors", tensors, "safetensors")
    with pytest.raises(ValueError, match=r"bad.safetensors: the diffusion model does not match "
                                         r".*out\.0\.weight \(expected \(64,\), got \(7,\)\)"):
        loader.load_diffusion_model(tmp_path / "bad.safetensors")


def test_a_truncated_file_is_a_checkpoint_error(files: dict[str, Path], tmp_path: Path) -> None:
    data = files["sd1"].read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated safetensors file .*cut.safetensors"):
        loader.load_checkpoint(tmp_path / "cut.safetensors")
