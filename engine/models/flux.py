"""The FLUX.1 transformer (Black Forest Labs 2024): a rectified-flow DiT of double- and single-stream blocks.

Parameter names are the keys of BFL's released files (and ComfyUI's) without their `model.diffusion_model.`
prefix, so a checkpoint binds directly (engine/models/weights.py); engine/models/flux_keys.py maps the
diffusers layout onto them. The forward pass is a list of stages (engine/models/staged.py): "embed" (the
image, timestep, pooled-text, guidance and text embedders and the RoPE table), two per double-stream block
("double_blocks.N.attn": modulations and joint attention, "double_blocks.N.mlp": the MLPs), two per
single-stream block ("single_blocks.N.in": modulation, linear1 and attention, "single_blocks.N.out":
linear2), then "final" (the last layer and unpatchify): half blocks let a tight budget double-buffer.
The state they share holds "img" (image tokens; from the first single block on, text and image tokens
joined), "txt" (text tokens, until joined; then "txt_len"), "vec" (the modulation vector), "pe" (the RoPE
rotations, shared by the batch), between two halves "img_mod2" / "txt_mod2" (the MLPs' modulation) or
"hidden" / "gate" (a single block's attention and MLP activations), and "size", "grid", "dtype" to put the
latent back together; the final stage leaves the velocity in "h".

Precision follows ComfyUI: activations run in the model's `dtype` (bf16 on a GPU); the q/k RMSNorms and
the rotary embedding compute in float32, the rotation angles in float64. The linear layers' weights may be
stored in another dtype (`weight_dtype`, e.g. float8_e4m3fn for fp8 files or ComfyUI's fp8 weight_dtype):
each layer casts its weight to the activations' dtype as it runs (ComfyUI's manual cast), so fp8 weights
take half the memory, and half the copy time when streamed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.staged import Stage, StagedModel, State, run_stages
from engine.models.unet import timestep_embedding

TIME_FACTOR = 1000.0  # sigma in [0, 1] -> the embedding's "timestep" (and the guidance scale likewise)
TIME_EMBED_DIM = 256  # width of the sinusoidal embedding of timesteps and guidance


@dataclass(frozen=True)
class FluxConfig:
    in_channels: int = 64  # width of an image token: 16 latent channels x 2 x 2 patch
    out_channels: int = 64  # width of an output token (the same patchified velocity)
    vec_in_dim: int = 768  # pooled CLIP-L text embedding
    context_in_dim: int = 4096  # T5-XXL token width
    hidden_size: int = 3072  # transformer width
    mlp_ratio: float = 4.0  # MLP hidden width / hidden_size
    num_heads: int = 24  # attention heads (head dim 128)
    depth: int = 19  # double-stream blocks (separate image and text weights, joint attention)
    depth_single_blocks: int = 38  # single-stream blocks (one set of weights over the joined tokens)
    axes_dim: tuple[int, ...] = (16, 56, 56)  # RoPE dims per axis (text index, row, col); sum: head dim
    theta: int = 10000  # RoPE base
    qkv_bias: bool = True  # the double blocks' qkv projections have biases
    guidance_embed: bool = True  # embeds a distilled guidance scale (dev: True, schnell: False)
    patch_size: int = 2  # latent pixels per token side

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def latent_channels(self) -> int:
        return self.in_channels // self.patch_size**2


def flux_dev_config() -> FluxConfig:
    """FLUX.1 [dev]: guidance-distilled."""
    return FluxConfig(guidance_embed=True)


def flux_schnell_config() -> FluxConfig:
    """FLUX.1 [schnell]: timestep-distilled, no guidance embedder."""
    return FluxConfig(guidance_embed=False)


def flux_axes_dim(head_dim: int) -> tuple[int, int, int]:
    """RoPE dims (text index, row, col) for a head dim: FLUX.1's (16, 56, 56) at 128; at other head dims the
    row and column axes each take 7/16 of it rounded down to even and the text axis the rest."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim; got {head_dim}")
    spatial = (head_dim * 7 // 16) // 2 * 2
    return (head_dim - 2 * spatial, spatial, spatial)


# ---------------------------------------------------------------------------------------------- layers


def flux_timestep_embedding(t: torch.Tensor) -> torch.Tensor:
    """(B,) sigma or guidance scale -> (B, 256) float32 sinusoidal embedding of t * 1000, cosines first."""
    return timestep_embedding(t.float() * TIME_FACTOR, TIME_EMBED_DIM)


def rope_table(ids: torch.Tensor, axes_dim: tuple[int, ...], theta: int) -> torch.Tensor:
    """(L, axes) token positions -> (L, head_dim / 2, 2, 2) float32 rotation of each channel pair: column 0
    is what x0 turns into, (cos, sin), column 1 what x1 turns into, (-sin, cos).

    Axis i's positions turn its axes_dim[i] / 2 channel pairs at frequencies theta^(-2j / axes_dim[i])
    (Su et al. 2021, per axis); the angles are computed in float64 where the device has it.
    """
    wide = torch.float32 if ids.device.type == "mps" else torch.float64
    angles = []
    for axis, dim in enumerate(axes_dim):
        omega = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=wide, device=ids.device) / dim)  # (dim / 2,)
        angles.append(ids[:, axis].to(wide)[:, None] * omega[None])  # (L, dim / 2)
    angle = torch.cat(angles, dim=-1)  # (L, head_dim / 2)
    cos, sin = angle.cos(), angle.sin()
    return torch.stack([cos, sin, -sin, cos], dim=-1).view(*angle.shape, 2, 2).transpose(-1, -2).float()


def apply_rope(x: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
    """Rotate each channel pair (x0, x1) of tokens-first x (B, L, H, D) by pe (L, D / 2, 2, 2), in float32:
    x0 * pe[..., 0] + x1 * pe[..., 1] in two passes (a product, then a fused multiply-add)."""
    pairs = x.float().unflatten(-1, (-1, 1, 2))  # (B, L, H, D / 2, 1, 2)
    rotation = pe[:, None]  # (L, 1, D / 2, 2, 2)
    rotated = rotation[..., 0] * pairs[..., 0]  # (B, L, H, D / 2, 2)
    return rotated.addcmul_(rotation[..., 1], pairs[..., 1]).flatten(-2)  # (B, L, H, D) float32


def joint_attention(streams: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                    pe: torch.Tensor) -> torch.Tensor:
    """Attention over the tokens of every stream, joined in order, RoPE on q and k -> (B, sum L, H * D).

    Each stream's q, k, v are tokens-first (B, L, H, D); the rotated q, k and the v of each stream are
    written once into joint buffers (no concatenation pass), which SDPA reads heads-first through a view.
    """
    batch, _, heads, head_dim = streams[0][2].shape
    total = sum(v.shape[1] for _, _, v in streams)
    like = streams[0][2]
    q_all, k_all, v_all = (like.new_empty(batch, total, heads, head_dim) for _ in range(3))
    start = 0
    for q, k, v in streams:
        rows = slice(start, start + v.shape[1])
        q_all[:, rows].copy_(apply_rope(q, pe[rows]))
        k_all[:, rows].copy_(apply_rope(k, pe[rows]))
        v_all[:, rows].copy_(v)
        start = rows.stop
    out = F.scaled_dot_product_attention(q_all.transpose(1, 2), k_all.transpose(1, 2),
                                         v_all.transpose(1, 2))  # (B, H, L, D)
    return out.transpose(1, 2).flatten(2)  # (B, L, H * D)


class CastLinear(nn.Linear):
    """nn.Linear whose stored weight (and bias) may have another dtype than its input: both are cast to the
    input's dtype for the product, a no-op when they already match."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


class MLPEmbedder(nn.Module):
    """Linear, SiLU, Linear: embeds a timestep, guidance or pooled-text vector to the model width."""

    def __init__(self, in_dim: int, hidden_dim: int, **factory):
        super().__init__()
        self.in_layer = CastLinear(in_dim, hidden_dim, **factory)
        self.out_layer = CastLinear(hidden_dim, hidden_dim, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), eps 1e-6, in the input's dtype as ComfyUI's."""

    def __init__(self, dim: int, **factory):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(dim, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.scale.shape, self.scale.to(x.dtype), 1e-6)  # float32 statistics inside


class QKNorm(nn.Module):
    """Separate RMSNorms of queries and keys per head."""

    def __init__(self, head_dim: int, **factory):
        super().__init__()
        self.query_norm = RMSNorm(head_dim, **factory)
        self.key_norm = RMSNorm(head_dim, **factory)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.query_norm(q), self.key_norm(k)


class SelfAttention(nn.Module):
    """One stream's qkv projection, q/k norms and output projection (the attention itself is joint)."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool, **factory):
        super().__init__()
        self.heads = heads
        self.qkv = CastLinear(dim, dim * 3, bias=qkv_bias, **factory)
        self.norm = QKNorm(dim // heads, **factory)
        self.proj = CastLinear(dim, dim, **factory)

    def qkv_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, L, C) -> normed q, k and v, each tokens-first (B, L, H, C / H)."""
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).unbind(2)
        q, k = self.norm(q, k)
        return q, k, v


class Modulation(nn.Module):
    """adaLN parameters from the vector: (shift, scale, gate) once, or twice for a double block."""

    def __init__(self, dim: int, double: bool, **factory):
        super().__init__()
        self.count = 6 if double else 3
        self.lin = CastLinear(dim, self.count * dim, **factory)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.lin(F.silu(vec))[:, None, :].chunk(self.count, dim=-1)  # each (B, 1, C)


def modulated_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """LayerNorm without affine (eps 1e-6), then (1 + scale) * . + shift; shift, scale (B, 1, C). For one
    batch item the modulation is the norm's own affine: one pass instead of three."""
    width = x.shape[-1]
    if x.shape[0] == 1:
        return F.layer_norm(x, (width,), (1 + scale).view(width), shift.view(width), 1e-6)
    return torch.addcmul(shift, F.layer_norm(x, (width,), eps=1e-6), 1 + scale)


def _clip_fp16(x: torch.Tensor) -> torch.Tensor:
    """Keep fp16 residuals finite, as BFL's and ComfyUI's blocks do."""
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


def _mlp(hidden_size: int, mlp_hidden: int, **factory) -> nn.Sequential:
    return nn.Sequential(CastLinear(hidden_size, mlp_hidden, **factory), nn.GELU(approximate="tanh"),
                         CastLinear(mlp_hidden, hidden_size, **factory))


class DoubleStreamBlock(nn.Module):
    """MM-DiT block (Esser et al. 2024): image and text keep their own weights and attend jointly. Its two
    halves (the attention with the modulations, then the MLPs) are stages of their own."""

    def __init__(self, config: FluxConfig, **factory):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_heads
        self.img_mod = Modulation(hidden, double=True, **factory)
        self.img_attn = SelfAttention(hidden, heads, config.qkv_bias, **factory)
        self.img_mlp = _mlp(hidden, config.mlp_hidden, **factory)
        self.txt_mod = Modulation(hidden, double=True, **factory)
        self.txt_attn = SelfAttention(hidden, heads, config.qkv_bias, **factory)
        self.txt_mlp = _mlp(hidden, config.mlp_hidden, **factory)

    def attention_half(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor, pe: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
        """img (B, L, C), txt (B, T, C), vec (B, C), pe (T + L, D / 2, 2, 2) -> img, txt after the joint
        attention, and each stream's MLP modulation (shift, scale, gate), each (B, 1, C)."""
        img_shift1, img_scale1, img_gate1, *img_mod2 = self.img_mod(vec)
        txt_shift1, txt_scale1, txt_gate1, *txt_mod2 = self.txt_mod(vec)
        img_qkv = self.img_attn.qkv_tokens(modulated_norm(img, img_shift1, img_scale1))
        txt_qkv = self.txt_attn.qkv_tokens(modulated_norm(txt, txt_shift1, txt_scale1))
        attn = joint_attention([txt_qkv, img_qkv], pe)  # (B, T + L, C), text first
        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1] :]
        img = torch.addcmul(img, img_gate1, self.img_attn.proj(img_attn))
        txt = torch.addcmul(txt, txt_gate1, self.txt_attn.proj(txt_attn))
        return img, txt, tuple(img_mod2), tuple(txt_mod2)

    def mlp_half(self, img: torch.Tensor, txt: torch.Tensor, img_mod2: tuple, txt_mod2: tuple,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        img_shift2, img_scale2, img_gate2 = img_mod2
        txt_shift2, txt_scale2, txt_gate2 = txt_mod2
        img = torch.addcmul(img, img_gate2, self.img_mlp(modulated_norm(img, img_shift2, img_scale2)))
        txt = torch.addcmul(txt, txt_gate2, self.txt_mlp(modulated_norm(txt, txt_shift2, txt_scale2)))
        return img, _clip_fp16(txt)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor,
                pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """img (B, L, C), txt (B, T, C), vec (B, C), pe (T + L, D / 2, 2, 2) -> new img, txt."""
        return self.mlp_half(*self.attention_half(img, txt, vec, pe))


class SingleStreamBlock(nn.Module):
    """Parallel attention and MLP over the joined tokens (Dehghani et al. 2023's ViT-22B block). Its two
    halves (modulation, linear1 and attention; then linear2) are stages of their own."""

    def __init__(self, config: FluxConfig, **factory):
        super().__init__()
        hidden = config.hidden_size
        self.heads = config.num_heads
        self.mlp_hidden = config.mlp_hidden
        self.linear1 = CastLinear(hidden, hidden * 3 + self.mlp_hidden, **factory)  # qkv and MLP in
        self.linear2 = CastLinear(hidden + self.mlp_hidden, hidden, **factory)  # attention out and MLP out
        self.norm = QKNorm(config.head_dim, **factory)
        self.modulation = Modulation(hidden, double=False, **factory)

    def in_half(self, x: torch.Tensor, vec: torch.Tensor, pe: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T + L, C), vec (B, C), pe (T + L, D / 2, 2, 2) -> (attention out ++ GELU of the MLP in,
        (B, T + L, C + mlp_hidden); the gate (B, 1, C))."""
        batch, length, hidden = x.shape
        shift, scale, gate = self.modulation(vec)
        qkv, mlp = self.linear1(modulated_norm(x, shift, scale)).split(
            [3 * hidden, self.mlp_hidden], dim=-1)  # (B, T + L, 3C), (B, T + L, mlp_hidden)
        q, k, v = qkv.view(batch, length, 3, self.heads, -1).unbind(2)  # each (B, T + L, H, D)
        q, k = self.norm(q, k)
        return torch.cat((joint_attention([(q, k, v)], pe), F.gelu(mlp, approximate="tanh")), dim=2), gate

    def out_half(self, x: torch.Tensor, hidden: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return _clip_fp16(torch.addcmul(x, gate, self.linear2(hidden)))

    def forward(self, x: torch.Tensor, vec: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        """x (B, T + L, C), vec (B, C), pe (T + L, D / 2, 2, 2) -> new x."""
        return self.out_half(x, *self.in_half(x, vec, pe))


class LastLayer(nn.Module):
    """adaLN (shift, scale) from the vector, then the projection to patchified output channels."""

    def __init__(self, hidden_size: int, out_channels: int, **factory):
        super().__init__()
        self.linear = CastLinear(hidden_size, out_channels, **factory)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), CastLinear(hidden_size, 2 * hidden_size, **factory))

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=1)  # each (B, C)
        return self.linear(modulated_norm(x, shift[:, None, :], scale[:, None, :]))


def pad_to_patches(x: torch.Tensor, patch: int) -> torch.Tensor:
    """Pad (B, C, H, W) at the bottom and right to multiples of `patch`, wrapping around (circular),
    as ComfyUI's common_dit.pad_to_patch_size does for FLUX."""
    pad_h, pad_w = -x.shape[-2] % patch, -x.shape[-1] % patch
    return F.pad(x, (0, pad_w, 0, pad_h), mode="circular") if pad_h or pad_w else x


def patchify(x: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, rows * p, cols * p) -> (B, rows * cols, C * p * p), channels outermost within a token."""
    batch, channels, height, width = x.shape
    x = x.view(batch, channels, height // patch, patch, width // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(batch, (height // patch) * (width // patch), -1)


def unpatchify(tokens: torch.Tensor, rows: int, cols: int, patch: int) -> torch.Tensor:
    """(B, rows * cols, C * p * p) -> (B, C, rows * p, cols * p); the inverse of patchify."""
    batch = tokens.shape[0]
    x = tokens.view(batch, rows, cols, -1, patch, patch)  # (B, rows, cols, C, p, p)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(batch, -1, rows * patch, cols * patch)


def token_positions(text_tokens: int, rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """(T + rows * cols, 3) positions: text tokens all at 0, image tokens at (0, row, col)."""
    grid = torch.zeros(rows, cols, 3, dtype=torch.float32, device=device)
    grid[..., 1] = torch.arange(rows, dtype=torch.float32, device=device)[:, None]
    grid[..., 2] = torch.arange(cols, dtype=torch.float32, device=device)[None, :]
    text = torch.zeros(text_tokens, 3, dtype=torch.float32, device=device)
    return torch.cat([text, grid.view(rows * cols, 3)])


# ---------------------------------------------------------------------------------------------- model


class FluxTransformer(StagedModel):
    """FLUX.1 dev/schnell; forward(x, timesteps, context, y, guidance) predicts the flow velocity."""

    def __init__(self, config: FluxConfig, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, weight_dtype: torch.dtype | None = None):
        super().__init__()
        _check_config(config)
        self.config = config
        self.dtype = dtype or torch.get_default_dtype()  # compute dtype of the activations
        self.weight_dtype = weight_dtype or self.dtype  # stored dtype of the linear layers (fp8: half)
        factory = {"dtype": self.dtype, "device": device}
        hidden = config.hidden_size
        self.img_in = CastLinear(config.in_channels, hidden, **factory)
        self.time_in = MLPEmbedder(TIME_EMBED_DIM, hidden, **factory)
        self.vector_in = MLPEmbedder(config.vec_in_dim, hidden, **factory)
        self.guidance_in = MLPEmbedder(TIME_EMBED_DIM, hidden, **factory) if config.guidance_embed else None
        self.txt_in = CastLinear(config.context_in_dim, hidden, **factory)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(config, **factory) for _ in range(config.depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(config, **factory)
                                           for _ in range(config.depth_single_blocks))
        self.final_layer = LastLayer(hidden, config.out_channels, **factory)
        if self.weight_dtype != self.dtype:
            for module in self.modules():
                if isinstance(module, CastLinear):
                    module.to(self.weight_dtype)

    def initial_state(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor, y: torch.Tensor,
                      guidance: torch.Tensor | None = None) -> State:
        """The first stage's state from the latent x (B, 16, h, w), flow sigmas (B,) in [0, 1], T5 tokens
        context (B, T, 4096), pooled CLIP-L y (B, 768) and, for dev, the guidance scale (B,)."""
        c = self.config
        if x.ndim != 4 or x.shape[1] != c.latent_channels:
            raise ValueError(f"FLUX takes a latent (B, {c.latent_channels}, h, w); got {tuple(x.shape)}")
        batch = x.shape[0]
        expected = {"timesteps": ((batch,), timesteps), "context": ((batch, None, c.context_in_dim), context),
                    "y": ((batch, c.vec_in_dim), y)}
        if c.guidance_embed:
            if guidance is None:
                raise ValueError("FLUX with a guidance embedder (dev) needs guidance: the distilled guidance "
                                 "scale per batch item, e.g. torch.full((B,), 3.5)")
            expected["guidance"] = ((batch,), guidance)
        for name, (shape, tensor) in expected.items():
            if tensor.ndim != len(shape) or any(
                    s is not None and s != n for s, n in zip(shape, tensor.shape, strict=True)):
                want = ", ".join("T" if s is None else str(s) for s in shape)
                raise ValueError(f"FLUX {name} must be ({want}) for a batch of {batch}; "
                                 f"got {tuple(tensor.shape)}")
        return {"x": x, "timesteps": timesteps, "context": context, "y": y,
                "guidance": guidance if c.guidance_embed else None}

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor, y: torch.Tensor,
                guidance: torch.Tensor | None = None) -> torch.Tensor:
        """The velocity (B, 16, h, w) in x's dtype."""
        return run_stages(self.stages(), self.initial_state(x, timesteps, context, y, guidance))["h"]

    def _build_stages(self) -> list[Stage]:
        embedders = [self.img_in, self.time_in, self.vector_in, self.txt_in]
        if self.guidance_in is not None:
            embedders.insert(3, self.guidance_in)
        stages = [Stage("embed", tuple(embedders), self._embed)]
        for i, block in enumerate(self.double_blocks):
            stages += [Stage(f"double_blocks.{i}.attn", (block.img_mod, block.txt_mod, block.img_attn,
                                                          block.txt_attn), _double_attention(block)),
                       Stage(f"double_blocks.{i}.mlp", (block.img_mlp, block.txt_mlp), _double_mlp(block))]
        for i, block in enumerate(self.single_blocks):
            stages += [Stage(f"single_blocks.{i}.in", (block.modulation, block.linear1, block.norm),
                             _single_in(block, joins_streams=i == 0)),
                       Stage(f"single_blocks.{i}.out", (block.linear2,), _single_out(block))]
        joined = len(self.single_blocks) > 0
        stages.append(Stage("final", (self.final_layer,), self._final_runner(joined)))
        return stages

    def _embed(self, state: State) -> State:
        c = self.config
        x = state.pop("x")
        state["size"], state["dtype"] = tuple(x.shape[-2:]), x.dtype
        x = pad_to_patches(x.to(self.dtype), c.patch_size)
        rows, cols = x.shape[-2] // c.patch_size, x.shape[-1] // c.patch_size
        state["grid"] = (rows, cols)
        state["img"] = self.img_in(patchify(x, c.patch_size))  # (B, rows * cols, C)
        vec = self.time_in(flux_timestep_embedding(state.pop("timesteps")).to(self.dtype))  # (B, C)
        guidance = state.pop("guidance")
        if self.guidance_in is not None:
            vec = vec + self.guidance_in(flux_timestep_embedding(guidance).to(self.dtype))
        state["vec"] = vec + self.vector_in(state.pop("y").to(self.dtype))
        context = state.pop("context")
        state["txt"] = self.txt_in(context.to(self.dtype))  # (B, T, C)
        positions = token_positions(context.shape[1], rows, cols, x.device)  # (T + rows * cols, 3)
        state["pe"] = rope_table(positions, c.axes_dim, c.theta)  # (T + rows * cols, D / 2, 2, 2)
        return state

    def _final_runner(self, joined: bool) -> Callable[[State], State]:
        final_layer, patch = self.final_layer, self.config.patch_size

        def run(state: State) -> State:
            img = state.pop("img")
            if joined:
                img = img[:, state.pop("txt_len") :]  # (B, rows * cols, C): drop the text tokens
            else:
                state.pop("txt")
            del state["pe"]
            rows, cols = state.pop("grid")
            height, width = state.pop("size")
            out = unpatchify(final_layer(img, state.pop("vec")), rows, cols, patch)  # (B, 16, 2 rows, 2 cols)
            state["h"] = out[:, :, :height, :width].to(state.pop("dtype"))
            return state
        return run


def _double_attention(block: DoubleStreamBlock) -> Callable[[State], State]:
    def run(state: State) -> State:
        state["img"], state["txt"], state["img_mod2"], state["txt_mod2"] = block.attention_half(
            state["img"], state["txt"], state["vec"], state["pe"])
        return state
    return run


def _double_mlp(block: DoubleStreamBlock) -> Callable[[State], State]:
    def run(state: State) -> State:
        state["img"], state["txt"] = block.mlp_half(state["img"], state["txt"], state.pop("img_mod2"),
                                                    state.pop("txt_mod2"))
        return state
    return run


def _single_in(block: SingleStreamBlock, joins_streams: bool) -> Callable[[State], State]:
    """A single block's first half; the first one joins the text and image tokens (text first)."""
    def run(state: State) -> State:
        if joins_streams:
            txt = state.pop("txt")
            state["txt_len"] = txt.shape[1]
            state["img"] = torch.cat((txt, state["img"]), dim=1)  # (B, T + L, C)
        state["hidden"], state["gate"] = block.in_half(state["img"], state["vec"], state["pe"])
        return state
    return run


def _single_out(block: SingleStreamBlock) -> Callable[[State], State]:
    def run(state: State) -> State:
        state["img"] = block.out_half(state["img"], state.pop("hidden"), state.pop("gate"))
        return state
    return run


def _check_config(config: FluxConfig) -> None:
    if config.hidden_size % config.num_heads:
        raise ValueError(f"FLUX hidden_size {config.hidden_size} is not divisible by "
                         f"num_heads {config.num_heads}")
    if sum(config.axes_dim) != config.head_dim or any(d % 2 for d in config.axes_dim):
        raise ValueError(f"FLUX axes_dim {tuple(config.axes_dim)} must be even dims summing to the head "
                         f"dim {config.head_dim} (hidden_size {config.hidden_size} / num_heads "
                         f"{config.num_heads})")
    if config.in_channels % config.patch_size**2 or config.out_channels != config.in_channels:
        raise ValueError(f"FLUX in_channels {config.in_channels} must be latent channels x patch_size^2 "
                         f"({config.patch_size}^2) and equal out_channels ({config.out_channels})")


# ---------------------------------------------------------------------------------------------- shapes


def flux_config_from_shapes(shapes: Mapping[str, tuple[int, ...]], prefix: str = "") -> FluxConfig:
    """The FluxConfig of a BFL-layout file from its tensor shapes (keys under `prefix`).

    Widths come from img_in, txt_in, vector_in, final_layer and the first block's MLP; the depths from
    counting the blocks; guidance_embed and qkv_bias from the presence of guidance_in and qkv biases. The
    head dim is the length of the q/k RMSNorm scales, so num_heads = hidden_size / head dim; axes_dim is
    FLUX.1's (16, 56, 56) at head dim 128 and flux_axes_dim's rule elsewhere. Theta and patch size are
    FLUX.1's (shapes cannot tell them). Every tensor the config implies must be present with its shape.
    """
    where = f" under prefix {prefix!r}" if prefix else ""

    def shape(name: str) -> tuple[int, ...]:
        if prefix + name not in shapes:
            found = ", ".join(sorted(shapes)[:3]) or "nothing"
            raise ValueError(f"a FLUX file needs {prefix + name!r}{where}; found {found}, ...")
        return tuple(shapes[prefix + name])

    hidden, in_channels = shape("img_in.weight")
    context_in_dim = shape("txt_in.weight")[1]
    vec_in_dim = shape("vector_in.in_layer.weight")[1]
    depth = _block_count(shapes, prefix, "double_blocks")
    depth_single = _block_count(shapes, prefix, "single_blocks")
    if depth:
        mlp_hidden = shape("double_blocks.0.img_mlp.0.weight")[0]
        head_dim = shape("double_blocks.0.img_attn.norm.query_norm.scale")[0]
    elif depth_single:
        mlp_hidden = shape("single_blocks.0.linear1.weight")[0] - 3 * hidden
        head_dim = shape("single_blocks.0.norm.query_norm.scale")[0]
    else:
        raise ValueError(f"a FLUX file needs double_blocks.N and single_blocks.N tensors{where}; found none")
    if hidden % head_dim:
        raise ValueError(f"FLUX hidden size {hidden} (img_in) is not a multiple of the head dim {head_dim} "
                         f"(the q/k norm scales){where}")
    config = FluxConfig(
        in_channels=in_channels, out_channels=shape("final_layer.linear.weight")[0], vec_in_dim=vec_in_dim,
        context_in_dim=context_in_dim, hidden_size=hidden, mlp_ratio=mlp_hidden / hidden,
        num_heads=hidden // head_dim, depth=depth, depth_single_blocks=depth_single,
        axes_dim=flux_axes_dim(head_dim), qkv_bias=prefix + "double_blocks.0.img_attn.qkv.bias" in shapes,
        guidance_embed=prefix + "guidance_in.in_layer.weight" in shapes)
    _check_shapes(config, shapes, prefix)
    return config


def _block_count(shapes: Mapping[str, tuple[int, ...]], prefix: str, root: str) -> int:
    """How many blocks `root`.N there are; the indices must run from 0 without a gap."""
    pattern = re.compile(re.escape(f"{prefix}{root}.") + r"(\d+)\.")
    indices = {int(m.group(1)) for key in shapes if (m := pattern.match(key))}
    missing = sorted(set(range(max(indices, default=-1) + 1)) - indices)
    if missing:
        raise ValueError(f"a FLUX file numbers its {root} 0..{max(indices)} without gaps; "
                         f"block {prefix}{root}.{missing[0]} is missing"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return len(indices)


def _check_shapes(config: FluxConfig, shapes: Mapping[str, tuple[int, ...]], prefix: str) -> None:
    """Every parameter of the model the config describes must be in `shapes` with its shape."""
    expected = {name: tuple(p.shape) for name, p in FluxTransformer(config, device="meta").named_parameters()}
    problems = []
    for name, want in expected.items():
        if prefix + name not in shapes:
            problems.append(f"{prefix + name} is missing")
        elif tuple(shapes[prefix + name]) != want:
            problems.append(f"{prefix + name} has shape {tuple(shapes[prefix + name])}, expected {want}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"not a complete FLUX transformer (hidden {config.hidden_size}, {config.depth} "
                         f"double and {config.depth_single_blocks} single blocks): "
                         f"{'; '.join(problems[:3])}{more}")
