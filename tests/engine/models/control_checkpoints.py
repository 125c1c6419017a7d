"""Test helper: tiny ControlNet and T2I-Adapter configs, diffusers twins of them, random weights and files.

    ours, reference = controlnet_pair("sd1_like")       # our ControlNetModel and diffusers' ControlNetModel
    write_controlnet(path, unet_config, layout="ldm")   # a random-weight ControlNet file for a UNet config
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from engine.models.controlnet import ControlNetConfig, ControlNetModel
from engine.models.detect import UNetConfig

STANDARD_HINT_WIDTHS = (16, 16, 32, 32, 96, 96, 256)  # the ldm hint encoder of every released ControlNet
ADM_TIME_WIDTH = 256  # SDXL's Fourier width per size/crop number


def unet_config(**fields) -> UNetConfig:
    base = dict(in_channels=4, out_channels=4, model_channels=32, channel_mult=(1, 2), num_res_blocks=1,
                attention_levels=(0, 1), transformer_depth=(1, 1), transformer_depth_middle=1, num_heads=8,
                num_head_channels=-1, context_dim=32, use_linear_in_transformer=False, adm_in_channels=None,
                num_classes=None, prediction="eps", family="sd1")
    return UNetConfig(**{**base, **fields})


# Our UNet config and the diffusers ControlNetModel / UNet2DConditionModel keywords of the same network.
CASES: dict[str, tuple[UNetConfig, dict]] = {
    "sd1_like": (
        unet_config(num_res_blocks=2, attention_levels=(0,), transformer_depth=(1, 0)),
        dict(down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), block_out_channels=(32, 64),
             layers_per_block=2, cross_attention_dim=32, attention_head_dim=8)),
    "sd2_like": (
        unet_config(num_heads=-1, num_head_channels=16, use_linear_in_transformer=True, family="sd2"),
        dict(down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"), block_out_channels=(32, 64),
             layers_per_block=1, cross_attention_dim=32, attention_head_dim=(2, 4),
             use_linear_projection=True)),
    "sdxl_like": (
        unet_config(channel_mult=(1, 2, 2), attention_levels=(1, 2), transformer_depth=(0, 1, 2),
                    transformer_depth_middle=2, num_heads=-1, num_head_channels=16, context_dim=64,
                    use_linear_in_transformer=True, adm_in_channels=32 + 6 * ADM_TIME_WIDTH,
                    num_classes="sequential", family="sdxl"),
        dict(down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
             block_out_channels=(32, 64, 64), layers_per_block=1, cross_attention_dim=64,
             attention_head_dim=(2, 4, 4), use_linear_projection=True, transformer_layers_per_block=(1, 1, 2),
             addition_embed_type="text_time", addition_time_embed_dim=ADM_TIME_WIDTH,
             projection_class_embeddings_input_dim=32 + 6 * ADM_TIME_WIDTH)),
}


def init_random_(module: nn.Module, seed: int) -> None:
    """Deterministic random weights of a sensible scale: fan-in scaled matrices, norms near identity (zero
    convolutions too are random, so that every residual carries signal)."""
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


def controlnet(unet: UNetConfig, seed: int = 0, hint_channels: int = 3) -> ControlNetModel:
    """Our ControlNet for a UNet config, with the standard hint encoder and random weights, on the CPU."""
    config = ControlNetConfig(unet, hint_channels, STANDARD_HINT_WIDTHS)
    model = ControlNetModel(config, device="cpu").eval()
    init_random_(model, seed)
    return model


def write_controlnet(path: str | os.PathLike[str], config: UNetConfig, layout: str = "ldm", seed: int = 0,
                     ) -> ControlNetModel:
    """A random-weight ControlNet file for a UNet config: layout "ldm" (bare keys), "ldm_prefixed" (under
    control_model.) or "diffusers" (converted by diffusers' own ldm converter). Returns our model."""
    from safetensors.torch import save_file

    model = controlnet(config, seed)
    state = {key: value.contiguous() for key, value in model.state_dict().items()}
    if layout == "ldm_prefixed":
        state = {f"control_model.{key}": value for key, value in state.items()}
    elif layout == "diffusers":
        state = to_diffusers(state, config)
    elif layout != "ldm":
        raise ValueError(f"unknown layout {layout!r}; accepted: ldm, ldm_prefixed, diffusers")
    save_file(state, str(path))
    return model


def to_diffusers(state: dict[str, torch.Tensor], config: UNetConfig) -> dict[str, torch.Tensor]:
    """An ldm ControlNet state dict in diffusers' layout, by diffusers' own converter; its controlnet mapping
    leaves out SDXL's vector-condition embedder, which its addition_embed_type mapping names."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING, convert_controlnet_checkpoint

    converted = convert_controlnet_checkpoint(state, {"layers_per_block": config.num_res_blocks})
    for diffusers_key, ldm_key in DIFFUSERS_TO_LDM_MAPPING["controlnet"]["addition_embed_type"].items():
        if ldm_key in state:
            converted[diffusers_key] = state[ldm_key]
    return converted
