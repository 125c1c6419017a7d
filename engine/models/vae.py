"""The KL-regularised autoencoder of latent diffusion (Rombach et al. 2022, "KL-f8"), as in the LDM code.

Parameter names are the LDM single-file keys without the `first_stage_model.` prefix, so a checkpoint
binds by name. Encoding and decoding are ordered stages (engine/models/staged.py); `stages()` are the
decoder's, which the memory runtime segments. `encode` returns what the UNet sees (scaled and shifted
posterior mean or sample); `decode` undoes that scaling and returns pixels in [-1, 1].
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import attention
from engine.models.detect import VAEConfig
from engine.models.staged import Stage, StagedModel, State, run_stages

logger = logging.getLogger("sluice.vae")

GROUP_NORM_GROUPS = 32  # LDM's Normalize(): GroupNorm(32, channels, eps=1e-6)
LOGVAR_RANGE = (-30.0, 20.0)  # LDM's DiagonalGaussianDistribution clamps the log-variance to this range


def normalize(channels: int) -> nn.GroupNorm:
    if channels % GROUP_NORM_GROUPS != 0:
        raise ValueError(f"VAE width {channels} is not divisible by {GROUP_NORM_GROUPS} GroupNorm groups; "
                         f"accepted: multiples of {GROUP_NORM_GROUPS}")
    return nn.GroupNorm(GROUP_NORM_GROUPS, channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """GroupNorm-SiLU-Conv twice with a residual (a 1x1 `nin_shortcut` when the width changes)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1 = normalize(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = normalize(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        shortcut = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return shortcut + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the pixels of a feature map, q/k/v/proj_out as 1x1 convolutions."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = normalize(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        normed = self.norm(x)
        q, k, v = (conv(normed).reshape(b, c, h * w).transpose(1, 2)  # (B, HW, C)
                   for conv in (self.q, self.k, self.v))
        out = attention(q, k, v, heads=1)  # (B, HW, C)
        out = out.transpose(1, 2).reshape(b, c, h, w)  # (B, C, H, W)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    """Stride-2 3x3 convolution after padding one pixel on the right and bottom (LDM's asymmetric pad)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """Nearest-neighbour 2x upsampling followed by a 3x3 convolution."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Level(nn.Module):
    """One resolution of the encoder (`down.N`) or decoder (`up.N`): ResNet blocks, attention, resampler."""

    def __init__(self, widths: list[tuple[int, int]], with_attention: bool, downsample: bool = False,
                 upsample: bool = False):
        super().__init__()
        self.block = nn.ModuleList(ResnetBlock(w_in, w_out) for w_in, w_out in widths)
        self.attn = nn.ModuleList(AttnBlock(w_out) for _, w_out in widths if with_attention)
        if downsample:
            self.downsample = Downsample(widths[-1][1])
        if upsample:
            self.upsample = Upsample(widths[-1][1])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.block):
            h = block(h)
            if self.attn:
                h = self.attn[index](h)
        if hasattr(self, "downsample"):
            h = self.downsample(h)
        if hasattr(self, "upsample"):
            h = self.upsample(h)
        return h


class Mid(nn.Module):
    """ResNet block, self-attention, ResNet block at the lowest resolution."""

    def __init__(self, channels: int):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(h)))


class Encoder(nn.Module):
    """Pixels (B, in_channels, H, W) to posterior moments (B, 2 * z_channels, H / 2^(levels-1), ...)."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.conv_in = nn.Conv2d(cfg.in_channels, cfg.ch, 3, padding=1)
        in_mult = (1, *cfg.ch_mult)
        self.down = nn.ModuleList()
        for level, mult in enumerate(cfg.ch_mult):
            w_in, w_out = cfg.ch * in_mult[level], cfg.ch * mult
            widths = [(w_in if i == 0 else w_out, w_out) for i in range(cfg.num_res_blocks)]
            with_attention = cfg.resolution >> level in cfg.attn_resolutions  # level N: resolution / 2^N
            self.down.append(Level(widths, with_attention, downsample=level != len(cfg.ch_mult) - 1))
        width = cfg.ch * cfg.ch_mult[-1]
        self.mid = Mid(width)
        self.norm_out = normalize(width)
        self.conv_out = nn.Conv2d(width, 2 * cfg.z_channels, 3, padding=1)


class Decoder(nn.Module):
    """Latent (B, z_channels, h, w) to pixels (B, out_ch, h * 2^(levels-1), ...); `up.0` is full res."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        width = cfg.ch * cfg.ch_mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, width, 3, padding=1)
        self.mid = Mid(width)
        levels: list[Level] = []
        for level in reversed(range(len(cfg.ch_mult))):
            w_out = cfg.ch * cfg.ch_mult[level]
            widths = [(width if i == 0 else w_out, w_out) for i in range(cfg.num_res_blocks + 1)]
            with_attention = cfg.resolution >> level in cfg.attn_resolutions
            levels.insert(0, Level(widths, with_attention, upsample=level != 0))
            width = w_out
        self.up = nn.ModuleList(levels)  # up.0 is the full-resolution level, run last
        self.norm_out = normalize(width)
        self.conv_out = nn.Conv2d(width, cfg.out_ch, 3, padding=1)


class AutoencoderKL(StagedModel):
    """KL-f8 VAE: `encode` pixels in [-1, 1] to UNet latents, `decode` UNet latents back to pixels."""

    def __init__(self, config: VAEConfig, device: torch.device | str = "meta",
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        with torch.device(device):
            self.encoder = Encoder(config)
            self.decoder = Decoder(config)
            if config.use_quant_conv:
                self.quant_conv = nn.Conv2d(2 * config.z_channels, 2 * config.embed_dim, 1)
                self.post_quant_conv = nn.Conv2d(config.embed_dim, config.z_channels, 1)
            else:  # FLUX's autoencoder: the moments and the latent are the encoder's and decoder's own
                self.quant_conv, self.post_quant_conv = nn.Identity(), nn.Identity()
        self.to(dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: the first floating-point parameter's (a quantised layer's weight is bytes)."""
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    def encoder_stages(self) -> list[Stage]:
        """conv_in, each `down.N` level, the middle block, norm_out/conv_out/quant_conv to the moments."""
        enc = self.encoder

        def conv_in(state: State) -> State:
            return {"h": enc.conv_in(state["pixels"].to(self.dtype))}

        def moments(state: State) -> State:
            h = enc.conv_out(F.silu(enc.norm_out(state["h"])))
            return {"moments": self.quant_conv(h)}  # (B, 2 * embed_dim, h, w): mean and log-variance

        stages = [Stage("encoder.conv_in", (enc.conv_in,), conv_in)]
        stages += [Stage(f"encoder.down.{i}", (level,), _apply(level)) for i, level in enumerate(enc.down)]
        stages.append(Stage("encoder.mid", (enc.mid,), _apply(enc.mid)))
        stages.append(Stage("encoder.out", (enc.norm_out, enc.conv_out, self.quant_conv), moments))
        return stages

    def decoder_stages(self) -> list[Stage]:
        """Unscale + post_quant_conv + conv_in, the middle block, each `up.N` from low to full res, output."""
        dec = self.decoder

        def conv_in(state: State) -> State:
            z = state["latent"].to(self.dtype) / self.config.scale_factor + self.config.shift_factor
            return {"h": dec.conv_in(self.post_quant_conv(z))}

        def conv_out(state: State) -> State:
            return {"pixels": dec.conv_out(F.silu(dec.norm_out(state["h"])))}

        stages = [Stage("decoder.conv_in", (self.post_quant_conv, dec.conv_in), conv_in)]
        stages.append(Stage("decoder.mid", (dec.mid,), _apply(dec.mid)))
        for i in reversed(range(len(dec.up))):
            stages.append(Stage(f"decoder.up.{i}", (dec.up[i],), _apply(dec.up[i])))
        stages.append(Stage("decoder.out", (dec.norm_out, dec.conv_out), conv_out))
        return stages

    def stages(self) -> list[Stage]:
        return self.decoder_stages()

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return run_stages(self.stages(), {"latent": latent})["pixels"]

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor, sample: bool = False,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Pixels (B, 3, H, W) in [-1, 1] to the float32 latent the UNet sees: (posterior - shift) * scale."""
        if pixels.ndim != 4 or pixels.shape[1] != self.config.in_channels:
            raise ValueError(f"VAE encode expects pixels of shape (B, {self.config.in_channels}, H, W); "
                             f"got {tuple(pixels.shape)}")
        moments = run_stages(self.encoder_stages(), {"pixels": pixels})["moments"].float()
        mean, logvar = moments.chunk(2, dim=1)  # (B, embed_dim, h, w) each
        posterior = mean
        if sample:
            std = torch.exp(0.5 * logvar.clamp(*LOGVAR_RANGE))
            noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
            posterior = mean + std * noise
        return (posterior - self.config.shift_factor) * self.config.scale_factor

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """UNet latent (B, embed_dim, h, w) to float32 pixels (B, out_ch, 8h, 8w for KL-f8) in about [-1, 1].

        An fp16 decode that overflows (known SDXL VAE behaviour) is redone with float32 copies of the weights.
        """
        if latent.ndim != 4 or latent.shape[1] != self.config.embed_dim:
            raise ValueError(f"VAE decode expects a latent of shape (B, {self.config.embed_dim}, h, w); "
                             f"got {tuple(latent.shape)}")
        pixels = self(latent)
        if self.dtype == torch.float16 and not torch.isfinite(pixels).all():
            logger.warning("VAE decode in float16 produced NaN/inf (known SDXL VAE behaviour); "
                           "retrying in float32")
            fp32_weights = {name: p.float() for name, p in self.named_parameters()}
            pixels = torch.func.functional_call(self, fp32_weights, (latent,))
        return pixels.float()


def _apply(module: nn.Module):
    """A stage body that runs `module` on state["h"]."""

    def run(state: State) -> State:
        return {"h": module(state["h"])}

    return run
