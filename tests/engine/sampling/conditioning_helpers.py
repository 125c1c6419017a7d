"""Test helpers of the conditioning and guidance tests: a tiny random UNet, a recording denoiser, prompts."""

from __future__ import annotations

import torch

from engine.models.detect import UNetConfig
from engine.models.unet import UNetModel


def tiny_unet(seed: int = 0) -> UNetModel:
    """An SD1-like UNet of random weights (8 channels of context), in float32 on the CPU."""
    config = UNetConfig(in_channels=4, out_channels=4, model_channels=32, channel_mult=(1, 2),
                        num_res_blocks=1, attention_levels=(0, 1), transformer_depth=(1, 1),
                        transformer_depth_middle=1, num_heads=2, num_head_channels=-1, context_dim=8,
                        use_linear_in_transformer=False, adm_in_channels=None, num_classes=None,
                        prediction="eps", family="sd1")
    unet = UNetModel(config, device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in unet.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return unet


class Recording:
    """A denoiser that records each call's batch, spatial size and inputs; its x0 depends on all of them."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, x, sigma, context=None, y=None, **extra):
        self.calls.append({"shape": tuple(x.shape), "context": context, "y": y, **extra})
        return x * 0.5 + context.mean(dim=(1, 2)).reshape(-1, 1, 1, 1) + sigma.reshape(-1, 1, 1, 1) * 0.01


def prompt(value: float, tokens: int = 77, width: int = 8, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, tokens, width, generator=generator) * 0.5 + value
