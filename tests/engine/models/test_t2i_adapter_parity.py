"""engine.models.t2i_adapter against diffusers' T2IAdapter (full, full XL, light) loaded through our
diffusers_names map, and the UNet with the adapter's features against diffusers' UNet2DConditionModel with
down_intrablock_additional_residuals, on tiny random configs in float32."""

from __future__ import annotations

import pytest
import torch
from diffusers import T2IAdapter, UNet2DConditionModel

from engine.models.t2i_adapter import (
    T2IAdapterConfig,
    T2IAdapterModel,
    average_pool,
    diffusers_names,
    is_t2i_adapter,
    t2i_adapter_config,
)
from engine.models.unet import UNetModel
from engine.models.weights import bind_weights
from tests.engine.models.control_checkpoints import init_random_, relative_l2, unet_config
from tests.engine.models.test_controlnet_parity import unet_to_diffusers

PARITY_TOLERANCE = 1e-5  # relative L2 error in float32

# kind -> diffusers T2IAdapter keywords
ADAPTERS = {
    "full": dict(in_channels=3, channels=[32, 32, 64, 64], num_res_blocks=2, downscale_factor=8,
                 adapter_type="full_adapter"),
    "full_xl": dict(in_channels=3, channels=[32, 64, 64, 64], num_res_blocks=2, downscale_factor=16,
                    adapter_type="full_adapter_xl"),
    "light": dict(in_channels=1, channels=[32, 32, 64], num_res_blocks=3, downscale_factor=8,
                  adapter_type="light_adapter"),
}
# The UNets the adapters fit: SD1-like (four levels of two ResBlocks, attention on the first three) and
# SDXL-like (three levels of two ResBlocks, attention on the last two), with their diffusers keywords.
UNETS = {
    "sd1": (unet_config(channel_mult=(1, 1, 2, 2), num_res_blocks=2, attention_levels=(0, 1, 2),
                        transformer_depth=(1, 1, 1, 0)),
            dict(down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                 up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
                 block_out_channels=(32, 32, 64, 64),
                 layers_per_block=2, cross_attention_dim=32, attention_head_dim=8)),
    "sdxl": (unet_config(channel_mult=(1, 2, 2), num_res_blocks=2, attention_levels=(1, 2),
                         transformer_depth=(0, 1, 1), family="sdxl"),
             dict(down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * 2,
                  up_block_types=("CrossAttnUpBlock2D",) * 2 + ("UpBlock2D",),
                  block_out_channels=(32, 64, 64),
                  layers_per_block=2, cross_attention_dim=32, attention_head_dim=8)),
}


def adapter_pair(kind: str, seed: int = 0) -> tuple[T2IAdapterModel, T2IAdapter]:
    reference = T2IAdapter(**ADAPTERS[kind]).eval()
    init_random_(reference, seed)
    state = reference.state_dict()
    names = diffusers_names(state)
    assert is_t2i_adapter(state)
    ours = T2IAdapterModel(t2i_adapter_config({name: tuple(state[key].shape) for name, key in names.items()}),
                           device="cpu").eval()
    bind_weights(ours, {name: state[key] for name, key in names.items()})
    return ours, reference


def features(control: dict) -> list[torch.Tensor]:
    """The adapter's features in level order, out of ComfyUI's control dict."""
    return [f for f in reversed(control["input"]) if f is not None] + control.get("middle", [])


# Sizes that stay even at every pooling: on an odd side the TencentARC pooling that ComfyUI runs (and we
# follow) pads with a counted zero, where diffusers' ceil_mode pooling averages the remaining pixels only.
@pytest.mark.parametrize("kind", sorted(ADAPTERS))
def test_adapter_matches_diffusers(kind):
    ours, reference = adapter_pair(kind)
    assert ours.config.kind == kind
    channels = ADAPTERS[kind]["in_channels"]
    hint = torch.rand(2, channels, 128, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(hint)
        got = features(ours(hint))
    assert len(got) == len(expected) == 4
    for ours_feature, reference_feature in zip(got, expected, strict=True):
        assert ours_feature.shape == reference_feature.shape
        assert relative_l2(ours_feature, reference_feature) <= PARITY_TOLERANCE


def test_odd_sides_pool_with_a_counted_zero_pad_as_the_tencentarc_downsample():
    x = torch.arange(1.0, 4.0).reshape(1, 1, 1, 3)  # one row: 1 2 3
    assert average_pool(x).flatten().tolist() == [0.25, 1.25]  # (0+0+0+1)/4, (0+0+2+3)/4


def test_full_adapter_config_from_shapes():
    ours, _ = adapter_pair("full")
    expected = T2IAdapterConfig("full", 3, (32, 32, 64, 64), 2, kernel_size=1, conv_downsample=False)
    assert ours.config == expected
    light, _ = adapter_pair("light")
    assert light.config == T2IAdapterConfig("light", 1, (32, 32, 64, 64), 3)


@pytest.mark.parametrize(("kind", "unet"), [("full", "sd1"), ("full_xl", "sdxl")])
def test_unet_with_adapter_features_matches_diffusers_intrablock_residuals(kind, unet):
    adapter, _ = adapter_pair(kind, seed=2)
    config, diffusers_kwargs = UNETS[unet]
    ours = UNetModel(config, device="cpu").eval()
    init_random_(ours, seed=3)
    reference = UNet2DConditionModel(**diffusers_kwargs).eval()
    reference.load_state_dict(unet_to_diffusers(ours, config), strict=True)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 4, 16, 16, generator=generator)
    timesteps = torch.tensor([17.0, 803.0])
    context = torch.randn(2, 7, 32, generator=generator)
    with torch.no_grad():
        control = adapter(torch.rand(2, 3, 128, 128, generator=generator))
        expected = reference(x, timesteps, context,
                             down_intrablock_additional_residuals=features(control)).sample
        got = ours(x, timesteps, context, control=control)
        without = ours(x, timesteps, context)
    error = relative_l2(got, expected)
    print(f"{kind}: relative L2 error {error:.2e}; the features moved the output by "
          f"{relative_l2(without, expected):.2e}")
    assert error <= PARITY_TOLERANCE
    assert relative_l2(without, expected) > 100 * PARITY_TOLERANCE
