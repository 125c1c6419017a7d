"""FLUX.1 files: detection, loading in every layout users have, the text encoder, and bad files."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from engine.models.clip import CLIPTextModel
from engine.models.conditioning import BOS_ID, EOS_ID
from engine.models.detect import UnsupportedModelError, detect
from engine.models.flux import FluxTransformer
from engine.models.flux_bundles import FluxDiffusionModel, FluxTextEncoder
from engine.models.formats import CheckpointError, open_checkpoint
from engine.models.loader import (
    clear_cache,
    load_checkpoint,
    load_diffusion_model,
    load_text_encoders,
    load_vae,
)
from engine.models.weights import bind_weights
from engine.sampling.model_sampling import FlowMatching, FluxFlowMatching
from tests.engine.models.flux_checkpoints import (
    CHECKPOINT_PREFIXES,
    T5_WIDTH,
    clip_l_state,
    flux_state,
    prefixed,
    t5_state,
    tiny_flux_config,
    write_flux_files,
)


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    yield
    clear_cache()


def _inputs(dev: bool = True) -> tuple:
    generator = torch.Generator().manual_seed(7)
    config = tiny_flux_config(dev)
    x = torch.randn(1, 16, 6, 6, generator=generator)
    context = torch.randn(1, 12, config.context_in_dim, generator=generator)
    y = torch.randn(1, config.vec_in_dim, generator=generator)
    return x, torch.tensor([0.7]), context, y, torch.tensor([3.5]) if dev else None


def _reference_output(state: dict[str, torch.Tensor], dev: bool = True) -> torch.Tensor:
    model = FluxTransformer(tiny_flux_config(dev), device="meta")
    bind_weights(model, dict(state))
    return model(*_inputs(dev))


@pytest.mark.parametrize("dev", [True, False])
def test_flux_file_is_detected_as_its_variant_with_its_parameter_count(tmp_path, dev):
    files = write_flux_files(tmp_path, dev)
    with open_checkpoint(files["diffusion"]) as reader:
        info = detect(reader)
    assert info.family == ("flux_dev" if dev else "flux_schnell")
    assert info.flux == tiny_flux_config(dev) and info.flux_layout == "bfl"
    expected = sum(t.numel() for t in flux_state(dev).values())
    assert info.stats["diffusion"].parameters == expected and info.unassigned.tensors == 0


def test_full_checkpoint_components_are_found_under_comfyui_prefixes(tmp_path):
    files = write_flux_files(tmp_path)
    with open_checkpoint(files["checkpoint"]) as reader:
        info = detect(reader)
    assert info.family == "flux_dev"
    assert info.components == {"diffusion": CHECKPOINT_PREFIXES["diffusion"], "te": "text_encoders.",
                               "vae": CHECKPOINT_PREFIXES["vae"]}
    assert info.t5_prefix == CHECKPOINT_PREFIXES["t5"] and info.t5.d_model == T5_WIDTH
    assert [t.kind for t in info.text_encoders] == ["clip_l"]
    assert (info.vae.z_channels, info.vae.scale_factor, info.vae.shift_factor) == (16, 0.3611, 0.1159)
    assert info.unassigned.tensors == 0


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_unet_loader_path_gives_the_transformer_of_the_file(tmp_path, prefix):
    state = flux_state()
    path = tmp_path / "flux.safetensors"
    save_file(prefixed(state, prefix), str(path))
    model = load_diffusion_model(path)
    assert isinstance(model, FluxDiffusionModel) and model.latent_channels == 16
    assert isinstance(model.model_sampling, FluxFlowMatching) and model.model_sampling.shift == 1.15
    out = model.apply(*_inputs())
    torch.testing.assert_close(out, _reference_output(state), rtol=1e-5, atol=1e-6)


def test_schnell_file_loads_with_unshifted_flow_sampling(tmp_path):
    files = write_flux_files(tmp_path, dev=False)
    model = load_diffusion_model(files["diffusion"])
    assert not model.has_guidance
    assert isinstance(model.model_sampling, FlowMatching) and model.model_sampling.shift == 1.0
    assert float(model.model_sampling.timestep(torch.tensor(0.5))) == pytest.approx(0.5)


def test_diffusers_layout_transformer_loads_to_the_same_model(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    config = tiny_flux_config()
    torch.manual_seed(0)
    reference = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=64, out_channels=64, num_layers=config.depth,
        num_single_layers=config.depth_single_blocks, attention_head_dim=config.head_dim,
        num_attention_heads=config.num_heads, joint_attention_dim=config.context_in_dim,
        pooled_projection_dim=config.vec_in_dim, guidance_embeds=True, axes_dims_rope=config.axes_dim).eval()
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    with open_checkpoint(path) as reader:
        info = detect(reader)
    assert info.family == "flux_dev" and info.flux_layout == "diffusers" and info.flux == config
    model = load_diffusion_model(path)
    x, t, context, y, guidance = _inputs()
    ours = model.apply(x, t, context, y, guidance)
    b, c, h, w = x.shape
    tokens = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)
    img_ids = torch.zeros(h // 2, w // 2, 3)
    img_ids[..., 1] += torch.arange(h // 2)[:, None]
    img_ids[..., 2] += torch.arange(w // 2)[None, :]
    with torch.no_grad():
        theirs = reference(hidden_states=tokens, encoder_hidden_states=context, pooled_projections=y,
                           timestep=t, img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(context.shape[1],
                                                                                           3),
                           guidance=guidance).sample
    theirs = theirs.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
    error = (ours - theirs).norm() / theirs.norm()
    assert error <= 1e-5, f"relative L2 {error:.2e}"


def test_all_in_one_checkpoint_gives_model_clip_and_vae(tmp_path):
    files = write_flux_files(tmp_path)
    model, clip, vae = load_checkpoint(files["checkpoint"])
    assert isinstance(model, FluxDiffusionModel) and isinstance(clip, FluxTextEncoder)
    assert vae.latent_channels == 16
    conditioning = clip.encode("a red cube on a table")
    context, extras = conditioning[0]
    assert context.shape == (1, 256, T5_WIDTH) and extras["pooled_output"].shape == (1, 32)
    image = vae.decode(torch.randn(1, 16, 4, 4))
    assert image.shape == (1, 32, 32, 3)


def test_dual_clip_loader_files_give_the_same_encoder_as_the_checkpoint(tmp_path):
    files = write_flux_files(tmp_path)
    split = load_text_encoders([files["clip_l"], files["t5"]], "flux", dtype="fp32")
    _, whole, _ = load_checkpoint(files["checkpoint"])
    for clip in (split, whole):
        assert isinstance(clip, FluxTextEncoder)
    a, b = split.encode("(a cat:1.2) in a hat")[0], whole.encode("(a cat:1.2) in a hat")[0]
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1]["pooled_output"], b[1]["pooled_output"])


def test_clip_l_pooled_feature_is_the_unprojected_end_of_text_feature(tmp_path):
    files = write_flux_files(tmp_path)
    clip = load_text_encoders([files["clip_l"], files["t5"]], "flux")
    pooled = clip.encode("")[0][1]["pooled_output"]
    config = clip.encoders[0].config
    assert config.projection_dim is None
    plain = CLIPTextModel(config, device="meta")
    state = clip_l_state()
    bind_weights(plain, {k: v for k, v in state.items() if k.startswith("text_model.")})
    tokens = torch.tensor([[BOS_ID] + [EOS_ID] * 76])  # the empty prompt, padded with end-of-text
    _, expected = plain(tokens, return_pooled=True)
    torch.testing.assert_close(pooled, expected)
    projected = expected @ state["text_projection.weight"].T
    assert not torch.allclose(pooled, projected)


def test_encode_flux_sets_the_guidance_and_reads_each_prompt_with_its_encoder(tmp_path):
    files = write_flux_files(tmp_path)
    clip = load_text_encoders([files["clip_l"], files["t5"]], "flux")
    same = clip.encode_flux("a dog", "a dog", 2.5)[0]
    other = clip.encode_flux("a dog", "a cat", 2.5)[0]
    assert same[1]["guidance"] == 2.5
    torch.testing.assert_close(same[1]["pooled_output"], other[1]["pooled_output"])
    assert not torch.equal(same[0], other[0])


def test_flux_vae_file_loads_with_sixteen_channels(tmp_path):
    files = write_flux_files(tmp_path)
    vae = load_vae(files["vae"])
    assert vae.latent_channels == 16 and vae.downscale == 8
    latent = vae.encode(torch.rand(1, 16, 24, 3))
    assert latent.shape == (1, 16, 2, 3)


# ---------------------------------------------------------------- bad files


def test_truncated_flux_file_names_the_file(tmp_path):
    files = write_flux_files(tmp_path)
    data = files["diffusion"].read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cut.safetensors"):
        load_diffusion_model(cut)


def test_flux_file_with_a_missing_block_names_the_block(tmp_path):
    state = {k: v for k, v in flux_state().items() if not k.startswith("single_blocks.0.")}
    path = tmp_path / "holed.safetensors"
    save_file(state, str(path))
    with pytest.raises(UnsupportedModelError, match=r"holed.safetensors.*single_blocks\.0"):
        load_diffusion_model(path)


def test_t5_file_given_as_the_diffusion_model_says_what_it_is(tmp_path):
    files = write_flux_files(tmp_path)
    with pytest.raises(ValueError, match=r"t5xxl_fp16.safetensors.*T5-XXL text encoder.*DualCLIPLoader"):
        load_diffusion_model(files["t5"])


def test_flux_text_encoder_needs_clip_l_and_t5(tmp_path):
    files = write_flux_files(tmp_path)
    with pytest.raises(ValueError, match="one CLIP-L and one T5-XXL"):
        load_text_encoders([files["clip_l"], files["clip_l"]], "flux")
    t5_only = tmp_path / "t5b.safetensors"
    save_file(t5_state(), str(t5_only))
    with pytest.raises(ValueError, match="one CLIP-L and one T5-XXL"):
        load_text_encoders([files["t5"], t5_only], "flux")


def test_fp8_transformer_file_stays_fp8_and_computes_upcast(tmp_path):
    state = flux_state()
    path = tmp_path / "flux-fp8.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in state.items()}, str(path))
    model = load_diffusion_model(path)
    linears = [m for m in model.unet.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    assert model.unet.double_blocks[0].img_attn.norm.query_norm.scale.dtype == torch.float32
    rounded = {k: v.to(torch.float8_e4m3fn).float() for k, v in state.items()}
    torch.testing.assert_close(model.apply(*_inputs()), _reference_output(rounded), rtol=1e-5, atol=1e-6)


def test_fp8_weight_dtype_stores_a_wide_file_in_fp8(tmp_path):
    files = write_flux_files(tmp_path)
    model = load_diffusion_model(files["diffusion"], "fp8_e4m3fn")
    assert model.unet.img_in.weight.dtype == torch.float8_e4m3fn and model.dtype == torch.float32
    rounded = {k: v if k.endswith(".scale") else v.to(torch.float8_e4m3fn).float()  # norms stay wide
               for k, v in flux_state().items()}
    torch.testing.assert_close(model.apply(*_inputs()), _reference_output(rounded), rtol=1e-5, atol=1e-6)
