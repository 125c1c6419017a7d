"""KL-f8 VAE vs diffusers' AutoencoderKL on random weights converted by diffusers' own LDM converter."""

from __future__ import annotations

import logging

import pytest
import torch
from diffusers import AutoencoderKL as DiffusersAutoencoderKL
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

from engine.models.detect import VAEConfig
from engine.models.staged import run_stages
from engine.models.vae import AutoencoderKL
from engine.models.weights import bind_weights

SD_SCALE = 0.18215
TOLERANCE = 1e-5  # relative L2 error in float32


def _config(**overrides) -> VAEConfig:
    fields = dict(in_channels=3, out_ch=3, z_channels=4, embed_dim=4, ch=32, ch_mult=(1, 2, 2),
                  num_res_blocks=1, resolution=64, attn_resolutions=(), scale_factor=SD_SCALE,
                  shift_factor=0.0)
    fields.update(overrides)
    return VAEConfig(**fields)


def _diffusers_config(cfg: VAEConfig) -> dict:
    levels = len(cfg.ch_mult)
    return dict(in_channels=cfg.in_channels, out_channels=cfg.out_ch, latent_channels=cfg.z_channels,
                down_block_types=("DownEncoderBlock2D",) * levels,
                up_block_types=("UpDecoderBlock2D",) * levels,
                block_out_channels=tuple(cfg.ch * m for m in cfg.ch_mult),
                layers_per_block=cfg.num_res_blocks, norm_num_groups=32, sample_size=cfg.resolution,
                scaling_factor=cfg.scale_factor)


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # GroupNorm affine: away from the identity so it is checked too
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=generator))
            else:
                p.add_(0.02 * torch.randn(p.shape, generator=generator))


@pytest.fixture(scope="module")
def pair() -> tuple[AutoencoderKL, DiffusersAutoencoderKL]:
    torch.manual_seed(0)
    cfg = _config()
    ours = AutoencoderKL(cfg, device="cpu").eval()
    _randomize(ours, seed=1)
    reference = DiffusersAutoencoderKL(**_diffusers_config(cfg)).eval()
    checkpoint = {f"first_stage_model.{k}": v for k, v in ours.state_dict().items()}
    reference.load_state_dict(convert_ldm_vae_checkpoint(checkpoint, reference.config), strict=True)
    return ours, reference


def test_encode_mean_matches_diffusers(pair):
    ours, reference = pair
    pixels = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        expected = reference.encode(pixels).latent_dist.mean * SD_SCALE
    latent = ours.encode(pixels)
    assert latent.shape == (2, 4, 16, 12)
    error = _relative_error(latent, expected)
    print(f"encode mean relative L2 error {error:.2e}")
    assert error <= TOLERANCE


def test_encode_sample_matches_diffusers_with_the_same_generator(pair):
    ours, reference = pair
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        expected = reference.encode(pixels).latent_dist.sample(torch.Generator().manual_seed(4)) * SD_SCALE
    latent = ours.encode(pixels, sample=True, generator=torch.Generator().manual_seed(4))
    assert _relative_error(latent, expected) <= TOLERANCE
    assert _relative_error(latent, ours.encode(pixels)) > 1e-3  # the sample is not the mean


def test_decode_matches_diffusers(pair):
    ours, reference = pair
    latent = torch.randn(2, 4, 12, 10, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = reference.decode(latent / SD_SCALE).sample
    pixels = ours.decode(latent)
    assert pixels.shape == (2, 3, 48, 40)
    error = _relative_error(pixels, expected)
    print(f"decode relative L2 error {error:.2e}")
    assert error <= TOLERANCE


def test_shift_factor_is_applied_on_encode_and_undone_on_decode():
    cfg = _config(scale_factor=0.5, shift_factor=0.25)
    torch.manual_seed(6)
    shifted = AutoencoderKL(cfg, device="cpu")
    plain = AutoencoderKL(_config(scale_factor=1.0), device="cpu")
    plain.load_state_dict(shifted.state_dict())
    pixels = torch.rand(1, 3, 32, 32) * 2 - 1
    torch.testing.assert_close(shifted.encode(pixels), (plain.encode(pixels) - 0.25) * 0.5)
    latent = torch.randn(1, 4, 8, 8)
    torch.testing.assert_close(shifted.decode(latent), plain.decode(latent / 0.5 + 0.25))


def test_stages_run_in_order_equal_decode_and_cover_every_parameter_once(pair):
    ours, _ = pair
    assert [s.name for s in ours.stages()] == [
        "decoder.conv_in", "decoder.mid", "decoder.up.2", "decoder.up.1", "decoder.up.0", "decoder.out"]
    assert [s.name for s in ours.encoder_stages()] == [
        "encoder.conv_in", "encoder.down.0", "encoder.down.1", "encoder.down.2", "encoder.mid", "encoder.out"]
    latent = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        staged = run_stages(ours.stages(), {"latent": latent})["pixels"]
    torch.testing.assert_close(staged, ours.decode(latent), rtol=0, atol=0)
    owned = [id(p) for stage in ours.encoder_stages() + ours.decoder_stages() for p in stage.parameters()]
    assert sorted(owned) == sorted(id(p) for p in ours.parameters())


def test_meta_model_binds_ldm_checkpoint_tensors_by_name_without_copying(pair):
    ours, _ = pair
    checkpoint = {k: v.clone() for k, v in ours.state_dict().items()}
    bound = AutoencoderKL(ours.config)
    bind_weights(bound, checkpoint)
    assert bound.decoder.conv_out.weight.data_ptr() == checkpoint["decoder.conv_out.weight"].data_ptr()
    latent = torch.randn(1, 4, 8, 8)
    torch.testing.assert_close(bound.decode(latent), ours.decode(latent), rtol=0, atol=0)


def test_attention_levels_when_attn_resolutions_is_set():
    model = AutoencoderKL(_config(attn_resolutions=(16,)), device="meta")
    names = {name for name, _ in model.named_parameters()}
    assert "encoder.down.2.attn.0.q.weight" in names  # 64 -> 32 -> 16: level 2 attends
    assert "decoder.up.2.attn.1.proj_out.weight" in names
    assert not any(name.startswith("encoder.down.0.attn") for name in names)


def test_float16_decode_that_overflows_retries_in_float32_and_warns(pair, caplog, monkeypatch):
    ours, _ = pair
    reference = AutoencoderKL(ours.config, device="cpu")
    reference.load_state_dict({k: v.half().float() for k, v in ours.state_dict().items()})
    half = AutoencoderKL(ours.config, device="cpu", dtype=torch.float16)
    half.load_state_dict(ours.state_dict())
    mid_block = half.decoder.mid.block_1
    original_forward = mid_block.forward

    def overflowing_forward(h: torch.Tensor) -> torch.Tensor:
        return original_forward(h) * 1e6 / 1e6  # overflows to inf in float16, a no-op in float32

    monkeypatch.setattr(mid_block, "forward", overflowing_forward)
    latent = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(7))
    with caplog.at_level(logging.WARNING, logger="sluice.vae"):
        pixels = half.decode(latent)
    assert "float32" in caplog.text and "NaN/inf" in caplog.text
    assert torch.isfinite(pixels).all() and pixels.dtype == torch.float32
    assert _relative_error(pixels, reference.decode(latent)) <= TOLERANCE
    assert half.decoder.conv_in.weight.dtype == torch.float16  # the model itself is left in float16


def test_bfloat16_decode_is_close_to_float32(pair):
    ours, _ = pair
    low = AutoencoderKL(ours.config, device="cpu", dtype=torch.bfloat16)
    low.load_state_dict(ours.state_dict())
    latent = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(8))
    assert _relative_error(low.decode(latent), ours.decode(latent)) < 5e-2


def test_bad_shapes_are_rejected_with_the_accepted_shape(pair):
    ours, _ = pair
    with pytest.raises(ValueError, match=r"\(B, 4, h, w\)"):
        ours.decode(torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        ours.encode(torch.zeros(3, 32, 32))


SD_VAE_PARAMETERS = 83_653_863


def test_full_size_sd_vae_on_meta_matches_diffusers_parameter_count_and_keys():
    cfg = _config(ch=128, ch_mult=(1, 2, 4, 4), num_res_blocks=2, resolution=256)
    ours = AutoencoderKL(cfg)  # meta by default
    assert all(p.is_meta for p in ours.parameters())
    with torch.device("meta"):
        reference = DiffusersAutoencoderKL(**_diffusers_config(cfg))
    ours_count = sum(p.numel() for p in ours.parameters())
    assert ours_count == sum(p.numel() for p in reference.parameters()) == SD_VAE_PARAMETERS
    checkpoint = {f"first_stage_model.{k}": v for k, v in ours.state_dict().items()}
    converted = convert_ldm_vae_checkpoint(checkpoint, reference.config)
    assert set(converted) == set(reference.state_dict())
    assert all(converted[k].shape == v.shape for k, v in reference.state_dict().items())


FLUX_SCALE, FLUX_SHIFT = 0.3611, 0.1159
FLUX_VAE_PARAMETERS = 83_819_683  # diffusers' AutoencoderKL with FLUX.1's released config


def _flux_config(**overrides) -> VAEConfig:
    return _config(z_channels=16, embed_dim=16, scale_factor=FLUX_SCALE, shift_factor=FLUX_SHIFT,
                   use_quant_conv=False, **overrides)


def _flux_diffusers_config(cfg: VAEConfig) -> dict:
    return _diffusers_config(cfg) | dict(shift_factor=cfg.shift_factor, use_quant_conv=False,
                                         use_post_quant_conv=False)


def test_flux_vae_matches_diffusers_without_quant_convs():
    torch.manual_seed(0)
    cfg = _flux_config()
    ours = AutoencoderKL(cfg, device="cpu").eval()
    _randomize(ours, seed=6)
    assert not any("quant_conv" in name for name, _ in ours.named_parameters())
    reference = DiffusersAutoencoderKL(**_flux_diffusers_config(cfg)).eval()
    checkpoint = {f"first_stage_model.{k}": v for k, v in ours.state_dict().items()}
    reference.load_state_dict(convert_ldm_vae_checkpoint(checkpoint, reference.config), strict=True)
    pixels = torch.rand(1, 3, 32, 40, generator=torch.Generator().manual_seed(7)) * 2 - 1
    latent = torch.randn(1, 16, 6, 5, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected_latent = (reference.encode(pixels).latent_dist.mean - FLUX_SHIFT) * FLUX_SCALE
        expected_pixels = reference.decode(latent / FLUX_SCALE + FLUX_SHIFT).sample
    assert _relative_error(ours.encode(pixels), expected_latent) <= TOLERANCE
    assert _relative_error(ours.decode(latent), expected_pixels) <= TOLERANCE


def test_full_size_flux_vae_on_meta_has_the_released_parameter_count():
    cfg = _flux_config(ch=128, ch_mult=(1, 2, 4, 4), num_res_blocks=2, resolution=256)
    ours = AutoencoderKL(cfg)
    with torch.device("meta"):
        reference = DiffusersAutoencoderKL(**_flux_diffusers_config(cfg))
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in reference.parameters())
    assert sum(p.numel() for p in ours.parameters()) == FLUX_VAE_PARAMETERS
