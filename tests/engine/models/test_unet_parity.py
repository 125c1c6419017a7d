"""engine.models.unet against diffusers' UNet2DConditionModel, loaded through diffusers' own LDM converter.

Each case gives the original LDM yaml `unet_config.params` (as in the Stability configs) and our
UNetConfig for the same network; diffusers derives its config from the yaml and its weights from our
state dict, so a wrong key, shape or layer shows up as a conversion failure or an output mismatch.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from diffusers import UNet2DConditionModel
from diffusers.loaders.single_file_utils import (
    convert_ldm_unet_checkpoint,
    create_unet_diffusers_config_from_ldm,
)
from diffusers.models.embeddings import get_timestep_embedding
from torch import nn
from torch.overrides import TorchFunctionMode

from engine.models.attention import attention
from engine.models.detect import UNetConfig
from engine.models.staged import run_stages
from engine.models.unet import (
    UNetModel,
    sd15_unet_config,
    sd21_unet_config,
    sdxl_refiner_unet_config,
    sdxl_unet_config,
    timestep_embedding,
)
from engine.models.weights import WeightBindingError, bind_weights

PREFIX = "model.diffusion_model."
PARITY_TOLERANCE = 1e-5  # relative L2 error in float32


def small_config(family: str, **fields) -> UNetConfig:
    base = dict(in_channels=4, out_channels=4, model_channels=32, channel_mult=(1, 2), num_res_blocks=1,
                attention_levels=(0, 1), transformer_depth=(1, 1), transformer_depth_middle=1, num_heads=2,
                num_head_channels=-1, context_dim=32, use_linear_in_transformer=False, adm_in_channels=None,
                num_classes=None, prediction="eps", family=family)
    return UNetConfig(**{**base, **fields})


# (our config, LDM yaml unet_config.params) per case; 2816 = 1280 pooled + 6 time ids x 256 (SDXL's ADM).
SMALL_CASES = {
    "sd1_like": (
        small_config("sd1_like", num_res_blocks=2),
        dict(in_channels=4, out_channels=4, model_channels=32, attention_resolutions=[1, 2], num_res_blocks=2,
             channel_mult=[1, 2], num_heads=2, transformer_depth=1, context_dim=32)),
    "sd2_like": (
        small_config("sd2_like", channel_mult=(1, 2, 2), attention_levels=(0, 1), transformer_depth=(1, 1, 0),
                     num_heads=-1, num_head_channels=16, use_linear_in_transformer=True, prediction="v"),
        dict(in_channels=4, out_channels=4, model_channels=32, attention_resolutions=[1, 2], num_res_blocks=1,
             channel_mult=[1, 2, 2], num_head_channels=16, use_linear_in_transformer=True,
             transformer_depth=1, context_dim=32)),
    "sdxl_like": (
        small_config("sdxl_like", channel_mult=(1, 2, 2), attention_levels=(1, 2),
                     transformer_depth=(0, 1, 2), transformer_depth_middle=2, num_heads=-1,
                     num_head_channels=16, context_dim=1280, use_linear_in_transformer=True,
                     adm_in_channels=32 + 6 * 256, num_classes="sequential"),
        dict(in_channels=4, out_channels=4, model_channels=32, attention_resolutions=[2, 4], num_res_blocks=1,
             channel_mult=[1, 2, 2], num_head_channels=16, use_linear_in_transformer=True,
             transformer_depth=[0, 1, 2], context_dim=1280, num_classes="sequential",
             adm_in_channels=32 + 6 * 256)),
}

# Transcribed from the Stability yaml files (v1-inference, v2-inference-v, sd_xl_base, sd_xl_refiner).
FULL_CASES = {
    "sd15": (sd15_unet_config(), dict(
        in_channels=4, out_channels=4, model_channels=320, attention_resolutions=[4, 2, 1], num_res_blocks=2,
        channel_mult=[1, 2, 4, 4], num_heads=8, transformer_depth=1, context_dim=768)),
    "sd21": (sd21_unet_config("v"), dict(
        in_channels=4, out_channels=4, model_channels=320, attention_resolutions=[4, 2, 1], num_res_blocks=2,
        channel_mult=[1, 2, 4, 4], num_head_channels=64, use_linear_in_transformer=True, transformer_depth=1,
        context_dim=1024)),
    "sdxl": (sdxl_unet_config(), dict(
        in_channels=4, out_channels=4, model_channels=320, attention_resolutions=[4, 2], num_res_blocks=2,
        channel_mult=[1, 2, 4], num_head_channels=64, use_linear_in_transformer=True,
        transformer_depth=[1, 2, 10], context_dim=2048, num_classes="sequential", adm_in_channels=2816)),
    "sdxl_refiner": (sdxl_refiner_unet_config(), dict(
        in_channels=4, out_channels=4, model_channels=384, attention_resolutions=[4, 2], num_res_blocks=2,
        channel_mult=[1, 2, 4, 4], num_head_channels=64, use_linear_in_transformer=True, transformer_depth=4,
        context_dim=1280, num_classes="sequential", adm_in_channels=2560)),
}


def diffusers_config(ldm_params: dict) -> dict:
    vae_params = {"ddconfig": {"ch_mult": [1, 2, 4, 4]}}
    original = {"model": {"params": {"unet_config": {"params": ldm_params},
                                     "first_stage_config": {"params": vae_params}}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # image_size is deprecated; it avoids type sniffing
        return create_unet_diffusers_config_from_ldm(original, {}, image_size=512)


def init_random_(module: nn.Module, seed: int) -> None:
    """Deterministic random weights of a sensible scale: fan-in scaled matrices, norms near identity."""
    generator = torch.Generator().manual_seed(seed)
    norms = {id(m.weight) for m in module.modules() if isinstance(m, nn.GroupNorm | nn.LayerNorm)}
    with torch.no_grad():
        for param in module.parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim > 1:
                param.copy_(noise / math.sqrt(param[0].numel()))
            else:
                param.copy_(noise * 0.1 + (1.0 if id(param) in norms else 0.0))


def relative_l2(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(ours - reference) / torch.linalg.vector_norm(reference)).item()


def prefixed_state_dict(model: UNetModel) -> dict[str, torch.Tensor]:
    return {PREFIX + key: value for key, value in model.state_dict().items()}


def ours_and_diffusers(case: str) -> tuple[UNetModel, UNet2DConditionModel]:
    config, ldm_params = SMALL_CASES[case]
    ours = UNetModel(config, device="cpu").eval()
    init_random_(ours, seed=sorted(SMALL_CASES).index(case))
    reference_config = diffusers_config(ldm_params)
    reference = UNet2DConditionModel(**reference_config).eval()
    converted = convert_ldm_unet_checkpoint(prefixed_state_dict(ours), reference_config)
    reference.load_state_dict(converted, strict=True)
    return ours, reference


def inputs(config: UNetConfig, size: tuple[int, int], seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, config.in_channels, *size, generator=generator)
    timesteps = torch.tensor([17.0, 803.0])
    context = torch.randn(2, 7, config.context_dim, generator=generator)
    return x, timesteps, context


@pytest.mark.parametrize(("case", "size"), [("sd1_like", (16, 16)), ("sd1_like", (13, 11)),
                                            ("sd2_like", (16, 16)), ("sd2_like", (10, 14))])
def test_unet_matches_diffusers_on_random_weights(case, size):
    ours, reference = ours_and_diffusers(case)
    x, timesteps, context = inputs(ours.config, size)
    with torch.no_grad():
        expected = reference(x, timesteps, encoder_hidden_states=context).sample
        got = ours(x, timesteps, context)
    error = relative_l2(got, expected)
    print(f"{case} {size}: relative L2 error {error:.2e}")
    assert got.shape == expected.shape
    assert error <= PARITY_TOLERANCE


def test_sdxl_unet_with_vector_condition_matches_diffusers_text_time_embedding():
    ours, reference = ours_and_diffusers("sdxl_like")
    x, timesteps, context = inputs(ours.config, (16, 16))
    generator = torch.Generator().manual_seed(1)
    pooled = torch.randn(2, 32, generator=generator)
    time_ids = torch.tensor([[1024.0, 1024.0, 0.0, 0.0, 1024.0, 1024.0],  # original size, crop, target size
                             [768.0, 1344.0, 32.0, 8.0, 768.0, 1344.0]])
    with torch.no_grad():
        expected = reference(x, timesteps, encoder_hidden_states=context,
                             added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample
        time_embeds = reference.add_time_proj(time_ids.flatten()).reshape(2, -1)  # (2, 6 * 256)
        y = torch.cat([pooled, time_embeds], dim=-1)  # (2, 1568)
        got = ours(x, timesteps, context, y)
    error = relative_l2(got, expected)
    print(f"sdxl_like: relative L2 error {error:.2e}")
    assert error <= PARITY_TOLERANCE


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float16, 1e-2), (torch.bfloat16, 5e-2)])
def test_half_precision_unet_with_attention_upcast_stays_close_to_float32(dtype, tolerance):
    ours, _ = ours_and_diffusers("sdxl_like")
    half = UNetModel(ours.config, dtype=dtype, device="cpu", attention_upcast=True)
    bind_weights(half, {key: value.to(dtype) for key, value in ours.state_dict().items()})
    x, timesteps, context = inputs(ours.config, (16, 16))
    y = torch.randn(2, ours.config.adm_in_channels, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = half(x, timesteps, context, y)
        expected = ours(x, timesteps, context, y)
    assert got.dtype == torch.float32  # the output follows the input's dtype
    assert relative_l2(got, expected) <= tolerance


def test_timestep_embedding_matches_diffusers_flip_sin_to_cos_without_shift():
    timesteps = torch.tensor([0.0, 1.0, 17.5, 999.0])
    for dim in (8, 320, 256):
        expected = get_timestep_embedding(timesteps, dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        torch.testing.assert_close(timestep_embedding(timesteps, dim), expected, rtol=1e-6, atol=1e-6)


def test_attention_equals_softmax_formula_and_upcast_keeps_fp16_dtype():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 3 * 8, generator=generator) for n in (5, 9, 9))
    heads_q, heads_k, heads_v = (t.reshape(2, -1, 3, 8).transpose(1, 2) for t in (q, k, v))  # (B, 3, L, 8)
    weights = torch.softmax(heads_q @ heads_k.transpose(-1, -2) / math.sqrt(8), dim=-1)
    expected = (weights @ heads_v).transpose(1, 2).reshape(2, 5, 24)
    torch.testing.assert_close(attention(q, k, v, heads=3), expected, rtol=1e-5, atol=1e-6)
    upcast = attention(q.half(), k.half(), v.half(), heads=3, upcast=True)
    assert upcast.dtype == torch.float16
    torch.testing.assert_close(upcast.float(), expected, rtol=2e-3, atol=2e-3)


def test_stages_in_order_reproduce_forward_bit_exactly():
    ours, _ = ours_and_diffusers("sdxl_like")
    x, timesteps, context = inputs(ours.config, (16, 16))
    y = torch.randn(2, ours.config.adm_in_channels)
    with torch.no_grad():
        direct = ours(x, timesteps, context, y)
        staged = run_stages(ours.stages(), ours.initial_state(x, timesteps, context, y))["h"]
    assert torch.equal(direct, staged)


class ParameterReads(TorchFunctionMode):
    """Records the ids of the tensors every torch function is called with (a parameter read is one)."""

    def __init__(self):
        super().__init__()
        self.ids: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pending = [*args, *kwargs.values()]
        while pending:
            value = pending.pop()
            if isinstance(value, torch.Tensor):
                self.ids.add(id(value))
            elif isinstance(value, list | tuple):
                pending.extend(value)
        return func(*args, **kwargs)


def resblock_and_transformer_stage_names(block: str, depth: int) -> list[str]:
    """The stage names of a block whose layer 0 is a ResBlock and layer 1 a transformer of `depth`."""
    parts = ("attn1", "attn2", "ff.geglu", "ff.out")
    return ([f"{block}.0.in", f"{block}.0.out", f"{block}.1.proj_in"]
            + [f"{block}.1.transformer_blocks.{d}.{part}" for d in range(depth) for part in parts]
            + [f"{block}.1.proj_out"])


# Stage counts by hand from the LDM layouts: a conv / Downsample / Upsample is 1 stage, a ResBlock 2,
# a SpatialTransformer of depth d is 2 + 4 d. SD1.5: input 56, middle 10, output 81; SDXL: 119, 46, 176.
@pytest.mark.parametrize(("config", "input_blocks", "stage_count"),
                         [(sd15_unet_config(), 12, 1 + 56 + 10 + 81 + 1),
                          (sdxl_unet_config(), 9, 1 + 119 + 46 + 176 + 1)])
def test_every_parameter_belongs_to_exactly_one_stage_and_stages_follow_ldm_order(config, input_blocks,
                                                                                   stage_count):
    model = UNetModel(config)
    stages = model.stages()
    names = [stage.name for stage in stages]
    assert len(names) == len(set(names)) == stage_count
    block_prefixes = (["embed"] + [f"input_blocks.{i}" for i in range(input_blocks)] + ["middle_block"]
                      + [f"output_blocks.{i}" for i in range(input_blocks)] + ["out"])
    prefix_of_name = [re.match(r"embed|out$|input_blocks\.\d+|middle_block|output_blocks\.\d+", n).group()
                      for n in names]
    assert list(dict.fromkeys(prefix_of_name)) == block_prefixes  # each block's stages together, in LDM order
    assert names[:3] == ["embed", "input_blocks.0.0", "input_blocks.1.0.in"]
    if config.family == "sdxl":
        middle = [n for n in names if n.startswith("middle_block.")]
        assert middle == (resblock_and_transformer_stage_names("middle_block", 10)
                          + ["middle_block.2.in", "middle_block.2.out"])
        assert [n for n in names if n.startswith("input_blocks.4.")] == (
            resblock_and_transformer_stage_names("input_blocks.4", 2))
        assert "output_blocks.2.2" in names and "output_blocks.5.2" in names  # the two Upsamples
    else:
        assert [n for n in names if n.startswith("output_blocks.2.")] == [
            "output_blocks.2.0.in", "output_blocks.2.0.out", "output_blocks.2.1"]  # ResBlock, Upsample
        assert names[-2:] == ["output_blocks.11.1.proj_out", "out"]
    owners: dict[int, int] = {}
    for stage in stages:
        for param in stage.parameters():
            owners[id(param)] = owners.get(id(param), 0) + 1
    assert set(owners) == {id(p) for p in model.parameters()}
    assert set(owners.values()) == {1}
    embed = stages[0]
    assert set(embed.modules) == ({model.time_embed} | ({model.label_emb} if model.label_emb else set()))


@pytest.mark.parametrize("config", [sd15_unet_config(), sdxl_unet_config()], ids=["sd15", "sdxl"])
def test_each_stage_reads_exactly_the_parameters_of_its_modules_on_meta(config):
    model = UNetModel(config)  # on meta: the full-size graph runs without memory or compute
    y = None if config.adm_in_channels is None else torch.zeros(1, config.adm_in_channels, device="meta")
    state = model.initial_state(torch.zeros(1, 4, 16, 16, device="meta"), torch.zeros(1, device="meta"),
                                torch.zeros(1, 77, config.context_dim, device="meta"), y)
    parameter_ids = {id(p) for p in model.parameters()}
    with torch.no_grad():
        for stage in model.stages():
            with ParameterReads() as reads:
                state = stage.run(state)
            assert reads.ids & parameter_ids == {id(p) for p in stage.parameters()}, stage.name
    assert tuple(state["h"].shape) == (1, config.out_channels, 16, 16)
    assert sorted(state) == ["context", "emb", "h", "hs"] and state["hs"] == []  # no temporary key left


@pytest.mark.parametrize("case", sorted(FULL_CASES))
def test_full_size_keys_and_shapes_are_the_single_file_checkpoint_keys(case):
    config, ldm_params = FULL_CASES[case]
    ours = UNetModel(config)
    assert all(p.is_meta for p in ours.parameters())
    reference_config = diffusers_config(ldm_params)
    converted = convert_ldm_unet_checkpoint(prefixed_state_dict(ours), reference_config)
    with torch.device("meta"):
        reference = UNet2DConditionModel(**reference_config)
    reference_shapes = {key: tuple(value.shape) for key, value in reference.state_dict().items()}
    assert {key: tuple(value.shape) for key, value in converted.items()} == reference_shapes
    assert len(converted) == len(ours.state_dict())  # the conversion dropped nothing
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in reference.parameters())


def test_full_size_parameter_counts_match_published_sd15_and_sdxl():
    assert sum(p.numel() for p in UNetModel(sd15_unet_config()).parameters()) == 859_520_964
    assert sum(p.numel() for p in UNetModel(sdxl_unet_config()).parameters()) == 2_567_463_684


def test_bind_weights_assigns_tensors_without_copying_and_matches_the_source_model():
    source, _ = ours_and_diffusers("sd1_like")
    tensors = source.state_dict()
    target = UNetModel(source.config)  # on meta
    bind_weights(target, tensors)
    assert target.out[2].weight.data_ptr() == tensors["out.2.weight"].data_ptr()
    x, timesteps, context = inputs(source.config, (8, 8))
    with torch.no_grad():
        assert torch.equal(target(x, timesteps, context), source(x, timesteps, context))


def test_bind_weights_reports_missing_unexpected_and_misshapen_keys():
    model = UNetModel(SMALL_CASES["sd1_like"][0])
    tensors = {key: torch.zeros(value.shape) for key, value in model.state_dict().items()}
    del tensors["time_embed.0.weight"]
    tensors["label_emb.0.0.weight"] = torch.zeros(1)
    tensors["out.2.bias"] = torch.zeros(5)
    with pytest.raises(WeightBindingError) as caught:
        bind_weights(model, tensors)
    message = str(caught.value)
    assert "1 missing key(s): time_embed.0.weight" in message
    assert "1 unexpected key(s): label_emb.0.0.weight" in message
    assert "out.2.bias (expected (4,), got (5,))" in message
    assert all(p.is_meta for p in model.parameters())  # nothing was bound


def test_bind_weights_lists_the_first_ten_missing_keys_and_counts_the_rest():
    model = UNetModel(SMALL_CASES["sd1_like"][0])
    count = len(model.state_dict())
    with pytest.raises(WeightBindingError, match=rf"{count} missing key\(s\): .*\({count - 10} more\)"):
        bind_weights(model, {})


def test_unet_rejects_a_missing_vector_condition_and_ambiguous_heads():
    model = UNetModel(sdxl_unet_config())
    with pytest.raises(ValueError, match="takes y of width 2816; got none"):
        model.initial_state(torch.zeros(1, 4, 8, 8, device="meta"), torch.zeros(1), torch.zeros(1, 77, 2048))
    with pytest.raises(ValueError, match="exactly one of num_heads"):
        UNetModel(small_config("bad", num_heads=2, num_head_channels=16))
    with pytest.raises(ValueError, match="unknown prediction 'x0'"):
        sd21_unet_config("x0")
