"""`sluice convert`: any checkpoint Sluice reads (safetensors, torch zip, GGUF) to a GGUF file that
stable-diffusion.cpp and ComfyUI-GGUF both load.

What each loader needs, and what is written:
- names: the input's keys unchanged, which is what sd.cpp's own `-M convert` writes for a checkpoint in the
  original layouts. sd.cpp takes a whole checkpoint's names with `-m`: its name conversion accepts the text
  encoders under `cond_stage_model.` / `conditioner.embedders.` (SD1, SD2, SDXL) or `text_encoders.clip_l.`,
  `text_encoders.t5xxl.` (ComfyUI's FLUX checkpoints) and the VAE under `first_stage_model.` or `vae.`; a
  bare model's names with `--diffusion-model`, `--clip_l`, `--t5xxl` or `--vae`, which prefix them
  (transformers' T5 names and llama.cpp's both read). ComfyUI-GGUF's UnetLoaderGGUF strips
  `model.diffusion_model.` when present and ignores the other components' tensors; its CLIPLoaderGGUF reads
  only text-encoder files whose `general.architecture` is a text one (`t5encoder` for a T5 encoder, whose
  transformers names its llama.cpp renames leave as they are); it reads no CLIP GGUF at all.
- `general.architecture`: ComfyUI-GGUF's value (flux, sd3, sdxl, sd1), detected from the keys as its own
  converter does, or llama.cpp's `t5encoder` for a bare T5 encoder; ComfyUI-GGUF refuses other values and
  guesses from the keys when it is missing (sd.cpp's own files have none). sd.cpp ignores every field. When
  the keys match none, no architecture is written.
- `general.file_type` (llama.cpp's LlamaFileType of `--type`) and `general.quantization_version` 2, as
  ComfyUI-GGUF's tools write them; alignment is the default 32 (not written).
- tensors whose rows are not whole blocks of the type (3x3 convolutions, for one) stay in their stored
  type. ComfyUI-GGUF's own converter instead reshapes SD1/SDXL ones to rows of 256 and records
  `comfy.gguf.orig_shape.NAME`, which sd.cpp does not read; so this converter does not reshape.
- fp8 tensors are widened to F16 and F64 narrowed to F32 where they stay unconverted (GGUF loaders read
  neither); integer tensors are copied; uint8 and bool ones have no GGUF type and are refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.models.formats import CheckpointError, CheckpointReader, GGUFCheckpointReader, open_checkpoint
from engine.quant.dequant import dequantize
from engine.quant.gguf_writer import FieldValue, GGUFTensorPlan, write_gguf
from engine.quant.quantize import quantize, tensor_type_rules
from engine.quant.types import GGML_TYPES

# ComfyUI-GGUF's detect_arch (tools/convert.py), for the architectures Sluice runs: any one key set matches
ARCHITECTURE_KEYS: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    ("flux", (("double_blocks.0.img_attn.proj.weight",),)),
    ("sd3", (("joint_blocks.0.x_block.attn.qkv.weight",),)),
    ("sdxl", (("input_blocks.3.0.op.weight", "input_blocks.6.0.op.weight", "output_blocks.2.2.conv.weight",
               "output_blocks.5.2.conv.weight"), ("label_emb.0.0.weight",))),
    ("sd1", (("input_blocks.3.0.op.weight", "input_blocks.6.0.op.weight", "input_blocks.9.0.op.weight",
              "output_blocks.2.1.conv.weight", "output_blocks.5.2.conv.weight",
              "output_blocks.8.2.conv.weight"),)),
    # a bare T5 (llama.cpp's values): encoder and decoder, or the encoder alone
    ("t5", (("encoder.block.0.layer.0.SelfAttention.q.weight",
             "decoder.block.0.layer.0.SelfAttention.q.weight"),)),
    ("t5encoder", (("encoder.block.0.layer.0.SelfAttention.q.weight",),)),
)
DIFFUSION_PREFIXES = ("model.diffusion_model.", "model.")
# llama.cpp's LlamaFileType of a file mostly of one type (K types: the _S variant, every tensor that type)
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
              "Q3_K": 11, "Q4_K": 14, "Q5_K": 16, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32}
QUANTIZATION_VERSION = 2  # GGML_QUANT_VERSION
# stored dtypes that GGUF loaders do not read, and the type they are written as when not converted
WIDENED = {"F8_E4M3": "F16", "F8_E5M2": "F16", "F64": "F32"}
COPIED = ("F32", "F16", "BF16", "I8", "I16", "I32", "I64")
ORIG_SHAPE_FIELD = "comfy.gguf.orig_shape."


@dataclass(frozen=True)
class TensorConversion:
    plan: GGUFTensorPlan  # what is written
    source_type: str  # the stored type in the input ("BF16", "Q4_K", ...)
    convert: bool  # False: the stored bytes are copied


@dataclass
class ConversionSummary:
    architecture: str | None
    tensors: list[TensorConversion]
    fields: dict[str, FieldValue] = field(default_factory=dict)

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.plan.type_name] = counts.get(t.plan.type_name, 0) + 1
        return counts


def detect_architecture(keys: list[str]) -> str | None:
    """ComfyUI-GGUF's general.architecture for these checkpoint keys, or None."""
    for prefix in DIFFUSION_PREFIXES:
        if any(k.startswith(prefix) for k in keys):
            keys = [k.removeprefix(prefix) for k in keys if k.startswith(prefix)]
            break
    present = set(keys)
    for architecture, key_sets in ARCHITECTURE_KEYS:
        if any(all(k in present for k in key_set) for key_set in key_sets):
            return architecture
    return None


def plan_conversion(reader: CheckpointReader, type_name: str | None = None,
                    rules: str = "") -> ConversionSummary:
    """What `convert_checkpoint` writes for `reader`'s tensors under `--type type_name` and `rules`, from the
    header alone."""
    target_of = tensor_type_rules(type_name, rules)
    fields: dict[str, FieldValue] = {}
    architecture = detect_architecture(reader.keys())
    if architecture is not None:
        fields["general.architecture"] = architecture
    fields["general.quantization_version"] = QUANTIZATION_VERSION
    if type_name is not None:
        fields["general.file_type"] = FILE_TYPES[type_name.upper()]
    conversions = []
    for key in reader.keys():
        info = reader.info(key)
        source = info.type_name
        floating = source in ("F32", "F16", "BF16", *WIDENED) or (
            source in GGML_TYPES and GGML_TYPES[source].block_size > 1)
        if source not in COPIED and source not in WIDENED and not floating:
            raise CheckpointError(f"tensor '{key}' of {reader.path} is {source}, which GGUF cannot hold; "
                                  f"accepted: floating-point and I8/I16/I32/I64 tensors")
        target = (target_of(key, info.shape) if floating else None) or WIDENED.get(source)
        if target is not None and target != source:
            conversions.append(TensorConversion(GGUFTensorPlan(key, info.shape, target), source, True))
        else:
            stored_shape = _stored_shape(reader, key)
            if stored_shape != info.shape:
                fields[ORIG_SHAPE_FIELD + key] = list(info.shape)
            conversions.append(TensorConversion(GGUFTensorPlan(key, stored_shape, source), source, False))
    return ConversionSummary(architecture, conversions, fields)


def convert_checkpoint(source: str | os.PathLike[str], output: str | os.PathLike[str],
                       type_name: str | None = None, rules: str = "", device: str | torch.device = "cpu",
                       progress: Callable[[int, int, TensorConversion], None] | None = None
                       ) -> ConversionSummary:
    """Convert `source` to the GGUF file `output` (written whole or not at all), quantising on `device`."""
    with open_checkpoint(source) as reader:
        summary = plan_conversion(reader, type_name, rules)
        by_name = {t.plan.name: (index, t) for index, t in enumerate(summary.tensors)}

        def tensor_bytes(plan: GGUFTensorPlan) -> torch.Tensor:
            index, conversion = by_name[plan.name]
            if progress is not None:
                progress(index, len(summary.tensors), conversion)
            if not conversion.convert:
                return _stored_bytes(reader, plan.name)
            return quantize(_source_tensor(reader, plan.name, device), plan.type_name)

        write_gguf(output, summary.fields, [t.plan for t in summary.tensors], tensor_bytes)
    return summary


def _stored_shape(reader: CheckpointReader, key: str) -> tuple[int, ...]:
    if isinstance(reader, GGUFCheckpointReader):
        return reader.header.tensors[key].shape
    return reader.info(key).shape


def _source_tensor(reader: CheckpointReader, key: str, device: str | torch.device) -> torch.Tensor:
    """The tensor on `device`; a quantised GGUF one copied there as bytes and dequantised there."""
    info = reader.info(key)
    if isinstance(reader, GGUFCheckpointReader) and info.dtype is None:
        return dequantize(reader.get_raw(key).to(device), info.type_name, info.shape)
    return reader.get(key, device)


def _stored_bytes(reader: CheckpointReader, key: str) -> torch.Tensor:
    if isinstance(reader, GGUFCheckpointReader):
        return reader.get_raw(key)
    return reader.get(key).contiguous().reshape(-1).view(torch.uint8)
