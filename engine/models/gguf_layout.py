"""The names and shapes of a GGUF file's tensors as the models read them, for the GGUF files users have.

- ComfyUI-GGUF's files say what they hold in `general.architecture` (flux, sd1, sdxl, t5, t5encoder, ...);
  a tensor its converter stored as 256-element rows has its torch-order shape in
  `comfy.gguf.orig_shape.<name>` (the reader in engine/models/formats.py reports that shape). Its
  text-encoder GGUFs of T5 (architecture `t5` or `t5encoder`) use llama.cpp's names (`token_embd`,
  `enc.blk.N.attn_q`, ...), renamed here to transformers' T5 keys with ComfyUI-GGUF's table.
- stable-diffusion.cpp's files have no `general.architecture` (ComfyUI-GGUF's compatibility mode) and the
  checkpoint's own names, with or without `model.diffusion_model.`; in an SDXL UNet among them the linear
  `proj_in` / `proj_out` weights carry trailing 1 dimensions, dropped here as ComfyUI-GGUF does.

Architectures ComfyUI-GGUF reads that are models Sluice does not run (sd3, wan, llama, ...) are refused,
naming the accepted ones; any other value reads as stable-diffusion.cpp's files do (names as stored).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.models.formats import CheckpointError

ARCHITECTURES = ("flux", "sd1", "sdxl", "t5", "t5encoder", "clip")  # general.architecture values read
# ComfyUI-GGUF's other architectures: models Sluice does not run
FOREIGN = ("sd3", "aura", "hidream", "cosmos", "ltxv", "hyvid", "wan", "lumina2", "qwen_image", "llama",
           "qwen2vl", "qwen3", "qwen3vl")
T5_ARCHITECTURES = ("t5", "t5encoder")
# llama.cpp -> transformers T5 name fragments, replaced in this order (ComfyUI-GGUF's T5_SD_MAP)
T5_RENAMES = (
    ("enc.", "encoder."),
    (".blk.", ".block."),
    ("token_embd", "shared"),
    ("output_norm", "final_layer_norm"),
    ("attn_q", "layer.0.SelfAttention.q"),
    ("attn_k", "layer.0.SelfAttention.k"),
    ("attn_v", "layer.0.SelfAttention.v"),
    ("attn_o", "layer.0.SelfAttention.o"),
    ("attn_norm", "layer.0.layer_norm"),
    ("attn_rel_b", "layer.0.SelfAttention.relative_attention_bias"),
    ("ffn_up", "layer.1.DenseReluDense.wi_1"),
    ("ffn_down", "layer.1.DenseReluDense.wo"),
    ("ffn_gate", "layer.1.DenseReluDense.wi_0"),
    ("ffn_norm", "layer.1.layer_norm"),
)
SDXL_MARKER = "label_emb.0.0.weight"  # an SDXL UNet (stable-diffusion.cpp files carry no architecture)
SQUEEZED = (".proj_in.weight", ".proj_out.weight")


class GGUFLayoutError(CheckpointError):
    """A GGUF file of an architecture Sluice does not run, or whose names collide once renamed."""


def t5_name(name: str) -> str:
    """transformers' T5 key of a llama.cpp T5 tensor name (`enc.blk.0.attn_q.weight` ->
    `encoder.block.0.layer.0.SelfAttention.q.weight`)."""
    for old, new in T5_RENAMES:
        name = name.replace(old, new)
    return name


def gguf_layout(architecture: Any, tensors: Mapping[str, Any], path: Path,
                ) -> tuple[dict[str, Any], dict[str, str]]:
    """(key -> tensor info, key -> the file's tensor name) of a GGUF file of `general.architecture`
    `architecture` (None when absent) whose tensors (name -> info with a torch-order `shape`) are given."""
    if architecture in FOREIGN:
        raise GGUFLayoutError(f"{path}: GGUF architecture {architecture!r} is not a model Sluice runs; "
                              f"accepted: {', '.join(ARCHITECTURES)}, or none (stable-diffusion.cpp files)")
    rename = t5_name if architecture in T5_ARCHITECTURES else None
    sdxl_compat = architecture not in ARCHITECTURES and any(name.endswith(SDXL_MARKER) for name in tensors)
    out: dict[str, Any] = {}
    names: dict[str, str] = {}
    for name, info in tensors.items():
        shape = tuple(info.shape)
        if sdxl_compat and name.endswith(SQUEEZED):
            while len(shape) > 2 and shape[-1] == 1:
                shape = shape[:-1]
        key = rename(name) if rename is not None else name
        if key in names:
            raise GGUFLayoutError(f"{path}: tensors {names[key]!r} and {name!r} both read as {key!r}")
        out[key] = replace(info, shape=shape) if shape != tuple(info.shape) else info
        names[key] = name
    return out, names
