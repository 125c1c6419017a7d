"""The UNet's per-layer stages: small enough to segment finely, and bit-identical to the whole blocks.

The reference forward calls each TimestepEmbedSequential block as a whole (ResBlock.forward,
SpatialTransformer.forward, ... as LDM's openaimodel does), independently of the stage runners.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from engine.models.detect import UNetConfig
from engine.models.staged import run_stages
from engine.models.unet import UNetModel, Upsample, sd15_unet_config, sdxl_unet_config, timestep_embedding

MIB = 2**20
LARGEST_STAGE_LIMIT = 100 * MIB  # fp16 parameter bytes of the largest stage


def small_config(family: str, **fields) -> UNetConfig:
    base = dict(in_channels=4, out_channels=4, model_channels=32, channel_mult=(1, 2, 2), num_res_blocks=2,
                attention_levels=(0, 1), transformer_depth=(1, 1, 0), transformer_depth_middle=1, num_heads=2,
                num_head_channels=-1, context_dim=32, use_linear_in_transformer=False, adm_in_channels=None,
                num_classes=None, prediction="eps", family=family)
    return UNetConfig(**{**base, **fields})


SMALL_CONFIGS = {
    "sd15_like": small_config("sd15_like"),
    "sdxl_like": small_config("sdxl_like", num_res_blocks=1, attention_levels=(1, 2),
                              transformer_depth=(0, 1, 2), transformer_depth_middle=2, num_heads=-1,
                              num_head_channels=16, context_dim=64, use_linear_in_transformer=True,
                              adm_in_channels=48, num_classes="sequential"),
}


def random_model(config: UNetConfig, dtype: torch.dtype) -> UNetModel:
    """Deterministic random weights of a sensible scale (fan-in scaled matrices, norms near identity)."""
    model = UNetModel(config, dtype=dtype, device="cpu", attention_upcast=dtype != torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(noise / math.sqrt(param[0].numel()) if param.ndim > 1 else 1.0 + 0.1 * noise)
    return model


def whole_block_forward(model: UNetModel, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                        y: torch.Tensor | None) -> torch.Tensor:
    """LDM openaimodel's UNetModel.forward, one TimestepEmbedSequential block call per block."""
    emb = model.time_embed(timestep_embedding(timesteps, model.config.model_channels).to(model.dtype))
    if model.label_emb is not None:
        emb = emb + model.label_emb(y.to(model.dtype))
    h, context, hs = x.to(model.dtype), context.to(model.dtype), []
    for block in model.input_blocks:
        h = block(h, emb, context)
        hs.append(h)
    h = model.middle_block(h, emb, context)
    for block in model.output_blocks:
        h = torch.cat([h, hs.pop()], dim=1)
        h = block(h, emb, context, tuple(hs[-1].shape[-2:]) if hs else None)
    return model.out(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(SMALL_CONFIGS))
@pytest.mark.parametrize("size", [(16, 16), (13, 11)])  # odd sizes exercise the upsample size
def test_running_the_stages_is_bit_identical_to_calling_the_whole_blocks(case, size, dtype):
    config = SMALL_CONFIGS[case]
    model = random_model(config, dtype)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, config.in_channels, *size, generator=generator)
    timesteps = torch.tensor([17.0, 803.0])
    context = torch.randn(2, 7, config.context_dim, generator=generator)
    y = (None if config.adm_in_channels is None
         else torch.randn(2, config.adm_in_channels, generator=generator))
    with torch.no_grad():
        expected = whole_block_forward(model, x, timesteps, context, y)
        state = run_stages(model.stages(), model.initial_state(x, timesteps, context, y))
        forward = model(x, timesteps, context, y)
    assert torch.equal(state["h"], expected)
    assert torch.equal(forward, expected.to(x.dtype))
    assert sorted(state) == ["context", "emb", "h", "hs"] and state["hs"] == []


@pytest.mark.parametrize("config", [sd15_unet_config(), sdxl_unet_config()], ids=["sd15", "sdxl"])
def test_largest_full_size_stage_holds_under_100_mib_of_fp16_parameters(config):
    model = UNetModel(config, dtype=torch.float16)  # on meta
    sizes = {stage.name: stage.parameter_bytes() for stage in model.stages()}
    largest = max(sizes, key=sizes.get)
    print(f"{config.family}: {len(sizes)} stages, largest {largest} {sizes[largest] / MIB:.1f} MiB")
    assert sizes[largest] < LARGEST_STAGE_LIMIT
    assert sum(sizes.values()) == sum(p.numel() * 2 for p in model.parameters())


def test_only_temporaries_in_use_stay_in_the_state_between_stages():
    config = SMALL_CONFIGS["sdxl_like"]
    model = UNetModel(config)  # on meta
    state = model.initial_state(torch.zeros(1, 4, 8, 8, device="meta"), torch.zeros(1, device="meta"),
                                torch.zeros(1, 7, config.context_dim, device="meta"),
                                torch.zeros(1, config.adm_in_channels, device="meta"))
    upsamples = {f"output_blocks.{i}.{j}" for i, block in enumerate(model.output_blocks)
                 for j, layer in enumerate(block) if isinstance(layer, Upsample)}
    upsampling_blocks = {name.rsplit(".", 1)[0] for name in upsamples}
    allowed = {".in": {"x_in"}, ".proj_in": {"residual", "tokens"}, ".attn1": {"residual", "tokens"},
               ".attn2": {"residual", "tokens"}, ".ff.geglu": {"residual", "tokens", "ff_hidden"},
               ".ff.out": {"residual", "tokens"}}
    stages = model.stages()
    state = stages[0].run(state)  # embed
    upsample_pending = False
    for stage in stages[1:-1]:
        state = stage.run(state)
        block, layer = re.match(r"(\w+(?:\.\d+)?)\.(\d+)", stage.name).groups()
        upsample_pending = (upsample_pending or (block in upsampling_blocks and layer == "0")) \
            and stage.name not in upsamples
        assert ("upsample_size" in state) == upsample_pending, stage.name
        temporaries = set(state) - {"h", "emb", "context", "hs", "upsample_size"}
        suffix = next((s for s in allowed if stage.name.endswith(s)), None)
        assert temporaries == allowed.get(suffix, set()), stage.name
        assert ("h" in state) == ("tokens" not in state), stage.name  # tokens replace h while they live
    assert len(upsamples) == 2


def test_a_layer_without_a_stage_runner_is_named_in_the_error():
    model = UNetModel(SMALL_CONFIGS["sd15_like"])
    model.middle_block.append(nn.ReLU())
    with pytest.raises(TypeError, match=r"'middle_block.3' of type ReLU; accepted: ResBlock"):
        model.stages()


def test_feed_forward_in_token_chunks_equals_one_pass(monkeypatch):
    from engine.models import unet

    torch.manual_seed(0)
    ff = unet.FeedForward(64)
    x = torch.randn(2, 301, 64)  # 602 tokens: chunks of unequal size
    whole = ff.net(x)
    projection = 602 * ff.net[0].proj.out_features * 4
    monkeypatch.setattr(unet, "FF_CHUNK_BYTES", projection // 8)  # 8 chunks
    calls = []
    ff.net[0].register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    chunked = ff(x)
    assert len(calls) == 8 and sum(calls) == 602
    assert chunked.shape == whole.shape
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
