"""engine.models.controlnet against diffusers' ControlNetModel, and the UNet's control residuals against
diffusers' UNet2DConditionModel with down_block_additional_residuals, on tiny random configs in float32.

Our ldm-layout weights reach diffusers through its own single-file converter, and diffusers-layout weights
reach us through our diffusers_names map: a wrong key, shape or layer shows up as a load failure or an output
mismatch in one direction or the other.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import ControlNetModel as DiffusersControlNet
from diffusers import UNet2DConditionModel

from engine.models.controlnet import (
    ControlNetModel,
    controlnet_config,
    controlnet_prefix,
    diffusers_names,
)
from engine.models.detect import UnsupportedModelError
from engine.models.unet import UNetModel
from engine.models.weights import bind_weights
from tests.engine.models.control_checkpoints import (
    CASES,
    STANDARD_HINT_WIDTHS,
    controlnet,
    init_random_,
    relative_l2,
    to_diffusers,
)

PARITY_TOLERANCE = 1e-5  # relative L2 error in float32


def inputs(model_config, size: tuple[int, int] = (8, 8), batch: int = 2, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, model_config.in_channels, *size, generator=generator)
    timesteps = torch.tensor([17.0, 803.0][:batch])
    context = torch.randn(batch, 7, model_config.context_dim, generator=generator)
    hint = torch.rand(batch, 3, size[0] * 8, size[1] * 8, generator=generator)
    return x, timesteps, context, hint


def sdxl_vector(reference, batch: int = 2) -> tuple[dict, torch.Tensor]:
    """diffusers' added_cond_kwargs and our y for the same pooled feature and size numbers."""
    pooled = torch.randn(batch, 32, generator=torch.Generator().manual_seed(1))
    time_ids = torch.tensor([[1024.0, 1024.0, 0.0, 0.0, 1024.0, 1024.0],
                             [768.0, 1344.0, 32.0, 8.0, 768.0, 1344.0]])[:batch]
    time_embeds = reference.add_time_proj(time_ids.flatten()).reshape(batch, -1)  # (B, 6 * 256)
    return {"text_embeds": pooled, "time_ids": time_ids}, torch.cat([pooled, time_embeds], dim=-1)


def assert_residuals_match(ours: dict, down: tuple, mid: torch.Tensor) -> float:
    assert len(ours["output"]) == len(down)
    worst = 0.0
    for got, expected in zip([*ours["output"], *ours["middle"]], [*down, mid], strict=True):
        assert got.shape == expected.shape
        worst = max(worst, relative_l2(got, expected))
    assert worst <= PARITY_TOLERANCE
    return worst


@pytest.mark.parametrize("case", sorted(CASES))
def test_controlnet_matches_diffusers_through_its_single_file_converter(case):
    config, diffusers_kwargs = CASES[case]
    ours = controlnet(config, seed=sorted(CASES).index(case))
    reference = DiffusersControlNet(**diffusers_kwargs).eval()
    reference.load_state_dict(to_diffusers(ours.state_dict(), config), strict=True)
    x, timesteps, context, hint = inputs(config)
    added, y = sdxl_vector(reference) if config.adm_in_channels else ({}, None)
    with torch.no_grad():
        down, mid = reference(x, timesteps, context, hint, added_cond_kwargs=added or None, return_dict=False)
        got = ours(x, hint, timesteps, context, y)
    print(f"{case}: relative L2 error {assert_residuals_match(got, down, mid):.2e}")


# Heads are not in the shapes: the sdxl_like twin here has the 64-wide heads that detection assumes for linear
# projections (one head at width 64), where CASES gives our model 16-wide ones.
@pytest.mark.parametrize(("case", "hint_widths", "heads"), [("sd1_like", (16, 32, 96, 256), 8),
                                                            ("sdxl_like", (16, 32), (1, 1, 1))])
def test_diffusers_layout_controlnet_loads_and_matches(case, hint_widths, heads):
    config, diffusers_kwargs = CASES[case]
    reference = DiffusersControlNet(**{**diffusers_kwargs, "attention_head_dim": heads},
                                    conditioning_embedding_out_channels=hint_widths).eval()
    init_random_(reference, seed=3)
    state = reference.state_dict()
    names = diffusers_names(state)
    assert controlnet_prefix(state) == ("diffusers", "")
    detected = controlnet_config({name: tuple(state[key].shape) for name, key in names.items()})
    assert detected.unet.family == config.family
    assert detected.hint_downscale == 2 ** (len(hint_widths) - 1)
    ours = ControlNetModel(detected, device="cpu").eval()
    bind_weights(ours, {name: state[key] for name, key in names.items()})
    x, timesteps, context, _ = inputs(config)
    hint = torch.rand(2, 3, 8 * detected.hint_downscale, 8 * detected.hint_downscale)
    added, y = sdxl_vector(reference) if config.adm_in_channels else ({}, None)
    with torch.no_grad():
        down, mid = reference(x, timesteps, context, hint, added_cond_kwargs=added or None, return_dict=False)
        got = ours(x, hint, timesteps, context, y)
    assert_residuals_match(got, down, mid)


def test_config_from_ldm_shapes_names_the_unet_and_the_standard_hint_encoder():
    config, _ = CASES["sd1_like"]
    ours = controlnet(config)
    prefixed = {f"control_model.{key}": value for key, value in ours.state_dict().items()}
    assert controlnet_prefix(prefixed) == ("ldm", "control_model.")
    detected = controlnet_config({key: tuple(value.shape) for key, value in ours.state_dict().items()})
    assert detected.hint_widths == STANDARD_HINT_WIDTHS and detected.hint_channels == 3
    assert detected.hint_strides == (1, 1, 2, 1, 2, 1, 2, 1) and detected.hint_downscale == 8
    assert detected.unet.channel_mult == (1, 2) and detected.unet.num_res_blocks == 2
    assert detected.unet.transformer_depth == (1, 0) and detected.unet.num_heads == 8


@pytest.mark.parametrize(("key", "what"), [("lora_controlnet", "Control-LoRA"),
                                           ("control_add_embedding.linear_1.weight", "Union"),
                                           ("controlnet_blocks.0.weight", "DiT")])
def test_other_control_models_are_named_in_the_error(key, what):
    with pytest.raises(UnsupportedModelError, match=what):
        controlnet_prefix({key: torch.zeros(1), "zero_convs.0.0.weight": torch.zeros(1)})


@pytest.mark.parametrize("case", ["sd1_like", "sdxl_like"])
def test_unet_with_control_residuals_matches_diffusers_additional_residuals(case):
    config, diffusers_kwargs = CASES[case]
    ours = UNetModel(config, device="cpu").eval()
    init_random_(ours, seed=5)
    diffusers_kwargs = {**diffusers_kwargs,
                        "up_block_types": tuple(t.replace("Down", "Up") for t in
                                                reversed(diffusers_kwargs["down_block_types"]))}
    reference = UNet2DConditionModel(**diffusers_kwargs).eval()
    reference.load_state_dict(unet_to_diffusers(ours, config), strict=True)
    x, timesteps, context, _ = inputs(config)
    added, y = sdxl_vector(reference) if config.adm_in_channels else ({}, None)
    with torch.no_grad():
        residuals = controlnet(config, seed=6)(x, torch.rand(2, 3, 64, 64), timesteps, context, y)
        expected = reference(x, timesteps, context, added_cond_kwargs=added or None,
                             down_block_additional_residuals=tuple(residuals["output"]),
                             mid_block_additional_residual=residuals["middle"][0]).sample
        without = ours(x, timesteps, context, y)
        got = ours(x, timesteps, context, y, control=residuals)
    error = relative_l2(got, expected)
    print(f"{case}: relative L2 error {error:.2e}; the residuals moved the output by "
          f"{relative_l2(without, expected):.2e}")
    assert error <= PARITY_TOLERANCE
    assert relative_l2(without, expected) > 100 * PARITY_TOLERANCE
    assert len(residuals["output"]) == len(ours.input_blocks)  # the UNet consumed copies of the lists


def unet_to_diffusers(unet: UNetModel, config) -> dict[str, torch.Tensor]:
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    state = {f"model.diffusion_model.{key}": value for key, value in unet.state_dict().items()}
    levels = len(config.channel_mult)
    return convert_ldm_unet_checkpoint(state, {"layers_per_block": config.num_res_blocks,
                                               "block_out_channels": [0] * levels,
                                               "class_embed_type": None,
                                               "addition_embed_type": "text_time" if config.adm_in_channels
                                               else None})
