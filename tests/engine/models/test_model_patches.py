"""FreeU v2 against a numpy re-derivation of ComfyUI's patch (through a hand-written UNet loop), the merge of
two models against hand-computed weights, and checkpoints saved in the key layout they were read from and
loaded back equal (SD1, SDXL, FLUX, a VAE alone, the v-prediction marker)."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.torch
import torch

from engine.models.bundles import DiffusionModel
from engine.models.checkpoint_save import checkpoint_tensors, vae_tensors, write_safetensors
from engine.models.detect import UNetConfig
from engine.models.loader import clear_cache, load_checkpoint, load_vae
from engine.models.model_patches import FreeUV2, fourier_filter, merge_simple, with_freeu_v2
from engine.models.unet import UNetModel, timestep_embedding
from engine.sampling.model_sampling import EpsPrediction, VPrediction
from nodes.model_patches import ModelSamplingDiscrete
from tests.engine.models.flux_checkpoints import write_flux_files
from tests.engine.models.sd_checkpoints import write_checkpoint

B1, B2, S1, S2 = 1.3, 1.4, 0.9, 0.2  # FreeU_V2's defaults


def random_unet(config: UNetConfig, seed: int, dtype: torch.dtype = torch.float32) -> UNetModel:
    unet = UNetModel(config, dtype=dtype, device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in unet.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return unet


def three_level_config(context_dim: int = 8) -> UNetConfig:
    """Levels of 32, 64 and 128 channels: FreeU's 2x and 4x levels both occur."""
    return UNetConfig(in_channels=4, out_channels=4, model_channels=32, channel_mult=(1, 2, 4),
                      num_res_blocks=1, attention_levels=(1,), transformer_depth=(0, 1, 0),
                      transformer_depth_middle=0, num_heads=2, num_head_channels=-1, context_dim=context_dim,
                      use_linear_in_transformer=False,
                      adm_in_channels=None, num_classes=None, prediction="eps", family="sd1")


def bundle(unet: UNetModel) -> DiffusionModel:
    return DiffusionModel(unet=unet, model_sampling=EpsPrediction(), family="sd1", latent_channels=4,
                          latent_scale=1.0, latent_shift=0.0, compute_device="cpu")


def numpy_freeu(h: np.ndarray, skip: np.ndarray, model_channels: int) -> tuple[np.ndarray, np.ndarray]:
    """ComfyUI's FreeU_V2 output-block patch, re-derived in numpy (float64 FFT)."""
    scales = {model_channels * 4: (B1, S1), model_channels * 2: (B2, S2)}
    if h.shape[1] not in scales:
        return h, skip
    backbone, skip_scale = scales[h.shape[1]]
    mean = h.mean(axis=1, keepdims=True)
    low, high = mean.min(axis=(2, 3), keepdims=True), mean.max(axis=(2, 3), keepdims=True)
    mean = (mean - low) / (high - low)
    h = h.copy()
    half = h.shape[1] // 2
    h[:, :half] = h[:, :half] * ((backbone - 1) * mean + 1)
    return h, numpy_filter(skip, skip_scale)


def numpy_filter(x: np.ndarray, scale: float) -> np.ndarray:
    """The 2 x 2 centred lowest frequencies of the shifted spectrum scaled (FreeU's threshold 1)."""
    spectrum = np.fft.fftshift(np.fft.fft2(x), axes=(-2, -1))
    row, col = spectrum.shape[-2] // 2, spectrum.shape[-1] // 2
    spectrum[..., row - 1:row + 1, col - 1:col + 1] *= scale
    return np.fft.ifft2(np.fft.ifftshift(spectrum, axes=(-2, -1))).real


def test_fourier_filter_scales_the_centred_low_frequencies():
    x = torch.randn(2, 3, 6, 8, generator=torch.Generator().manual_seed(0))
    expected = numpy_filter(x.double().numpy(), S2)
    np.testing.assert_allclose(fourier_filter(x, 1, S2).numpy(), expected, rtol=1e-4,
                               atol=1e-5)
    torch.testing.assert_close(fourier_filter(x, 1, 1.0), x, rtol=1e-5, atol=1e-5)


def test_freeu_v2_in_the_unet_is_comfyuis_patch_before_each_skip_concatenation():
    unet = random_unet(three_level_config(), seed=0)
    x = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    t, context = torch.tensor([500.0]), torch.randn(1, 77, 8, generator=torch.Generator().manual_seed(2))
    patched = with_freeu_v2(bundle(unet), B1, B2, S1, S2)
    with torch.no_grad():
        ours = patched.apply(x, t, context)
        plain = bundle(unet).apply(x, t, context)
        # by hand: the UNet's blocks in order, the numpy patch on (h, skip) before every concatenation
        emb = unet.time_embed(timestep_embedding(t, 32))
        h, skips = x, []
        for block in unet.input_blocks:
            h = block(h, emb, context)
            skips.append(h)
        h = unet.middle_block(h, emb, context)
        for block in unet.output_blocks:
            h_np, skip_np = numpy_freeu(h.double().numpy(), skips.pop().double().numpy(), 32)
            h = block(torch.cat([torch.from_numpy(h_np), torch.from_numpy(skip_np)], dim=1).float(), emb,
                      context)
        expected = unet.out(h)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ours, plain, atol=1e-3)
    assert patched.options["output_block_patches"] == (FreeUV2(32, B1, B2, S1, S2),)


def test_output_block_patches_see_each_blocks_features_and_skip_and_keep_the_state_keyed():
    unet = random_unet(three_level_config(), seed=0)
    seen = []

    def identity(h, skip):
        seen.append((h.shape[1], skip.shape[1], tuple(h.shape[-2:])))
        return h, skip

    x, t, context = torch.randn(1, 4, 16, 16), torch.tensor([10.0]), torch.randn(1, 77, 8)
    with torch.no_grad():
        assert torch.equal(unet(x, t, context, output_block_patches=(identity,)), unet(x, t, context))
    # the skips pop in reverse: each level's blocks, then the downsample below it
    assert seen == [(128, 128, (4, 4)), (128, 64, (4, 4)), (128, 64, (8, 8)), (64, 32, (8, 8)),
                    (64, 32, (16, 16)), (32, 32, (16, 16))]
    state = unet.initial_state(x, t, context, output_block_patches=(FreeUV2(32, 1.0, 1.0, 1.0, 1.0),))
    assert state["patch_signature"] == "(FreeUV2(model_channels=32, b1=1.0, b2=1.0, s1=1.0, s2=1.0),)"


def test_freeu_refuses_a_model_without_unet():
    model = bundle(random_unet(three_level_config(), 0))
    model.unet = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match="no UNet"):
        with_freeu_v2(model, B1, B2, S1, S2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_simple_is_ratio_times_model1_plus_the_rest_of_model2_per_weight(dtype):
    model1 = bundle(random_unet(three_level_config(), 0, dtype))
    model2 = bundle(random_unet(three_level_config(), 1, dtype))
    before = {name: p.clone() for name, p in model1.unet.named_parameters()}
    merged = merge_simple(model1, model2, 0.3)
    theirs = dict(model2.unet.named_parameters())
    for name, weight in merged.unet.named_parameters():
        by_hand = (before[name].double() * 0.3 + theirs[name].double() * 0.7).to(dtype)
        torch.testing.assert_close(weight, by_hand, rtol=1e-6 if dtype == torch.float32 else 1e-3, atol=1e-6)
    assert all(torch.equal(p, before[n]) for n, p in model1.unet.named_parameters())  # inputs untouched
    kept, replaced = merge_simple(model1, model2, 1.0), merge_simple(model1, model2, 0.0)
    assert all(torch.equal(p, before[n]) for n, p in kept.unet.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in replaced.unet.named_parameters())


def test_merge_simple_keeps_model1s_weights_where_shapes_differ(caplog):
    model1 = bundle(random_unet(three_level_config(8), 0))
    model2 = bundle(random_unet(three_level_config(16), 1))  # other cross-attention key / value widths
    merged = dict(merge_simple(model1, model2, 0.5).unet.named_parameters())
    mine, theirs = dict(model1.unet.named_parameters()), dict(model2.unet.named_parameters())
    key = "input_blocks.3.1.transformer_blocks.0.attn2.to_k.weight"
    assert torch.equal(merged[key], mine[key])
    other = "input_blocks.0.0.weight"
    torch.testing.assert_close(merged[other], 0.5 * mine[other] + 0.5 * theirs[other])
    assert "differ in shape" in caplog.text


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    yield
    clear_cache()


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters())


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    first, second = params(a), params(b)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_a_saved_sd_checkpoint_has_the_source_layout_and_loads_back_equal(tmp_path, family):
    source = tmp_path / "source.safetensors"
    written = write_checkpoint(source, family, "tiny")
    model, clip, vae = load_checkpoint(source)
    saved = write_safetensors(tmp_path / "saved.safetensors", checkpoint_tensors(model, clip, vae),
                              {"prompt": "{}"})
    tensors = safetensors.torch.load_file(str(saved))  # the safetensors library reads the file
    unused = {k for k in written if k.endswith(("position_ids", "logit_scale"))}
    assert set(tensors) == set(written) - unused
    assert all(torch.equal(tensors[k], written[k]) for k in tensors)
    with safetensors.safe_open(str(saved), "pt") as file:
        assert file.metadata() == {"prompt": "{}"}
    clear_cache()
    again = load_checkpoint(saved)
    assert again[0].family == family and again[1].kinds == clip.kinds
    for before, after in zip((model.unet, *clip.encoders, vae.autoencoder),
                             (again[0].unet, *again[1].encoders, again[2].autoencoder), strict=True):
        assert_same_parameters(before, after)


def test_a_v_prediction_model_is_saved_with_comfyuis_marker_and_loads_as_v_prediction(tmp_path):
    source = tmp_path / "source.safetensors"
    write_checkpoint(source, "sd2", "tiny")
    model, clip, vae = load_checkpoint(source)
    assert type(model.model_sampling) is EpsPrediction
    (v_model,) = ModelSamplingDiscrete().run(None, model, "v_prediction", False)
    tensors = checkpoint_tensors(v_model, clip, vae)
    assert tensors["v_pred"].shape == (0,) and "ztsnr" not in tensors
    saved = write_safetensors(tmp_path / "v.safetensors", tensors)
    clear_cache()
    assert isinstance(load_checkpoint(saved)[0].model_sampling, VPrediction)


def test_a_saved_flux_checkpoint_has_comfyuis_layout_and_loads_back_equal(tmp_path):
    files = write_flux_files(tmp_path / "models")
    model, clip, vae = load_checkpoint(files["checkpoint"])
    saved = write_safetensors(tmp_path / "flux.safetensors", checkpoint_tensors(model, clip, vae))
    with safetensors.safe_open(str(files["checkpoint"]), "pt") as file:
        source_keys = set(file.keys())
    # FLUX reads CLIP-L's pooled feature unprojected: the loader leaves the projection out, so does the file
    unused = {"text_encoders.clip_l.transformer.text_projection.weight"}
    assert set(safetensors.torch.load_file(str(saved))) == source_keys - unused
    clear_cache()
    again = load_checkpoint(saved)
    assert again[0].family == model.family
    for before, after in zip((model.unet, *clip.encoders, vae.autoencoder),
                             (again[0].unet, *again[1].encoders, again[2].autoencoder), strict=True):
        assert_same_parameters(before, after)


def test_a_vae_saved_alone_has_bare_keys_and_loads_back_equal(tmp_path):
    source = tmp_path / "source.safetensors"
    written = write_checkpoint(source, "sd1", "tiny")
    vae = load_vae(source)
    saved = write_safetensors(tmp_path / "vae.safetensors", vae_tensors(vae))
    tensors = safetensors.torch.load_file(str(saved))
    assert set(tensors) == {k.removeprefix("first_stage_model.") for k in written
                            if k.startswith("first_stage_model.")}
    clear_cache()
    assert_same_parameters(load_vae(saved).autoencoder, vae.autoencoder)
    with pytest.raises(FileExistsError):
        write_safetensors(saved, vae_tensors(vae))  # never overwrites


def test_saving_weights_the_runtime_keeps_off_the_model_or_mixed_families_is_a_clear_error(tmp_path):
    source = tmp_path / "source.safetensors"
    write_checkpoint(source, "sd1", "tiny")
    model, clip, vae = load_checkpoint(source)
    offloaded = bundle(UNetModel(model.unet.config, device="meta"))
    with pytest.raises(ValueError, match="params_backend device"):
        checkpoint_tensors(offloaded, clip, vae)
    other = tmp_path / "xl.safetensors"
    write_checkpoint(other, "sdxl", "tiny", components=("te",))
    clear_cache()
    xl_clip = load_checkpoint(other, components=("te",))[1]
    with pytest.raises(ValueError, match="one family"):
        checkpoint_tensors(model, xl_clip, vae)
