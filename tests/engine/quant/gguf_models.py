"""Test helper: tiny diffusion models written as quantised GGUF files as ComfyUI-GGUF's tools write them, with
their dequantised float32 copies (independent of Sluice's quantiser and reader).

    copy = write_quantised_gguf(path, state, "Q4_K", arch="sd1")   # {key: float32 tensor} of what it holds

The tensors are written with gguf's GGUFWriter: Q8_0 blocks by `gguf.quants.quantize`, Q4_K blocks by the
plain encoder below (gguf-py quantises no K type), and the copy is `gguf.quants.dequantize` of the written
bytes. Which tensors quantise follows ComfyUI-GGUF's converter (tools/convert.py) and the quantiser after it:
1-D tensors and tensors of at most 1024 elements stay F32; for the UNet architectures (sd1, sdxl) a tensor
whose last dimension is not whole 256-element rows (but whose size is) is stored as rows of 256 with its shape
in `comfy.gguf.orig_shape.<name>`; a tensor whose stored rows are whole blocks takes the type, any other F16
(or the `fallback` type given).
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch

from engine.models.flux import FluxConfig, FluxTransformer, flux_axes_dim
from tests.engine.models.flux_checkpoints import CLIP_WIDTH, T5_WIDTH, _random

RESHAPED_ARCHITECTURES = ("sd1", "sdxl")  # ComfyUI-GGUF's converter reshapes these (shape_fix)
QUANTIZATION_THRESHOLD, REARRANGE_THRESHOLD = 1024, 512


def quant_flux_config() -> FluxConfig:
    """A FLUX transformer wide enough (256) for most of its matrices to take whole Q4_K blocks; its text
    widths are the tiny CLIP-L's and T5's of tests/engine/models/flux_checkpoints.py."""
    return FluxConfig(in_channels=64, out_channels=64, vec_in_dim=CLIP_WIDTH, context_in_dim=T5_WIDTH,
                      hidden_size=256, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1,
                      axes_dim=flux_axes_dim(128), guidance_embed=True)


def quant_flux_state(seed: int = 5) -> dict[str, torch.Tensor]:
    model = FluxTransformer(quant_flux_config(), device="meta")
    return _random({k: tuple(v.shape) for k, v in model.state_dict().items()}, seed, torch.float32)


def q4_k_blocks(x: np.ndarray) -> np.ndarray:
    """(n, 256) float32 -> (n, 144) Q4_K blocks: per 32-element sub-block a 6-bit scale and min (relative to
    the block's fp16 d and dmin) and 4-bit values, packed as ggml's block_q4_K."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)  # (n, 8)
    scale = (sub.max(axis=-1) - low) / 15.0
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)  # (n,)
    dmin = (-low.min(axis=-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.clip(np.nan_to_num(np.round(scale / df)), 0, 63).astype(np.uint8)
        lm = np.clip(np.nan_to_num(np.round(-low / dminf)), 0, 63).astype(np.uint8)
        step = (df * ls)[..., None]
        q = np.clip(np.nan_to_num(np.round((sub + (dminf * lm)[..., None]) / step)), 0, 15).astype(np.uint8)
    scales = np.zeros((x.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    scales[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2c (low nibbles) and 2c+1 (high)
    return np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales, qs], axis=1)


def quantise(x: np.ndarray, qtype: str) -> np.ndarray:
    """`x` (rows, whole blocks) as `qtype` bytes (rows, row bytes)."""
    if qtype == "Q4_K":
        return q4_k_blocks(x.reshape(-1, 256)).reshape(x.shape[0], -1)
    return gguf.quants.quantize(x, gguf.GGMLQuantizationType[qtype])


def stored_form(tensor: torch.Tensor, qtype: str, arch: str, fallback: str = "F16",
                ) -> tuple[np.ndarray, str, tuple | None]:
    """(stored array, its GGML type, original shape when reshaped) of a tensor (see the module docstring)."""
    data = tensor.float().numpy()
    numel = data.size
    if data.ndim == 1 or numel <= QUANTIZATION_THRESHOLD:
        return data, "F32", None
    original = None
    if (arch in RESHAPED_ARCHITECTURES and numel >= REARRANGE_THRESHOLD and numel % 256 == 0
            and data.shape[-1] % 256):
        original, data = data.shape, data.reshape(numel // 256, 256)
    rows = data.reshape(-1, data.shape[-1])
    if data.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]:
        return data.astype(np.float16 if fallback == "F16" else np.float32), fallback, original
    return quantise(rows, qtype).reshape(*data.shape[:-1], -1), qtype, original


def write_quantised_gguf(path: Path, state: dict[str, torch.Tensor], qtype: str, arch: str | None,
                         fallback: str = "F16") -> dict[str, torch.Tensor]:
    """Write `state` as a ComfyUI-GGUF file of architecture `arch` whose matrices are `qtype` (None: no
    general.architecture, as stable-diffusion.cpp writes); returns the float32 tensors the file holds (gguf's
    own dequantisation), in their original shapes."""
    writer = gguf.GGUFWriter(str(path), arch=arch or "")  # an empty architecture is not written
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    copy = {}
    for key, tensor in state.items():
        data, stored, original = stored_form(tensor, qtype, arch, fallback)
        kind = gguf.GGMLQuantizationType[stored]
        if original is not None:
            writer.add_array(f"comfy.gguf.orig_shape.{key}", [int(d) for d in original])
        writer.add_tensor(key, data, raw_dtype=kind if stored not in ("F32", "F16") else None)
        values = gguf.quants.dequantize(data, kind) if stored not in ("F32", "F16") else data
        copy[key] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(tensor.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return copy


def quantised_bytes(path: Path) -> int:
    """The bytes of every tensor of a GGUF file, as gguf's reader sizes them."""
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def count_types(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts


def elements(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
