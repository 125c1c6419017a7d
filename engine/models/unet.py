"""The latent-diffusion UNet of SD1.x, SD2.x and SDXL (Rombach et al. 2022, LDM "openaimodel").

Parameter names are the keys of the original single-file checkpoints without their
`model.diffusion_model.` prefix, so a checkpoint binds directly (engine/models/weights.py).
The forward pass is a list of stages (engine/models/staged.py) about one layer each, so the memory
runtime can cut it finely: "embed", then per layer of each block (named by the block and layer index)
a convolution, Downsample or Upsample stage ("input_blocks.0.0", "output_blocks.8.2"), two ResBlock
stages ("input_blocks.4.0.in", ".out"), or a SpatialTransformer's "proj_in", four stages per
transformer block ("transformer_blocks.3.attn1", ".attn2", ".ff.geglu", ".ff.out") and "proj_out"; then
"out".
The state they share holds "h" (the activation), "emb" (timestep + vector embedding), "context"
(cross-attention tokens) and "hs" (the skip list); within a block, until used, also "x_in" (a
ResBlock's input), "residual" and "tokens" (a SpatialTransformer's input and its (B, H*W, C) tokens),
"ff_hidden" (a feed-forward's gated activations) and "upsample_size" (an upsampling output block's
target size). Output-block patches (ComfyUI's output_block_patch, e.g. FreeU), when given, are in
"output_block_patches": each `patch(h, skip) -> (h, skip)` runs before an output block concatenates its
skip, in order; "patch_signature" holds their repr, a plain value that keys captured CUDA graphs. Control
residuals (ControlNet, T2I-Adapter), when given, are in "control" (see UNetModel). A middle patch (ComfyUI's
middle_patch: GLIGEN's fusers), when given, is in "middle_patch": `patch(tokens, transformer_index) ->
tokens` runs after each transformer block's self-attention, the index counting the UNet's
SpatialTransformers in execution order; "middle_patch_signature" is its plain-valued key.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import attention
from engine.models.detect import UNetConfig
from engine.models.detect import sd15_unet_config as sd15_unet_config  # the presets live beside UNetConfig;
from engine.models.detect import sd21_unet_config as sd21_unet_config  # imported from here too
from engine.models.detect import sdxl_refiner_unet_config as sdxl_refiner_unet_config
from engine.models.detect import sdxl_unet_config as sdxl_unet_config
from engine.models.staged import Stage, StagedModel, State, run_stages

StageRun = Callable[[State], State]
OutputBlockPatch = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (h, skip)
MiddlePatch = Callable[[torch.Tensor, int], torch.Tensor]  # (tokens (B, H*W, C), transformer index) -> tokens
Control = Mapping[str, Sequence[torch.Tensor | None] | None]  # "input" / "middle" / "output" -> residuals
CONTROL_KINDS = ("input", "middle", "output")
log = logging.getLogger("sluice.unet")


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
    """GroupNorm with float32 statistics whatever the activation dtype, as LDM's GroupNorm32.

    PyTorch's CUDA kernel already accumulates half-precision inputs in float32 (ComfyUI runs it so), so
    there the input is not upcast: that would cost an fp32 copy of every activation. Elsewhere it is.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 or x.device.type == "cuda":
            return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return F.group_norm(x.float(), self.num_groups, self.weight.float(), self.bias.float(),
                            self.eps).to(x.dtype)


class ResBlock(nn.Module):
    """Two 3x3 convolutions with the timestep embedding added in between, and a residual path."""

    def __init__(self, channels: int, emb_channels: int, out_channels: int, **factory):
        super().__init__()
        self.in_layers = nn.Sequential(GroupNorm32(32, channels, **factory), nn.SiLU(inplace=True),
                                       nn.Conv2d(channels, out_channels, 3, padding=1, **factory))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, out_channels, **factory))
        self.out_layers = nn.Sequential(GroupNorm32(32, out_channels, **factory), nn.SiLU(inplace=True),
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


FF_CHUNK_BYTES = 32 * 1024**2  # the largest GEGLU projection a feed-forward computes at once


class FeedForward(nn.Module):
    """GEGLU up-projection to 4x the width, then back down, in two steps that the stages run apart.

    `geglu` computes the gated hidden activations and `project_out` the down-projection, so the UNet's
    stages can hold the two weights apart (SDXL's 1280-wide feed-forward is 37.5 MiB, the largest weight set
    of a stage otherwise). Tokens are independent in `geglu`, so large inputs run in chunks of tokens
    whose projection (twice the inner width, the largest temporary of a UNet step) stays under
    FF_CHUNK_BYTES: at SDXL's 64x64 level that is 168 MB at once otherwise. Each token's arithmetic is
    unchanged.
    """

    def __init__(self, dim: int, **factory):
        super().__init__()
        self.net = nn.Sequential(GEGLU(dim, dim * 4, **factory), nn.Identity(),  # the dropout slot (index 1)
                                 nn.Linear(dim * 4, dim, **factory))

    def geglu(self, x: torch.Tensor) -> torch.Tensor:
        geglu = self.net[0]
        rows = x.numel() // x.shape[-1]
        chunks = math.ceil(rows * geglu.proj.out_features * x.element_size() / FF_CHUNK_BYTES)
        if chunks <= 1:
            return geglu(x)
        flat = x.reshape(rows, x.shape[-1])  # (tokens of every batch item, C)
        hidden = torch.empty(rows, geglu.proj.out_features // 2, dtype=x.dtype, device=x.device)
        step = math.ceil(rows / chunks)
        for start in range(0, rows, step):
            hidden[start : start + step] = geglu(flat[start : start + step])
        return hidden.view(*x.shape[:-1], hidden.shape[-1])

    def project_out(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net[2](hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project_out(self.geglu(x))


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


class UNetEncoder(StagedModel):
    """The UNet's embedders, input blocks and middle block: the half that a ControlNet copies.

    `skip_channels` lists the width of each input block's output (the skips the decoder half takes);
    `channels` is the middle block's width.
    """

    def __init__(self, config: UNetConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "meta", attention_upcast: bool = False):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.attention_upcast = attention_upcast
        levels = len(config.channel_mult)
        res_blocks = _per_level("num_res_blocks", config.num_res_blocks, levels)
        depths = _per_level("transformer_depth", config.transformer_depth, levels)
        if (config.num_heads == -1) == (config.num_head_channels == -1):
            raise ValueError(f"exactly one of num_heads ({config.num_heads}) and num_head_channels "
                             f"({config.num_head_channels}) must be set; the other must be -1")
        factory = {"dtype": dtype, "device": device}
        mc = config.model_channels
        emb_dim = mc * 4

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
                if level in config.attention_levels and depths[level] > 0:
                    layers.append(self.level_transformer(ch, depths[level], device))
                self.input_blocks.append(TimestepEmbedSequential(*layers))
                skip_channels.append(ch)
            if level != levels - 1:
                self.input_blocks.append(TimestepEmbedSequential(Downsample(ch, **factory)))
                skip_channels.append(ch)

        middle: list[nn.Module] = [ResBlock(ch, emb_dim, ch, **factory)]
        if config.transformer_depth_middle > 0:
            middle.append(self.level_transformer(ch, config.transformer_depth_middle, device))
        middle.append(ResBlock(ch, emb_dim, ch, **factory))
        self.middle_block = TimestepEmbedSequential(*middle)
        self.skip_channels = tuple(skip_channels)
        self.channels = ch

    def level_transformer(self, channels: int, depth: int, device: torch.device | str) -> SpatialTransformer:
        """A SpatialTransformer of `depth` blocks for a level of width `channels`, with the config's heads."""
        config = self.config
        if config.num_heads != -1:
            heads, head_dim = config.num_heads, channels // config.num_heads
        else:
            heads, head_dim = channels // config.num_head_channels, config.num_head_channels
        return SpatialTransformer(channels, heads, head_dim, depth, config.context_dim,
                                  config.use_linear_in_transformer, self.attention_upcast, dtype=self.dtype,
                                  device=device)

    def _embed(self, state: State) -> State:
        emb = self.time_embed(timestep_embedding(state.pop("timesteps"), self.config.model_channels)
                              .to(self.dtype))  # (B, 4 * model_channels)
        y = state.pop("y")
        if self.label_emb is not None:
            emb = emb + self.label_emb(y.to(self.dtype))
        state["emb"] = emb
        return state

    def _embed_stage(self) -> Stage:
        embedders = (self.time_embed,) if self.label_emb is None else (self.time_embed, self.label_emb)
        return Stage("embed", embedders, self._embed)

    def _check_y(self, y: torch.Tensor | None) -> None:
        if (y is None) != (self.label_emb is None):
            need = f"y of width {self.config.adm_in_channels}" if self.label_emb is not None else "no y"
            raise ValueError(f"{type(self).__name__} of family {self.config.family!r} takes {need}; "
                             f"got {'none' if y is None else tuple(y.shape)}")


class UNetModel(UNetEncoder):
    """The SD1.x / SD2.x / SDXL UNet; forward(x, timesteps, context, y) predicts eps or v per config.

    `control` (ControlNet residuals and T2I-Adapter features, engine/models/control.py) holds lists of
    tensors or None under "input", "middle" and "output", applied as ComfyUI's UNet applies them: each
    list is consumed from its end, "input" added to each input block's output (before it becomes a skip),
    "middle" to the middle block's, "output" to each skip as an output block takes it. A residual whose
    shape does not fit is skipped with a warning.
    """

    def __init__(self, config: UNetConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "meta", attention_upcast: bool = False):
        super().__init__(config, dtype, device, attention_upcast)
        levels = len(config.channel_mult)
        res_blocks = _per_level("num_res_blocks", config.num_res_blocks, levels)
        depths = _per_level("transformer_depth", config.transformer_depth, levels)
        factory = {"dtype": dtype, "device": device}
        mc, emb_dim, ch = config.model_channels, config.model_channels * 4, self.channels
        skip_channels = list(self.skip_channels)

        # Up: each level takes one more ResBlock than on the way down, each consuming one skip.
        self.output_blocks = nn.ModuleList()
        for level, mult in reversed(list(enumerate(config.channel_mult))):
            for i in range(res_blocks[level] + 1):
                layers = [ResBlock(ch + skip_channels.pop(), emb_dim, mc * mult, **factory)]
                ch = mc * mult
                if level in config.attention_levels and depths[level] > 0:
                    layers.append(self.level_transformer(ch, depths[level], device))
                if level and i == res_blocks[level]:
                    layers.append(Upsample(ch, **factory))
                self.output_blocks.append(TimestepEmbedSequential(*layers))

        self.out = nn.Sequential(GroupNorm32(32, ch, **factory), nn.SiLU(inplace=True),
                                 nn.Conv2d(mc, config.out_channels, 3, padding=1, **factory))

    def initial_state(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                      y: torch.Tensor | None = None, output_block_patches: tuple[OutputBlockPatch, ...] = (),
                      control: Control | None = None, middle_patch: MiddlePatch | None = None) -> State:
        """The first stage's state from x (B, C, H, W), timesteps (B,), context (B, L, D), y (B, adm), the
        output-block patches, the control residuals (lists under "input", "middle", "output", moved to
        x's device; copied, as the stages consume them) and the middle patch (module docstring)."""
        self._check_y(y)
        state = {"h": x.to(self.dtype), "timesteps": timesteps, "context": context.to(self.dtype), "y": y,
                 "hs": []}
        if output_block_patches:
            state["output_block_patches"] = tuple(output_block_patches)
            state["patch_signature"] = repr(state["output_block_patches"])
        if control is not None:
            state["control"] = {kind: [None if r is None else r.to(x.device) for r in control.get(kind) or ()]
                                for kind in CONTROL_KINDS}
        if middle_patch is not None:
            state["middle_patch"] = middle_patch
            state["middle_patch_signature"] = str(getattr(middle_patch, "signature", id(middle_patch)))
        return state

    def _build_stages(self) -> list[Stage]:
        stages = [self._embed_stage()]
        for i, block in enumerate(self.input_blocks):
            stages += block_stages(f"input_blocks.{i}", block, appends_skip=True)
        middle = block_stages("middle_block", self.middle_block)
        middle[-1] = Stage(middle[-1].name, middle[-1].modules, _adding_control(middle[-1].run, "middle"))
        stages += middle
        for i, block in enumerate(self.output_blocks):
            stages += block_stages(f"output_blocks.{i}", block, takes_skip=True)
        stages.append(Stage("out", (self.out,), self._out))
        return _with_middle_patches(stages)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                y: torch.Tensor | None = None, output_block_patches: tuple[OutputBlockPatch, ...] = (),
                control: Control | None = None, middle_patch: MiddlePatch | None = None) -> torch.Tensor:
        state = run_stages(self.stages(), self.initial_state(x, timesteps, context, y, output_block_patches,
                                                             control, middle_patch))
        return state["h"].to(x.dtype)

    def _out(self, state: State) -> State:
        state["h"] = self.out(state["h"])
        return state


def _with_middle_patches(stages: list[Stage]) -> list[Stage]:
    """Each transformer block's self-attention stage followed by the state's middle patch, if any, given the
    index of its SpatialTransformer (counted by their "proj_in" stages, in execution order)."""
    patched, index = [], -1
    for stage in stages:
        if stage.name.endswith(".proj_in"):
            index += 1
        if stage.name.endswith(".attn1"):
            stage = Stage(stage.name, stage.modules, _patching_middle(stage.run, index))
        patched.append(stage)
    return patched


def _patching_middle(run: StageRun, transformer_index: int) -> StageRun:
    def run_then_patch(state: State) -> State:
        state = run(state)
        patch = state.get("middle_patch")
        if patch is not None:
            state["tokens"] = patch(state["tokens"], transformer_index)
        return state
    return run_then_patch


def _per_level(name: str, value: int | tuple[int, ...], levels: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * levels
    if len(value) != levels:
        raise ValueError(f"{name} {tuple(value)} has {len(value)} entries; channel_mult has {levels} levels")
    return tuple(value)


# ---------------------------------------------------------------------------------------------- stages
# Each runner below is the body of one layer's forward (or part of it) with the same ops in the same
# order, so running the stages is bit-identical to calling the TimestepEmbedSequential blocks.


def block_stages(name: str, block: TimestepEmbedSequential, appends_skip: bool = False,
                  takes_skip: bool = False) -> list[Stage]:
    """The stages of one block's layers; an input block's last stage pushes the skip, an output block's
    first stage concatenates the popped skip (and keeps the upsample size when the block upsamples)."""
    stages = [stage for index, layer in enumerate(block) for stage in _layer_stages(f"{name}.{index}", layer)]
    if takes_skip:
        first = stages[0]
        upsamples = any(isinstance(layer, Upsample) for layer in block)
        stages[0] = Stage(first.name, first.modules, _taking_skip(first.run, upsamples))
    if appends_skip:
        last = stages[-1]
        stages[-1] = Stage(last.name, last.modules, _appending_skip(last.run))
    return stages


def _layer_stages(name: str, layer: nn.Module) -> list[Stage]:
    if isinstance(layer, ResBlock):
        return _resblock_stages(name, layer)
    if isinstance(layer, SpatialTransformer):
        return _transformer_stages(name, layer)
    if isinstance(layer, Upsample):
        return [Stage(name, (layer,), _upsample_runner(layer))]
    if isinstance(layer, Downsample | nn.Conv2d):
        return [Stage(name, (layer,), _plain_runner(layer))]
    raise TypeError(f"no stage runner for UNet layer {name!r} of type {type(layer).__name__}; "
                    "accepted: ResBlock, SpatialTransformer, Upsample, Downsample, Conv2d")


def _taking_skip(run: StageRun, keeps_upsample_size: bool) -> StageRun:
    def run_after_concatenating_skip(state: State) -> State:
        hs = state["hs"]
        h, skip = state["h"], with_control(hs.pop(), state, "output")
        for patch in state.get("output_block_patches", ()):
            h, skip = patch(h, skip)
        state["h"] = torch.cat([h, skip], dim=1)  # (B, C + C_skip, H, W)
        if keeps_upsample_size:
            # the size of the next skip, so an odd size survives upsampling
            state["upsample_size"] = tuple(hs[-1].shape[-2:]) if hs else None
        return run(state)
    return run_after_concatenating_skip


def _appending_skip(run: StageRun) -> StageRun:
    def run_then_append_skip(state: State) -> State:
        state = run(state)
        state["h"] = with_control(state["h"], state, "input")
        state["hs"].append(state["h"])
        return state
    return run_then_append_skip


def _adding_control(run: StageRun, kind: str) -> StageRun:
    def run_then_add_control(state: State) -> State:
        state = run(state)
        state["h"] = with_control(state["h"], state, kind)
        return state
    return run_then_add_control


def with_control(h: torch.Tensor, state: State, kind: str) -> torch.Tensor:
    """`h` plus the next residual of state["control"][kind] (taken from the list's end), as ComfyUI's
    apply_control: a None entry or an empty list adds nothing; a residual that does not broadcast to h's
    shape is dropped with a warning."""
    control = state.get("control")
    if not control or not control[kind]:
        return h
    residual = control[kind].pop()
    if residual is None:
        return h
    try:
        fits = torch.broadcast_shapes(h.shape, residual.shape) == h.shape
    except RuntimeError:
        fits = False
    if not fits:
        log.warning("control residual of shape %s does not fit the UNet's %s activation %s; not applied",
                    tuple(residual.shape), kind, tuple(h.shape))
        return h
    return h + residual.to(h.dtype)


def _plain_runner(layer: nn.Module) -> StageRun:
    def run(state: State) -> State:
        state["h"] = layer(state["h"])
        return state
    return run


def _upsample_runner(layer: Upsample) -> StageRun:
    def run(state: State) -> State:
        state["h"] = layer(state["h"], state.pop("upsample_size"))
        return state
    return run


def _resblock_stages(name: str, block: ResBlock) -> list[Stage]:
    """ResBlock.forward in two: the input half keeps the block input in "x_in" for the skip path."""
    in_layers, emb_layers = block.in_layers, block.emb_layers
    out_layers, skip_connection = block.out_layers, block.skip_connection

    def run_in(state: State) -> State:
        x = state["x_in"] = state["h"]
        h = in_layers(x)
        state["h"] = h + emb_layers(state["emb"])[:, :, None, None]  # (B, C, 1, 1) broadcast over H, W
        return state

    def run_out(state: State) -> State:
        state["h"] = skip_connection(state.pop("x_in")) + out_layers(state["h"])
        return state

    return [Stage(f"{name}.in", (in_layers, emb_layers), run_in),
            Stage(f"{name}.out", (out_layers, skip_connection), run_out)]


def _transformer_stages(name: str, transformer: SpatialTransformer) -> list[Stage]:
    """SpatialTransformer.forward as proj_in, four stages per transformer block, and proj_out."""
    norm, proj_in, proj_out = transformer.norm, transformer.proj_in, transformer.proj_out
    use_linear = transformer.use_linear

    def run_proj_in(state: State) -> State:
        x = state["residual"] = state.pop("h")
        h = norm(x)
        if not use_linear:
            h = proj_in(h)
        h = h.flatten(2).transpose(1, 2)  # (B, H*W, C)
        if use_linear:
            h = proj_in(h)
        state["tokens"] = h
        return state

    def run_proj_out(state: State) -> State:
        x, h = state.pop("residual"), state.pop("tokens")
        batch, _, height, width = x.shape
        if use_linear:
            h = proj_out(h)
        h = h.transpose(1, 2).reshape(batch, -1, height, width)  # (B, C, H, W)
        if not use_linear:
            h = proj_out(h)
        state["h"] = x + h
        return state

    stages = [Stage(f"{name}.proj_in", (norm, proj_in), run_proj_in)]
    for index, block in enumerate(transformer.transformer_blocks):
        stages += _transformer_block_stages(f"{name}.transformer_blocks.{index}", block)
    stages.append(Stage(f"{name}.proj_out", (proj_out,), run_proj_out))
    return stages


def _transformer_block_stages(name: str, block: BasicTransformerBlock) -> list[Stage]:
    """BasicTransformerBlock.forward as its three pre-norm residual steps over state["tokens"], the
    feed-forward in two (its GEGLU projection and its down-projection hold apart)."""
    norm1, attn1, norm2, attn2, norm3, ff = (block.norm1, block.attn1, block.norm2, block.attn2,
                                             block.norm3, block.ff)

    def run_attn1(state: State) -> State:
        x = state["tokens"]
        state["tokens"] = x + attn1(norm1(x))
        return state

    def run_attn2(state: State) -> State:
        x = state["tokens"]
        state["tokens"] = x + attn2(norm2(x), state["context"])
        return state

    def run_ff_geglu(state: State) -> State:
        state["ff_hidden"] = ff.geglu(norm3(state["tokens"]))
        return state

    def run_ff_out(state: State) -> State:
        state["tokens"] = state["tokens"] + ff.project_out(state.pop("ff_hidden"))
        return state

    return [Stage(f"{name}.attn1", (norm1, attn1), run_attn1),
            Stage(f"{name}.attn2", (norm2, attn2), run_attn2),
            Stage(f"{name}.ff.geglu", (norm3, ff.net[0]), run_ff_geglu),
            Stage(f"{name}.ff.out", (ff.net[2],), run_ff_out)]
