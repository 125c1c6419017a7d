"""Test helper: tiny random CLIP vision towers (transformers' CLIPVisionModelWithProjection) and their weights
in open_clip's layout, and a tiny SD2.1 unCLIP checkpoint (sd2 layout, a UNet with label_emb, the image
embedder's open_clip tower under `embedder.model.visual.`).

The open_clip names are written by hand from open_clip's VisionTransformer modules, not from Sluice's map.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from transformers import CLIPVisionConfig as HFConfig
from transformers import CLIPVisionModelWithProjection

from engine.models.clip_vision import CLIPVisionConfig
from tests.engine.models import sd_checkpoints

WIDTH, LAYERS, HEADS, PROJECTION, IMAGE, PATCH = 32, 3, 4, 24, 28, 7


def reference(activation: str = "quick_gelu", seed: int = 0) -> CLIPVisionModelWithProjection:
    torch.manual_seed(seed)
    config = HFConfig(hidden_size=WIDTH, intermediate_size=48, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, projection_dim=PROJECTION, image_size=IMAGE,
                      patch_size=PATCH, hidden_act=activation, layer_norm_eps=1e-5)
    model = CLIPVisionModelWithProjection(config).eval()
    with torch.no_grad():  # random LayerNorm affine and class token: defaults (1, 0) would hide swaps
        for name, parameter in model.named_parameters():
            if "layer_norm" in name or "layrnorm" in name or "class_embedding" in name:
                parameter.normal_(0.0 if name.endswith("bias") else 1.0, 0.2)
    return model


def ours_config(activation: str = "quick_gelu") -> CLIPVisionConfig:
    return CLIPVisionConfig("custom", WIDTH, LAYERS, HEADS, 48, PROJECTION, activation, IMAGE, PATCH)


def hf_state(model: CLIPVisionModelWithProjection) -> dict[str, torch.Tensor]:
    return {key: value.contiguous() for key, value in model.state_dict().items()}


def open_clip_state(model: CLIPVisionModelWithProjection, prefix: str) -> dict[str, torch.Tensor]:
    """The same weights as open_clip's VisionTransformer names them (written by hand from open_clip's
    module names, not from our map)."""
    sd = model.state_dict()
    v = "vision_model."
    out = {
        "class_embedding": sd[v + "embeddings.class_embedding"],
        "conv1.weight": sd[v + "embeddings.patch_embedding.weight"],
        "positional_embedding": sd[v + "embeddings.position_embedding.weight"],
        "ln_pre.weight": sd[v + "pre_layrnorm.weight"], "ln_pre.bias": sd[v + "pre_layrnorm.bias"],
        "ln_post.weight": sd[v + "post_layernorm.weight"], "ln_post.bias": sd[v + "post_layernorm.bias"],
        "proj": sd["visual_projection.weight"].t(),
    }
    for i in range(LAYERS):
        layer, block = f"{v}encoder.layers.{i}.", f"transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{block}ln_1.{kind}"] = sd[f"{layer}layer_norm1.{kind}"]
            out[f"{block}ln_2.{kind}"] = sd[f"{layer}layer_norm2.{kind}"]
            out[f"{block}attn.out_proj.{kind}"] = sd[f"{layer}self_attn.out_proj.{kind}"]
            out[f"{block}mlp.c_fc.{kind}"] = sd[f"{layer}mlp.fc1.{kind}"]
            out[f"{block}mlp.c_proj.{kind}"] = sd[f"{layer}mlp.fc2.{kind}"]
            out[f"{block}attn.in_proj_{kind}"] = torch.cat(
                [sd[f"{layer}self_attn.{p}_proj.{kind}"] for p in ("q", "k", "v")])
    return {prefix + key: value.contiguous() for key, value in out.items()}



UNCLIP_VISION_PREFIX = "embedder.model.visual."
UNCLIP_METADATA = {"sluice.num_heads": str(HEADS), "sluice.activation": "gelu"}  # a tiny tower's custom width


def write_unclip_checkpoint(path: str | os.PathLike[str], seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny SD2.1 unCLIP checkpoint: the tiny sd2 family with a UNet taking a 2 * PROJECTION wide y, and
    a ViT image embedder (gelu) under UNCLIP_VISION_PREFIX."""
    spec = sd_checkpoints.family_spec("sd2")
    unet = dataclasses.replace(spec.unet, adm_in_channels=2 * PROJECTION)
    shapes = {**sd_checkpoints.unet_shapes(unet), **sd_checkpoints.vae_shapes(spec.vae)}
    for text in spec.text:
        shapes |= sd_checkpoints.text_shapes(text)
    state = sd_checkpoints.random_state_dict(shapes, seed=seed)
    state |= open_clip_state(reference("gelu", seed), UNCLIP_VISION_PREFIX)
    sd_checkpoints.save_state_dict(path, state, "safetensors", UNCLIP_METADATA)
    return state
