"""fp8 safetensors (issue 17, point 1): files stored in float8_e4m3fn or float8_e5m2 load (an SD1
checkpoint, a FLUX transformer, a T5-XXL encoder) with exactly the values of a float32 copy of the same
fp8-rounded tensors (fp8 to float32 is exact, so any difference is a loading or casting error), and compute
as that copy does. The FLUX transformer's linear weights rest in fp8 and are cast per call.

Outputs are compared within 1e-6, not bit for bit: the copy's parameters are views of the file's mapping at
unaligned addresses, and the CPU's matmul and convolution kernels sum in another order there (3e-8 apart
for equal weights)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.loader import clear_cache, load_checkpoint, load_diffusion_model, load_text_encoders
from tests.engine.models.flux_checkpoints import clip_l_state, flux_state, t5_state, tiny_flux_config
from tests.engine.models.sd_checkpoints import write_checkpoint

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def assert_same_values(ours: torch.nn.Module, copy: torch.nn.Module) -> None:
    """Every parameter and buffer of `ours` (fp8 ones widened) equals the copy's float32 one."""
    theirs = copy.state_dict()
    state = ours.state_dict()
    assert state.keys() == theirs.keys()
    for key, value in state.items():
        assert torch.equal(value.float(), theirs[key].float()), key


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def fp8_and_rounded_copy(state: dict[str, torch.Tensor], dtype: torch.dtype, folder, name: str) -> tuple:
    """(fp8 file, float32 file of the same fp8 values) of `state`'s floating tensors."""
    fp8 = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    rounded = {k: v.float() if v.is_floating_point() else v for k, v in fp8.items()}
    assert any(not torch.equal(rounded[k], state[k].float()) for k in state if state[k].is_floating_point())
    save_file(fp8, folder / f"{name}-fp8.safetensors")
    save_file(rounded, folder / f"{name}-rounded.safetensors")
    return folder / f"{name}-fp8.safetensors", folder / f"{name}-rounded.safetensors"


@pytest.fixture(autouse=True)
def no_cache():
    clear_cache()
    yield
    clear_cache()


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_an_fp8_sd1_checkpoint_computes_as_its_rounded_float32_copy(tmp_path, dtype):
    write_checkpoint(tmp_path / "sd1.safetensors", "sd1", size="tiny")
    fp8, rounded = fp8_and_rounded_copy(load_file(tmp_path / "sd1.safetensors"), dtype, tmp_path, "sd1")
    (model, clip, vae), (model_r, clip_r, vae_r) = load_checkpoint(fp8), load_checkpoint(rounded)
    assert_same_values(model.unet, model_r.unet)
    assert_same_values(vae.autoencoder, vae_r.autoencoder)
    for encoder, encoder_r in zip(clip.encoders, clip_r.encoders, strict=True):
        assert_same_values(encoder, encoder_r)
    context = clip.encode("a red cube")[0][0]
    assert_close(context, clip_r.encode("a red cube")[0][0])
    x, timestep = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([500.0])
    assert_close(model.apply(x, timestep, context), model_r.apply(x, timestep, context))
    assert_close(vae.decode(x), vae_r.decode(x))


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_an_fp8_flux_transformer_rests_in_fp8_and_computes_as_its_rounded_copy(tmp_path, dtype):
    fp8, rounded = fp8_and_rounded_copy(flux_state(), dtype, tmp_path, "flux")
    model, copy = load_diffusion_model(fp8), load_diffusion_model(rounded)
    linears = [m for m in model.unet.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and {m.weight.dtype for m in linears} == {dtype}
    assert_same_values(model.unet, copy.unet)
    generator = torch.Generator().manual_seed(7)
    config = tiny_flux_config(True)
    inputs = (torch.randn(1, 16, 6, 6, generator=generator), torch.tensor([0.7]),
              torch.randn(1, 12, config.context_in_dim, generator=generator),
              torch.randn(1, config.vec_in_dim, generator=generator), torch.tensor([3.5]))
    assert_close(model.apply(*inputs), copy.apply(*inputs))


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_an_fp8_t5_file_encodes_as_its_rounded_copy(tmp_path, dtype):
    fp8, rounded = fp8_and_rounded_copy(t5_state(), dtype, tmp_path, "t5xxl")
    save_file(clip_l_state(), tmp_path / "clip_l.safetensors")
    ours = load_text_encoders([tmp_path / "clip_l.safetensors", fp8], "flux")
    copy = load_text_encoders([tmp_path / "clip_l.safetensors", rounded], "flux")
    assert_same_values(ours.encoders[1], copy.encoders[1])
    assert_close(ours.encode("a red cube")[0][0], copy.encode("a red cube")[0][0])
