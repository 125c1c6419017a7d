"""Test helper: key/shape tables and random-weight single-file checkpoints in SD1.5 / SD2.1 / SDXL layout.

The layouts follow the original LDM/SGM modules (openaimodel.UNetModel, ldm Encoder/Decoder, HF CLIPTextModel,
open_clip TextTransformer) and are checked against diffusers' single-file converters in
test_model_detection.py. This module does not import engine.models.detect: it is an independent reference.

    write_checkpoint(path, "sd1", size="tiny", fmt="safetensors")        # all three components
    write_checkpoint(path, "sdxl", fmt="gguf", components=("diffusion",))  # bare-key diffusion-only file
    checkpoint_shapes("sdxl", size="full")                                 # {key: shape}, no data
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

FAMILIES = ("sd1", "sd2", "sdxl", "sdxl_refiner")
SIZES = ("tiny", "small", "full")
FORMATS = ("safetensors", "ckpt", "gguf")
COMPONENTS = ("diffusion", "te", "vae")


@dataclass(frozen=True)
class UNetSpec:
    model_channels: int
    channel_mult: tuple[int, ...]
    num_res_blocks: int
    transformer_depth: tuple[int, ...]  # per level, 0 = no attention
    transformer_depth_middle: int
    context_dim: int
    use_linear: bool
    adm_in_channels: int | None
    in_channels: int = 4
    out_channels: int = 4


@dataclass(frozen=True)
class VAESpec:
    ch: int
    ch_mult: tuple[int, ...]
    num_res_blocks: int
    z_channels: int = 4
    embed_dim: int = 4
    in_channels: int = 3
    out_ch: int = 3


@dataclass(frozen=True)
class TextSpec:
    layout: str  # "hf" or "open_clip"
    prefix: str  # key prefix of the text model (HF: ends in "text_model.")
    width: int
    layers: int
    intermediate: int
    projection_dim: int | None
    vocab_size: int = 49408
    max_positions: int = 77


@dataclass(frozen=True)
class FamilySpec:
    unet: UNetSpec
    vae: VAESpec
    text: tuple[TextSpec, ...]


SD1_TE = "cond_stage_model.transformer.text_model."
SD2_TE = "cond_stage_model.model."
XL_TE_L = "conditioner.embedders.0.transformer.text_model."
XL_TE_G = "conditioner.embedders.1.model."
REFINER_TE_G = "conditioner.embedders.0.model."


def _family_specs(size: str) -> dict[str, FamilySpec]:
    if size == "full":
        vae = VAESpec(128, (1, 2, 4, 4), 2)
        clip_l = (768, 12, 3072)
        clip_h = (1024, 24, 4096)
        clip_g = (1280, 32, 5120)
        sd_unet = dict(
            model_channels=320,
            channel_mult=(1, 2, 4, 4),
            num_res_blocks=2,
            transformer_depth=(1, 1, 1, 0),
            transformer_depth_middle=1,
        )
        xl_unet = dict(
            model_channels=320,
            channel_mult=(1, 2, 4),
            num_res_blocks=2,
            transformer_depth=(0, 2, 10),
            transformer_depth_middle=10,
        )
        refiner_unet = dict(
            model_channels=384,
            channel_mult=(1, 2, 4, 4),
            num_res_blocks=2,
            transformer_depth=(0, 4, 4, 0),
            transformer_depth_middle=4,
        )
    else:
        scale = 1 if size == "tiny" else 2
        vae = VAESpec(32 * scale, (1, 2), 1)
        clip_l = (64 * scale, 2, 128 * scale)
        clip_h = (64 * scale, 2, 128 * scale)
        clip_g = (128 * scale, 2, 256 * scale)
        sd_unet = dict(
            model_channels=64 * scale,
            channel_mult=(1, 2),
            num_res_blocks=1,
            transformer_depth=(1, 1),
            transformer_depth_middle=1,
        )
        xl_unet = dict(
            model_channels=64 * scale,
            channel_mult=(1, 2),
            num_res_blocks=1,
            transformer_depth=(0, 2),
            transformer_depth_middle=2,
        )
        refiner_unet = xl_unet
    pooled_g = clip_g[
        0
    ]  # SDXL's ADM vector: pooled OpenCLIP-G output + 256-wide Fourier size/crop embeddings
    return {
        "sd1": FamilySpec(
            UNetSpec(**sd_unet, context_dim=clip_l[0], use_linear=False, adm_in_channels=None),
            vae,
            (TextSpec("hf", SD1_TE, *clip_l, projection_dim=None),),
        ),
        "sd2": FamilySpec(
            UNetSpec(**sd_unet, context_dim=clip_h[0], use_linear=True, adm_in_channels=None),
            vae,
            (TextSpec("open_clip", SD2_TE, *clip_h, projection_dim=clip_h[0]),),
        ),
        "sdxl": FamilySpec(
            UNetSpec(
                **xl_unet,
                context_dim=clip_l[0] + clip_g[0],
                use_linear=True,
                adm_in_channels=pooled_g + 6 * 256,
            ),
            vae,
            (
                TextSpec("hf", XL_TE_L, *clip_l, projection_dim=None),
                TextSpec("open_clip", XL_TE_G, *clip_g, projection_dim=clip_g[0]),
            ),
        ),
        "sdxl_refiner": FamilySpec(
            UNetSpec(
                **refiner_unet, context_dim=clip_g[0], use_linear=True, adm_in_channels=pooled_g + 5 * 256
            ),
            vae,
            (TextSpec("open_clip", REFINER_TE_G, *clip_g, projection_dim=clip_g[0]),),
        ),
    }


def family_spec(family: str, size: str = "tiny") -> FamilySpec:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; accepted: {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; accepted: {', '.join(SIZES)}")
    return _family_specs(size)[family]


# ---------------------------------------------------------------- key/shape tables (LDM layout)

Shapes = dict[str, tuple[int, ...]]


def _resblock(p: str, cin: int, cout: int, emb: int | None) -> Shapes:
    """openaimodel.ResBlock (emb given) or the ldm VAE ResnetBlock (emb None)."""
    if emb is None:
        s = {
            f"{p}norm1.weight": (cin,),
            f"{p}norm1.bias": (cin,),
            f"{p}conv1.weight": (cout, cin, 3, 3),
            f"{p}conv1.bias": (cout,),
            f"{p}norm2.weight": (cout,),
            f"{p}norm2.bias": (cout,),
            f"{p}conv2.weight": (cout, cout, 3, 3),
            f"{p}conv2.bias": (cout,),
        }
        if cin != cout:
            s |= {f"{p}nin_shortcut.weight": (cout, cin, 1, 1), f"{p}nin_shortcut.bias": (cout,)}
        return s
    s = {
        f"{p}in_layers.0.weight": (cin,),
        f"{p}in_layers.0.bias": (cin,),
        f"{p}in_layers.2.weight": (cout, cin, 3, 3),
        f"{p}in_layers.2.bias": (cout,),
        f"{p}emb_layers.1.weight": (cout, emb),
        f"{p}emb_layers.1.bias": (cout,),
        f"{p}out_layers.0.weight": (cout,),
        f"{p}out_layers.0.bias": (cout,),
        f"{p}out_layers.3.weight": (cout, cout, 3, 3),
        f"{p}out_layers.3.bias": (cout,),
    }
    if cin != cout:
        s |= {f"{p}skip_connection.weight": (cout, cin, 1, 1), f"{p}skip_connection.bias": (cout,)}
    return s


def _spatial_transformer(p: str, ch: int, depth: int, context: int, linear: bool) -> Shapes:
    proj = (ch, ch) if linear else (ch, ch, 1, 1)
    s = {
        f"{p}norm.weight": (ch,),
        f"{p}norm.bias": (ch,),
        f"{p}proj_in.weight": proj,
        f"{p}proj_in.bias": (ch,),
        f"{p}proj_out.weight": proj,
        f"{p}proj_out.bias": (ch,),
    }
    for d in range(depth):
        b = f"{p}transformer_blocks.{d}."
        for attn, kv_dim in (("attn1", ch), ("attn2", context)):
            s |= {
                f"{b}{attn}.to_q.weight": (ch, ch),
                f"{b}{attn}.to_k.weight": (ch, kv_dim),
                f"{b}{attn}.to_v.weight": (ch, kv_dim),
                f"{b}{attn}.to_out.0.weight": (ch, ch),
                f"{b}{attn}.to_out.0.bias": (ch,),
            }
        s |= {
            f"{b}ff.net.0.proj.weight": (8 * ch, ch),
            f"{b}ff.net.0.proj.bias": (8 * ch,),  # GEGLU
            f"{b}ff.net.2.weight": (ch, 4 * ch),
            f"{b}ff.net.2.bias": (ch,),
        }
        for n in (1, 2, 3):
            s |= {f"{b}norm{n}.weight": (ch,), f"{b}norm{n}.bias": (ch,)}
    return s


def unet_shapes(u: UNetSpec, prefix: str = "model.diffusion_model.") -> Shapes:
    """Keys of openaimodel.UNetModel (LDM/SGM) with the given hyper-parameters."""
    mc, emb = u.model_channels, 4 * u.model_channels
    s: Shapes = {
        f"{prefix}time_embed.0.weight": (emb, mc),
        f"{prefix}time_embed.0.bias": (emb,),
        f"{prefix}time_embed.2.weight": (emb, emb),
        f"{prefix}time_embed.2.bias": (emb,),
    }
    if u.adm_in_channels is not None:
        s |= {
            f"{prefix}label_emb.0.0.weight": (emb, u.adm_in_channels),
            f"{prefix}label_emb.0.0.bias": (emb,),
            f"{prefix}label_emb.0.2.weight": (emb, emb),
            f"{prefix}label_emb.0.2.bias": (emb,),
        }
    s |= {
        f"{prefix}input_blocks.0.0.weight": (mc, u.in_channels, 3, 3),
        f"{prefix}input_blocks.0.0.bias": (mc,),
    }
    skip_chans, ch, index = [mc], mc, 1
    for level, mult in enumerate(u.channel_mult):
        for _ in range(u.num_res_blocks):
            p = f"{prefix}input_blocks.{index}."
            s |= _resblock(f"{p}0.", ch, mult * mc, emb)
            ch = mult * mc
            if u.transformer_depth[level]:
                s |= _spatial_transformer(
                    f"{p}1.", ch, u.transformer_depth[level], u.context_dim, u.use_linear
                )
            skip_chans.append(ch)
            index += 1
        if level != len(u.channel_mult) - 1:
            s |= {
                f"{prefix}input_blocks.{index}.0.op.weight": (ch, ch, 3, 3),
                f"{prefix}input_blocks.{index}.0.op.bias": (ch,),
            }
            skip_chans.append(ch)
            index += 1
    s |= _resblock(f"{prefix}middle_block.0.", ch, ch, emb)
    s |= _spatial_transformer(
        f"{prefix}middle_block.1.", ch, u.transformer_depth_middle, u.context_dim, u.use_linear
    )
    s |= _resblock(f"{prefix}middle_block.2.", ch, ch, emb)
    index = 0
    for level, mult in reversed(list(enumerate(u.channel_mult))):
        for i in range(u.num_res_blocks + 1):
            p = f"{prefix}output_blocks.{index}."
            s |= _resblock(f"{p}0.", ch + skip_chans.pop(), mult * mc, emb)
            ch, sub = mult * mc, 1
            if u.transformer_depth[level]:
                s |= _spatial_transformer(
                    f"{p}1.", ch, u.transformer_depth[level], u.context_dim, u.use_linear
                )
                sub = 2
            if level and i == u.num_res_blocks:
                s |= {f"{p}{sub}.conv.weight": (ch, ch, 3, 3), f"{p}{sub}.conv.bias": (ch,)}
            index += 1
    s |= {
        f"{prefix}out.0.weight": (mc,),
        f"{prefix}out.0.bias": (mc,),
        f"{prefix}out.2.weight": (u.out_channels, mc, 3, 3),
        f"{prefix}out.2.bias": (u.out_channels,),
    }
    return s


def _vae_attention(p: str, ch: int) -> Shapes:
    s = {f"{p}norm.weight": (ch,), f"{p}norm.bias": (ch,)}
    for n in ("q", "k", "v", "proj_out"):
        s |= {f"{p}{n}.weight": (ch, ch, 1, 1), f"{p}{n}.bias": (ch,)}
    return s


def vae_shapes(v: VAESpec, prefix: str = "first_stage_model.") -> Shapes:
    """Keys of ldm AutoencoderKL (Encoder, Decoder, quant_conv, post_quant_conv)."""
    e, d = f"{prefix}encoder.", f"{prefix}decoder."
    s: Shapes = {f"{e}conv_in.weight": (v.ch, v.in_channels, 3, 3), f"{e}conv_in.bias": (v.ch,)}
    block_in = v.ch
    for level, mult in enumerate(v.ch_mult):
        for j in range(v.num_res_blocks):
            s |= _resblock(f"{e}down.{level}.block.{j}.", block_in, v.ch * mult, None)
            block_in = v.ch * mult
        if level != len(v.ch_mult) - 1:
            s |= {
                f"{e}down.{level}.downsample.conv.weight": (block_in, block_in, 3, 3),
                f"{e}down.{level}.downsample.conv.bias": (block_in,),
            }
    for part in (e, d):
        c = v.ch * v.ch_mult[-1]
        s |= _resblock(f"{part}mid.block_1.", c, c, None) | _vae_attention(f"{part}mid.attn_1.", c)
        s |= _resblock(f"{part}mid.block_2.", c, c, None)
    s |= {
        f"{e}norm_out.weight": (block_in,),
        f"{e}norm_out.bias": (block_in,),
        f"{e}conv_out.weight": (2 * v.z_channels, block_in, 3, 3),
        f"{e}conv_out.bias": (2 * v.z_channels,),
        f"{prefix}quant_conv.weight": (2 * v.embed_dim, 2 * v.z_channels, 1, 1),
        f"{prefix}quant_conv.bias": (2 * v.embed_dim,),
        f"{prefix}post_quant_conv.weight": (v.z_channels, v.embed_dim, 1, 1),
        f"{prefix}post_quant_conv.bias": (v.z_channels,),
    }
    block_in = v.ch * v.ch_mult[-1]
    s |= {f"{d}conv_in.weight": (block_in, v.z_channels, 3, 3), f"{d}conv_in.bias": (block_in,)}
    for level in reversed(range(len(v.ch_mult))):
        for j in range(v.num_res_blocks + 1):
            s |= _resblock(f"{d}up.{level}.block.{j}.", block_in, v.ch * v.ch_mult[level], None)
            block_in = v.ch * v.ch_mult[level]
        if level != 0:
            s |= {
                f"{d}up.{level}.upsample.conv.weight": (block_in, block_in, 3, 3),
                f"{d}up.{level}.upsample.conv.bias": (block_in,),
            }
    s |= {
        f"{d}norm_out.weight": (block_in,),
        f"{d}norm_out.bias": (block_in,),
        f"{d}conv_out.weight": (v.out_ch, block_in, 3, 3),
        f"{d}conv_out.bias": (v.out_ch,),
    }
    return s


def text_shapes(t: TextSpec, prefix: str | None = None) -> Shapes:
    """Keys of HF CLIPTextModel(WithProjection) or of open_clip's text tower, under `prefix`."""
    p = t.prefix if prefix is None else prefix
    w, i = t.width, t.intermediate
    if t.layout == "hf":
        s: Shapes = {
            f"{p}embeddings.token_embedding.weight": (t.vocab_size, w),
            f"{p}embeddings.position_embedding.weight": (t.max_positions, w),
        }
        for n in range(t.layers):
            b = f"{p}encoder.layers.{n}."
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                s |= {f"{b}self_attn.{proj}.weight": (w, w), f"{b}self_attn.{proj}.bias": (w,)}
            s |= {
                f"{b}layer_norm1.weight": (w,),
                f"{b}layer_norm1.bias": (w,),
                f"{b}layer_norm2.weight": (w,),
                f"{b}layer_norm2.bias": (w,),
                f"{b}mlp.fc1.weight": (i, w),
                f"{b}mlp.fc1.bias": (i,),
                f"{b}mlp.fc2.weight": (w, i),
                f"{b}mlp.fc2.bias": (w,),
            }
        s |= {f"{p}final_layer_norm.weight": (w,), f"{p}final_layer_norm.bias": (w,)}
        if t.projection_dim is not None:
            s[f"{p.removesuffix('text_model.')}text_projection.weight"] = (t.projection_dim, w)
        return s
    s = {f"{p}token_embedding.weight": (t.vocab_size, w), f"{p}positional_embedding": (t.max_positions, w)}
    for n in range(t.layers):
        b = f"{p}transformer.resblocks.{n}."
        s |= {
            f"{b}ln_1.weight": (w,),
            f"{b}ln_1.bias": (w,),
            f"{b}attn.in_proj_weight": (3 * w, w),
            f"{b}attn.in_proj_bias": (3 * w,),
            f"{b}attn.out_proj.weight": (w, w),
            f"{b}attn.out_proj.bias": (w,),
            f"{b}ln_2.weight": (w,),
            f"{b}ln_2.bias": (w,),
            f"{b}mlp.c_fc.weight": (i, w),
            f"{b}mlp.c_fc.bias": (i,),
            f"{b}mlp.c_proj.weight": (w, i),
            f"{b}mlp.c_proj.bias": (w,),
        }
    s |= {f"{p}ln_final.weight": (w,), f"{p}ln_final.bias": (w,)}
    if t.projection_dim is not None:
        s[f"{p}text_projection"] = (w, t.projection_dim)  # open_clip multiplies x @ text_projection
    return s


def checkpoint_shapes(family: str, size: str = "tiny", components: Iterable[str] = COMPONENTS) -> Shapes:
    """{key: shape} of a checkpoint; one component alone gets the bare keys of a split file."""
    components = tuple(components)
    unknown = [c for c in components if c not in COMPONENTS]
    if unknown or not components:
        raise ValueError(f"unknown components {unknown}; accepted: {', '.join(COMPONENTS)}")
    spec = family_spec(family, size)
    split = len(components) == 1
    shapes: Shapes = {}
    if "diffusion" in components:
        shapes |= unet_shapes(spec.unet, "" if split else "model.diffusion_model.")
    if "te" in components:
        for text in spec.text:
            bare = "text_model." if text.layout == "hf" else ""
            shapes |= text_shapes(text, bare if split and len(spec.text) == 1 else None)
    if "vae" in components:
        shapes |= vae_shapes(spec.vae, "" if split else "first_stage_model.")
    return shapes


# ---------------------------------------------------------------- writing files


def random_state_dict(
    shapes: Shapes, dtype: torch.dtype = torch.float32, seed: int = 0
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(s, generator=generator) * 0.05).to(dtype) for k, s in shapes.items()}


def save_state_dict(
    path: str | os.PathLike[str],
    state: dict[str, torch.Tensor],
    fmt: str,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write `state` as safetensors, a torch zip checkpoint (wrapped in "state_dict") or GGUF."""
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path), metadata=metadata)
    elif fmt == "ckpt":
        torch.save({"state_dict": state, "global_step": 1}, path)
    elif fmt == "gguf":
        import gguf

        writer = gguf.GGUFWriter(str(path), arch="sd")
        for key, value in (metadata or {}).items():
            writer.add_string(key, value)
        for key, tensor in state.items():
            if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: hand gguf the raw bytes
                raw = tensor.contiguous().view(torch.int16).numpy().view("uint8")
                writer.add_tensor(key, raw, raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                writer.add_tensor(key, tensor.contiguous().numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    else:
        raise ValueError(f"unknown format {fmt!r}; accepted: {', '.join(FORMATS)}")


def write_checkpoint(
    path: str | os.PathLike[str],
    family: str,
    size: str = "tiny",
    fmt: str = "safetensors",
    components: Iterable[str] = COMPONENTS,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    metadata: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Write a random-weight checkpoint of `family` in its original single-file layout; return the tensors."""
    state = random_state_dict(checkpoint_shapes(family, size, components), dtype, seed)
    save_state_dict(path, state, fmt, metadata)
    return state
