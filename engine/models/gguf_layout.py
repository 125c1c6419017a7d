"""The names and shapes of a GGUF file's tensors as the models read them, for the GGUF files users have.

- ComfyUI-GGUF's files say what they hold in `general.architecture`; its converter flattens a tensor whose
  last dimension does not take whole 256-element blocks to rows of 256 (SD1/SDXL UNets, 3x3 convolutions
  among them) and keeps the original torch-order shape in `comfy.gguf.orig_shape.<name>` (INT32 array).
  Its text-encoder GGUFs of T5 (`t5`, `t5encoder`) use llama.cpp's names (`token_embd`,
  `enc.blk.N.attn_q`, ...), renamed here to transformers' T5 keys with ComfyUI-GGUF's table.
- stable-diffusion.cpp's files have no `general.architecture` (ComfyUI-GGUF's compatibility mode, as do
  its "pig" and "cow" values) and the checkpoint's own names, with or without `model.diffusion_model.`;
  for an SDXL UNet among them the linear `proj_in` / `proj_out` weights carry trailing 1 dimensions,
  dropped here as ComfyUI-GGUF does.

Architectures ComfyUI-GGUF reads that are models Sluice does not run (sd3, wan, llama, ...) are refused
naming the accepted ones; any other value reads as stable-diffusion.cpp's files do (names as stored).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from engine.models.formats import CheckpointError

ARCHITECTURES = ("flux", "sd1", "sdxl", "t5", "t5encoder", "clip")  # general.architecture values read
# ComfyUI-GGUF's other architectures: models Sluice does not run
FOREIGN = ("sd3", "aura", "hidream", "cosmos", "ltxv", "hyvid", "wan", "lumina2", "qwen_image", "llama",
           "qwen2vl", "qwen3", "qwen3vl")
T5_ARCHITECTURES = ("t5", "t5encoder")
ORIG_SHAPE_KEY = "comfy.gguf.orig_shape."
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


class GGUFLayoutError(CheckpointError):
    """A GGUF file of an architecture Sluice does not read, or with a bad `comfy.gguf.orig_shape` entry."""


def t5_name(name: str) -> str:
    for old, new in T5_RENAMES:
        name = name.replace(old, new)
    return name


def gguf_layout(architecture: str | None, tensors: Mapping[str, Any],
                orig_shapes: Mapping[str, tuple[int, ...]], where: str,
                ) -> tuple[dict[str, Any], dict[str, str]]:
    """(key -> tensor info with the logical shape, key -> the file's tensor name) of a GGUF file whose
    tensors (name -> info with `shape`, torch order) and original shapes are given; `where` names the file in
    errors."""
    if architecture in FOREIGN:
        raise GGUFLayoutError(f"{where}: GGUF architecture {architecture!r} is not a model Sluice runs; "
                              f"accepted: {', '.join(ARCHITECTURES)}, or none (stable-diffusion.cpp files)")
    rename = t5_name if architecture in T5_ARCHITECTURES else (lambda name: name)
    sdxl_compat = architecture not in ARCHITECTURES and any(name.endswith(SDXL_MARKER) for name in tensors)
    out: dict[str, Any] = {}
    names: dict[str, str] = {}
    for name, info in tensors.items():
        shape = tuple(info.shape)
        if name in orig_shapes:
            original = tuple(orig_shapes[name])
            if math.prod(original) != math.prod(shape) or any(d < 0 for d in original):
                raise GGUFLayoutError(f"{where}: {ORIG_SHAPE_KEY}{name} is {list(original)}, which does not "
                                      f"hold the {math.prod(shape)} elements of the stored {list(shape)}")
            shape = original
        elif sdxl_compat and name.endswith((".proj_in.weight", ".proj_out.weight")):
            while len(shape) > 2 and shape[-1] == 1:
                shape = shape[:-1]
        key = rename(name)
        if key in names:
            raise GGUFLayoutError(f"{where}: tensors {names[key]!r} and {name!r} both read as {key!r}")
        out[key] = replace(info, shape=shape) if shape != tuple(info.shape) else info
        names[key] = name
    return out, names


def read_orig_shapes(fields: Mapping[str, Any], where: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> `comfy.gguf.orig_shape.<name>` of a gguf-py reader's fields (an INT32 array each)."""
    from gguf import GGUFValueType

    shapes = {}
    for key, field in fields.items():
        if not key.startswith(ORIG_SHAPE_KEY):
            continue
        if list(field.types) != [GGUFValueType.ARRAY, GGUFValueType.INT32]:
            raise GGUFLayoutError(f"{where}: {key} must be an array of INT32, got "
                                  f"{[t.name for t in field.types]}")
        shapes[key[len(ORIG_SHAPE_KEY):]] = tuple(int(field.parts[index][0]) for index in field.data)
    return shapes


def read_architecture(fields: Mapping[str, Any], where: str) -> str | None:
    """`general.architecture` of a gguf-py reader's fields (a string), or None."""
    from gguf import GGUFValueType

    field = fields.get("general.architecture")
    if field is None:
        return None
    if list(field.types) != [GGUFValueType.STRING]:
        raise GGUFLayoutError(f"{where}: general.architecture must be a string, got "
                              f"{[t.name for t in field.types]}")
    return bytes(field.parts[field.data[-1]]).decode("utf-8", "replace")


def apply_gguf_layout(fields: Mapping[str, Any], tensors: Mapping[str, Any], where: Any,
                      ) -> tuple[dict[str, Any], dict[str, str]]:
    """`gguf_layout` of a gguf-py reader's fields and tensor table (see the module docstring)."""
    where = str(where)
    return gguf_layout(read_architecture(fields, where), tensors, read_orig_shapes(fields, where), where)
