"""The latent-diffusion UNet of SD1.x, SD2.x and SDXL (Rombach et al. 2022, LDM "openaimodel").

Parameter names are the keys of the original single-file checkpoints without their
`model.diffusion_model.` prefix, so a checkpoint binds directly (engine/models/weights.py).
The forward pass is a list of stages (engine/models/staged.py): "embed", each "input_blocks.N",
"middle_block", each "output_blocks.N", "out". The state they share holds "h" (the activation),
"emb" (timestep + vector embedding), "context" (cross-attention tokens) and "hs" (the skip list).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import attention
from engine.models.detect import UNetConfig
from engine.models.staged import Stage, StagedModel, State, run_stages

# ---------------------------------------------------------------------------------------------- presets


def sd15_unet_config() -> UNetConfig:
    """Stable Diffusion 1.x (v1-inference.yaml)."""
    return UNetConfig(in_channels=4, out_channels=4, model_channels=320, channel_mult=(1, 2, 4, 4),
                      num_res_blocks=2, attention_levels=(0, 1, 2), transformer_depth=(1, 1, 1, 0),
                      transformer_depth_middle=1, num_heads=8, num_head_channels=-1, context_dim=768,
                      use_linear_in_transformer=False, adm_in_channels=None, num_classes=None,
                      prediction="eps", family="sd1")


def sd21_unet_config(prediction: str = "v") -> UNetConfig:
    """Stable Diffusion 2.x (v2-inference-v.yaml for "v", v2-inference.yaml for "eps")."""
    if prediction not in ("eps", "v"):
        raise ValueError(f"unknown prediction {prediction!r} for SD2.x; accepted: eps, v")
    return UNetConfig(in_channels=4, out_channels=4, model_channels=320, channel_mult=(1, 2, 4, 4),
                      num_res_blocks=2, attention_levels=(0, 1, 2), transformer_depth=(1, 1, 1, 0),
                      transformer_depth_middle=1, num_heads=-1, num_head_channels=64, context_dim=1024,
                      use_linear_in_transformer=True, adm_in_channels=None, num_classes=None,
                      prediction=prediction, family="sd2")


def sdxl_unet_config() -> UNetConfig:
    """SDXL base 1.0 (sd_xl_base.yaml)."""
    return UNetConfig(in_channels=4, out_channels=4, model_channels=320, channel_mult=(1, 2, 4),
                      num_res_blocks=2, attention_levels=(1, 2), transformer_depth=(0, 2, 10),
                      transformer_depth_middle=10, num_heads=-1, num_head_channels=64, context_dim=2048,
                      use_linear_in_transformer=True, adm_in_channels=2816, num_classes="sequential",
                      prediction="eps", family="sdxl")


def sdxl_refiner_unet_config() -> UNetConfig:
    """SDXL refiner 1.0 (sd_xl_refiner.yaml)."""
    return UNetConfig(in_channels=4, out_channels=4, model_channels=384, channel_mult=(1, 2, 4, 4),
                      num_res_blocks=2, attention_levels=(1, 2), transformer_depth=(0, 4, 4, 0),
                      transformer_depth_middle=4, num_heads=-1, num_head_channels=64, context_dim=1280,
                      use_linear_in_transformer=True, adm_in_channels=2560, num_classes="sequential",
                      prediction="eps", family="sdxl_refiner")


# ---------------------------------------------------------------------------------------------- layers


def timestep_embedding(timesteps: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal timestep embedding (Vaswani et al. 2017) as LDM: (B,) -> (B, dim), cosines first."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32,
                                                           device=timesteps.device) / half)
    args = timesteps[:, None].float() * freqs[None]  # (B, half)
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (B, 2 * half)
    if dim % 2:
        embedding = F.pad(embedding, (0, 1))
    return embedding


class GroupNorm32(nn.GroupNorm):
    """GroupNorm computed in float32 whatever the weight and activation dtype, as LDM does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x.float(), self.num_groups, self.weight.float(), self.bias.float(),
                            self.eps).to(x.dtype)


class ResBlock(nn.Module):
    """Two 3x3 convolutions with the timestep embedding added in between, and a residual path."""

    def __init__(self, channels: int, emb_channels: int, out_channels: int, **factory):
        super().__init__()
        self.in_layers = nn.Sequential(GroupNorm32(32, channels, **factory), nn.SiLU(),
                                       nn.Conv2d(channels, out_channels, 3, padding=1, **factory))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, out_channels, **factory))
        self.out_layers = nn.Sequential(GroupNorm32(32, out_channels, **factory), nn.SiLU(),
                                        nn.Identity(),  # the checkpoint's dropout slot (index 2)
                                        nn.Conv2d(out_channels, out_channels, 3, padding=1, **factory))
        self.skip_connection = (nn.Identity() if out_channels == channels
                                else nn.Conv2d(channels, out_channels, 1, **factory))

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.in_layers(x)
        h = h + self.emb_layers(emb)[:, :, None, None]  # (B, C, 1, 1) broadcast over H, W
        return self.skip_connection(x) + self.out_layers(h)


class CrossAttention(nn.Module):
    """Multi-head attention of `x` over `context` (itself when context is None)."""

    def __init__(self, query_dim: int, context_dim: int, heads: int, head_dim: int, upcast: bool, **factory):
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.upcast = upcast  # compute attention in float32 (fp16 SD2.1-v needs it)
        self.to_q = nn.Linear(query_dim, inner, bias=False, **factory)
        self.to_k = nn.Linear(context_dim, inner, bias=False, **factory)
        self.to_v = nn.Linear(context_dim, inner, bias=False, **factory)
        self.to_out = nn.Sequential(nn.Linear(inner, query_dim, **factory))

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        context = x if context is None else context
        out = attention(self.to_q(x), self.to_k(context), self.to_v(context), self.heads, self.upcast)
        return self.to_out(out)


class GEGLU(nn.Module):
    """Gated GELU projection (Shazeer 2020): half of the projection gates the other half."""

    def __init__(self, dim_in: int, dim_out: int, **factory):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * F.gelu(gate)


class FeedForward(nn.Module):
    """GEGLU up-projection to 4x the width, then back down."""

    def __init__(self, dim: int, **factory):
        super().__init__()
        self.net = nn.Sequential(GEGLU(dim, dim * 4, **factory), nn.Identity(),  # the dropout slot (index 1)
                                 nn.Linear(dim * 4, dim, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BasicTransformerBlock(nn.Module):
    """Pre-norm self-attention, cross-attention over the text context, and a GEGLU feed-forward."""

    def __init__(self, dim: int, heads: int, head_dim: int, context_dim: int, upcast: bool, **factory):
        super().__init__()
        self.attn1 = CrossAttention(dim, dim, heads, head_dim, upcast, **factory)
        self.ff = FeedForward(dim, **factory)
        self.attn2 = CrossAttention(dim, context_dim, heads, head_dim, upcast, **factory)
        self.norm1 = nn.LayerNorm(dim, **factory)
        self.norm2 = nn.LayerNorm(dim, **factory)
        self.norm3 = nn.LayerNorm(dim, **factory)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x))
        x = x + self.attn2(self.norm2(x), context)
        return x + self.ff(self.norm3(x))


class SpatialTransformer(nn.Module):
    """Transformer blocks over the pixels of a feature map, between two projections and a residual."""

    def __init__(self, channels: int, heads: int, head_dim: int, depth: int, context_dim: int,
                 use_linear: bool, upcast: bool, **factory):
        super().__init__()
        inner = heads * head_dim
        self.use_linear = use_linear
        self.norm = GroupNorm32(32, channels, eps=1e-6, **factory)
        self.proj_in = (nn.Linear(channels, inner, **factory) if use_linear
                        else nn.Conv2d(channels, inner, 1, **factory))
        self.transformer_blocks = nn.ModuleList(
            BasicTransformerBlock(inner, heads, head_dim, context_dim, upcast, **factory)
            for _ in range(depth))
        self.proj_out = (nn.Linear(inner, channels, **factory) if use_linear
                         else nn.Conv2d(inner, channels, 1, **factory))

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = x.shape
        h = self.norm(x)
        if not self.use_linear:
            h = self.proj_in(h)
        h = h.flatten(2).transpose(1, 2)  # (B, H*W, C)
        if self.use_linear:
            h = self.proj_in(h)
        for block in self.transformer_blocks:
            h = block(h, context)
        if self.use_linear:
            h = self.proj_out(h)
        h = h.transpose(1, 2).reshape(batch, -1, height, width)  # (B, C, H, W)
        if not self.use_linear:
            h = self.proj_out(h)
        return x + h


class Downsample(nn.Module):
    """Halve the resolution with a stride-2 3x3 convolution."""

    def __init__(self, channels: int, **factory):
        super().__init__()
        self.op = nn.Conv2d(channels, channels, 3, stride=2, padding=1, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


class Upsample(nn.Module):
    """Nearest-neighbour upsampling to `size` (twice the resolution when None), then a 3x3 convolution."""

    def __init__(self, channels: int, **factory):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, **factory)

    def forward(self, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        if size is None:
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        else:
            x = F.interpolate(x, size=size, mode="nearest")
        return self.conv(x)


class TimestepEmbedSequential(nn.Sequential):
    """A block of layers, each given what it needs: the embedding, the context, or the upsample size."""

    def forward(self, x: torch.Tensor, emb: torch.Tensor, context: torch.Tensor,
                upsample_size: tuple[int, int] | None = None) -> torch.Tensor:
        for layer in self:
            if isinstance(layer, ResBlock):
                x = layer(x, emb)
            elif isinstance(layer, SpatialTransformer):
                x = layer(x, context)
            elif isinstance(layer, Upsample):
                x = layer(x, upsample_size)
            else:
                x = layer(x)
        return x


# ---------------------------------------------------------------------------------------------- model


class UNetModel(StagedModel):
    """The SD1.x / SD2.x / SDXL UNet; forward(x, timesteps, context, y) predicts eps or v per config."""

    def __init__(self, config: UNetConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "meta", attention_upcast: bool = False):
        super().__init__()
        self.config = config
        self.dtype = dtype
        levels = len(config.channel_mult)
        res_blocks = _per_level("num_res_blocks", config.num_res_blocks, levels)
        depths = _per_level("transformer_depth", config.transformer_depth, levels)
        if (config.num_heads == -1) == (config.num_head_channels == -1):
            raise ValueError(f"exactly one of num_heads ({config.num_heads}) and num_head_channels "
                             f"({config.num_head_channels}) must be set; the other must be -1")
        factory = {"dtype": dtype, "device": device}
        mc = config.model_channels
        emb_dim = mc * 4

        def transformer(channels: int, depth: int) -> SpatialTransformer:
            if config.num_heads != -1:
                heads, head_dim = config.num_heads, channels // config.num_heads
            else:
                heads, head_dim = channels // config.num_head_channels, config.num_head_channels
            return SpatialTransformer(channels, heads, head_dim, depth, config.context_dim,
                                      config.use_linear_in_transformer, attention_upcast, **factory)

        def has_attention(level: int) -> bool:
            return level in config.attention_levels and depths[level] > 0

        self.time_embed = nn.Sequential(nn.Linear(mc, emb_dim, **factory), nn.SiLU(),
                                        nn.Linear(emb_dim, emb_dim, **factory))
        self.label_emb: nn.Sequential | None = None
        if config.num_classes == "sequential":
            if config.adm_in_channels is None:
                raise ValueError("num_classes='sequential' needs adm_in_channels (the width of y)")
            self.label_emb = nn.Sequential(nn.Sequential(
                nn.Linear(config.adm_in_channels, emb_dim, **factory), nn.SiLU(),
                nn.Linear(emb_dim, emb_dim, **factory)))
        elif config.num_classes is not None:
            raise ValueError(f"unsupported num_classes {config.num_classes!r}; accepted: 'sequential', None")

        # Down: each level's ResBlocks (+ transformer), then a Downsample except at the last level.
        self.input_blocks = nn.ModuleList([TimestepEmbedSequential(
            nn.Conv2d(config.in_channels, mc, 3, padding=1, **factory))])
        skip_channels = [mc]
        ch = mc
        for level, mult in enumerate(config.channel_mult):
            for _ in range(res_blocks[level]):
                layers: list[nn.Module] = [ResBlock(ch, emb_dim, mc * mult, **factory)]
                ch = mc * mult
                if has_attention(level):
                    layers.append(transformer(ch, depths[level]))
                self.input_blocks.append(TimestepEmbedSequential(*layers))
                skip_channels.append(ch)
            if level != levels - 1:
                self.input_blocks.append(TimestepEmbedSequential(Downsample(ch, **factory)))
                skip_channels.append(ch)

        middle: list[nn.Module] = [ResBlock(ch, emb_dim, ch, **factory)]
        if config.transformer_depth_middle > 0:
            middle.append(transformer(ch, config.transformer_depth_middle))
        middle.append(ResBlock(ch, emb_dim, ch, **factory))
        self.middle_block = TimestepEmbedSequential(*middle)

        # Up: each level takes one more ResBlock than on the way down, each consuming one skip.
        self.output_blocks = nn.ModuleList()
        for level, mult in reversed(list(enumerate(config.channel_mult))):
            for i in range(res_blocks[level] + 1):
                layers = [ResBlock(ch + skip_channels.pop(), emb_dim, mc * mult, **factory)]
                ch = mc * mult
                if has_attention(level):
                    layers.append(transformer(ch, depths[level]))
                if level and i == res_blocks[level]:
                    layers.append(Upsample(ch, **factory))
                self.output_blocks.append(TimestepEmbedSequential(*layers))

        self.out = nn.Sequential(GroupNorm32(32, ch, **factory), nn.SiLU(),
                                 nn.Conv2d(mc, config.out_channels, 3, padding=1, **factory))

    def initial_state(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                      y: torch.Tensor | None = None) -> State:
        """The first stage's state from x (B, C, H, W), timesteps (B,), context (B, L, D), y (B, adm)."""
        if (y is None) != (self.label_emb is None):
            need = f"y of width {self.config.adm_in_channels}" if self.label_emb is not None else "no y"
            raise ValueError(f"UNet of family {self.config.family!r} takes {need}; "
                             f"got {'none' if y is None else tuple(y.shape)}")
        return {"h": x.to(self.dtype), "timesteps": timesteps, "context": context.to(self.dtype), "y": y,
                "hs": []}

    def stages(self) -> list[Stage]:
        embedders = (self.time_embed,) if self.label_emb is None else (self.time_embed, self.label_emb)
        stages = [Stage("embed", embedders, self._embed)]
        stages += [Stage(f"input_blocks.{i}", (block,), _input_block_runner(block))
                   for i, block in enumerate(self.input_blocks)]
        stages.append(Stage("middle_block", (self.middle_block,), _middle_block_runner(self.middle_block)))
        stages += [Stage(f"output_blocks.{i}", (block,), _output_block_runner(block))
                   for i, block in enumerate(self.output_blocks)]
        stages.append(Stage("out", (self.out,), self._out))
        return stages

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                y: torch.Tensor | None = None) -> torch.Tensor:
        state = run_stages(self.stages(), self.initial_state(x, timesteps, context, y))
        return state["h"].to(x.dtype)

    def _embed(self, state: State) -> State:
        emb = self.time_embed(timestep_embedding(state.pop("timesteps"), self.config.model_channels)
                              .to(self.dtype))  # (B, 4 * model_channels)
        y = state.pop("y")
        if self.label_emb is not None:
            emb = emb + self.label_emb(y.to(self.dtype))
        state["emb"] = emb
        return state

    def _out(self, state: State) -> State:
        state["h"] = self.out(state["h"])
        return state


def _per_level(name: str, value: int | tuple[int, ...], levels: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * levels
    if len(value) != levels:
        raise ValueError(f"{name} {tuple(value)} has {len(value)} entries; channel_mult has {levels} levels")
    return tuple(value)


def _input_block_runner(block: TimestepEmbedSequential):
    def run(state: State) -> State:
        state["h"] = block(state["h"], state["emb"], state["context"])
        state["hs"].append(state["h"])
        return state
    return run


def _middle_block_runner(block: TimestepEmbedSequential):
    def run(state: State) -> State:
        state["h"] = block(state["h"], state["emb"], state["context"])
        return state
    return run


def _output_block_runner(block: TimestepEmbedSequential):
    def run(state: State) -> State:
        hs = state["hs"]
        h = torch.cat([state["h"], hs.pop()], dim=1)  # (B, C + C_skip, H, W)
        upsample_size = tuple(hs[-1].shape[-2:]) if hs else None  # match the next skip (odd sizes)
        state["h"] = block(h, state["emb"], state["context"], upsample_size)
        return state
    return run
