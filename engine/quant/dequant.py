"""GGML tensor bytes to torch tensors, vectorised over blocks in PyTorch on whatever device the bytes are on.

Each type's arithmetic follows ggml's reference dequantiser (ggml-quants.c `dequantize_row_*`) in the
order gguf-py's `gguf.quants` performs it, in float32, so results are bit-identical to
`gguf.quants.dequantize` (tests/engine/quant check this). A lower `dtype` is written by the last operation,
which rounds exactly as `.to(dtype)` of the float32 result would.

The code has no data-dependent shapes, no `.item()` and no host round trips (the small constant tables are
made once per device), so torch.compile can fuse a type's whole dequantisation into one kernel.

This PyTorch code is the reference. On CUDA, `dequantize` runs a quantised type through one Triton kernel
instead (engine/quant/triton_dequant.py: the same float32 operations in the same order, bit-identical
results), where Triton imports and the type has a kernel; `dequant_backend` is the one place that chooses.
"""

from __future__ import annotations

import functools
import logging

import torch

from engine.quant.types import QK_K, ggml_type

log = logging.getLogger(__name__)

PLAIN_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# IQ4_NL / IQ4_XS: the 16 non-linear levels a 4-bit index selects (ggml-common.h kvalues_iq4nl)
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def dequantize(raw: torch.Tensor, qtype: str, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor of logical torch-order `shape` held in `raw` (uint8, any shape, the tensor's bytes) as
    GGML type `qtype`, in `dtype`, on raw's device. The elements come in the stored order, so `shape` may
    be the GGUF shape reversed or any reshaping of it (ComfyUI-GGUF's `comfy.gguf.orig_shape`).
    F32/F16/BF16 input whose dtype is `dtype` comes back as a view of `raw` (no copy; raw must then be
    aligned to the element size, as GGUF data and torch allocations are); every other result is a new
    tensor, and the quantised types take bytes at any alignment."""
    t = ggml_type(qtype)
    if raw.dtype != torch.uint8:
        raise TypeError(f"dequantize takes the tensor's bytes as uint8, got {raw.dtype}")
    shape = tuple(int(d) for d in shape)
    elements = 1
    for d in shape:
        elements *= d
    if elements % t.block_size:
        raise ValueError(f"shape {shape} is not whole {t.name} blocks ({t.block_size} elements each)")
    n_blocks = elements // t.block_size
    if raw.numel() != n_blocks * t.type_size:
        raise ValueError(f"{t.name} tensor of shape {shape} takes {n_blocks * t.type_size} bytes, "
                         f"got {raw.numel()}")
    if t.name in PLAIN_DTYPES:
        return raw.reshape(-1).view(PLAIN_DTYPES[t.name]).reshape(shape).to(dtype)
    backend = dequant_backend(raw.device, t.name, dtype)
    if backend == "triton":
        out = _dequantize_triton(raw, t.name, shape, dtype)
        if out is not None:
            return out
    blocks = raw.reshape(n_blocks, t.type_size)
    if backend == "compile":
        import torch._inductor.config as inductor_config  # only here: importing it is slow

        with inductor_config.patch(emulate_precision_casts=True):  # round where eager rounds
            return _compiled(t.name)(blocks, dtype).reshape(shape)
    return DEQUANTIZERS[t.name](blocks, dtype).reshape(shape)


# ---------------------------------------------------------------- which implementation

BACKENDS = ("auto", "triton", "compile", "torch")
_requested = ["auto"]  # set_dequant_backend's choice (a list: one mutable cell)
_triton_failed: list[BaseException] = []  # the error that turned the Triton path off, if one did


def set_dequant_backend(name: str) -> None:
    """How quantised types are dequantised from now on, for benchmarks and debugging: "auto" (the default:
    see dequant_backend), "triton" (the Triton kernels on any device; on the CPU only Triton's interpreter
    runs them), "compile" (this module's PyTorch code through torch.compile, rounding as eager does) or
    "torch" (this module's PyTorch code, eagerly)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown dequantisation backend {name!r}; accepted: {', '.join(BACKENDS)}")
    _requested[0] = name


def dequant_backend(device: torch.device, qtype: str, dtype: torch.dtype) -> str:
    """Which implementation dequantises `qtype` blocks on `device` into `dtype`: "triton" (one kernel,
    engine/quant/triton_dequant.py) where the device is CUDA, Triton imports, it has a kernel for the type
    and dtype, and it has not failed in this process; "torch" (this module's code) otherwise, and always
    while torch.compile traces (it fuses that code itself). set_dequant_backend can ask for another."""
    requested = _requested[0]
    if requested != "auto" or torch.compiler.is_compiling():
        return requested if requested != "auto" else "torch"
    if device.type != "cuda" or qtype in PLAIN_DTYPES or _triton_failed or not triton_available():
        return "torch"
    from engine.quant import triton_dequant

    return "triton" if qtype in triton_dequant.KERNELS and dtype in triton_dequant.DTYPES else "torch"


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here (it comes with torch's Linux CUDA wheels)."""
    try:
        from engine.quant import triton_dequant  # noqa: F401
    except Exception as error:  # not installed, or an install that does not import
        log.info("no Triton dequantisation (%s: %s)", type(error).__name__, error)
        return False
    return True


def _dequantize_triton(raw: torch.Tensor, qtype: str, shape: tuple[int, ...],
                       dtype: torch.dtype) -> torch.Tensor | None:
    """The Triton kernel's result; None, with a warning, where Triton cannot compile or launch here (no C
    compiler or Python headers for its launcher, an unsupported GPU): the PyTorch path then serves this and
    every later call. Out of memory is raised, as from the PyTorch path."""
    from engine.quant import triton_dequant

    try:
        return triton_dequant.dequantize_triton(raw, qtype, shape, dtype)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        if _requested[0] != "auto":
            raise
        _triton_failed.append(error)
        log.warning("Triton dequantisation failed (%s: %s); dequantising in PyTorch from now on",
                    type(error).__name__, error)
        return None


@functools.cache
def _compiled(qtype: str):
    """DEQUANTIZERS[qtype] through torch.compile, for any number of blocks."""
    return torch.compile(DEQUANTIZERS[qtype], dynamic=True, fullgraph=True)


# ---------------------------------------------------------------- helpers


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 stored (little-endian) at byte `offset` of each block, as float32: (n_blocks, 1). Built from
    the two bytes, so the bytes need no alignment."""
    low, high = blocks[:, offset:offset + 1], blocks[:, offset + 1:offset + 2]
    return ((high.to(torch.int32) << 8) | low).to(torch.int16).view(torch.float16).float()


def _constant(values: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant tensor on `device`: made once per device when eager (a host-to-device copy waits
    for the stream, so it is not repeated per call), a constant of the graph under torch.compile."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype, device=device)
    return _cached_constant(values, dtype, device)


@functools.cache
def _cached_constant(values: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device)


def _fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Split each byte of `packed` (..., k) into its 8/bits fields of `bits` bits, lowest first:
    (..., 8/bits, k), field j of byte i at [..., j, i] (ggml's layout: the k low fields come first)."""
    shifts = _constant(tuple(range(0, 8, bits)), torch.uint8, packed.device).view(-1, 1)
    return (packed.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)


def _scaled(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in float32 (q integer, scale float32, broadcast), written out in `dtype`."""
    if dtype == torch.float32:
        return torch.mul(q, scale)
    out = torch.empty(torch.broadcast_shapes(q.shape, scale.shape), dtype=dtype, device=q.device)
    return torch.mul(q, scale, out=out)


def _affine(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype,
            subtract: bool) -> torch.Tensor:
    """q * scale + offset (or - offset), each step rounded to float32, written out in `dtype`."""
    product = torch.mul(q, scale)
    op = torch.sub if subtract else torch.add
    out = product if dtype == torch.float32 else torch.empty_like(product, dtype=dtype)
    return op(product, offset, out=out)


# ---------------------------------------------------------------- 32-element block types


def _q4_0(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d: fp16, qs[16]: element i in the low nibble of byte i, element i+16 in its high nibble
    q = _fields(blocks[:, 2:], 4).view(torch.int8) - 8  # (n, 2, 16)
    return _scaled(q, _half(blocks, 0).unsqueeze(-1), dtype)


def _q4_1(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d, m: fp16, qs[16] as Q4_0; value = d * q + m
    q = _fields(blocks[:, 4:], 4)  # (n, 2, 16)
    return _affine(q, _half(blocks, 0).unsqueeze(-1), _half(blocks, 2).unsqueeze(-1), dtype, subtract=False)


def _five_bit(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Q5 values (n, 2, 16): low nibbles as Q4_0, bit 4 of element i is bit i of the 4-byte qh."""
    return _fields(low, 4) | (_fields(high, 1).transpose(-1, -2).reshape(-1, 2, 16) << 4)


def _q5_0(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d: fp16, qh[4], qs[16]
    q = _five_bit(blocks[:, 6:], blocks[:, 2:6]).view(torch.int8) - 16
    return _scaled(q, _half(blocks, 0).unsqueeze(-1), dtype)


def _q5_1(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d, m: fp16, qh[4], qs[16]; value = d * q + m
    q = _five_bit(blocks[:, 8:], blocks[:, 4:8])
    return _affine(q, _half(blocks, 0).unsqueeze(-1), _half(blocks, 2).unsqueeze(-1), dtype, subtract=False)


def _q8_0(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d: fp16, qs[32] int8
    return _scaled(blocks[:, 2:].view(torch.int8), _half(blocks, 0), dtype)


def _iq4_nl(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d: fp16, qs[16] as Q4_0, each nibble an index into IQ4_LEVELS
    q = _constant(IQ4_LEVELS, torch.int8, blocks.device)[_fields(blocks[:, 2:], 4).int()]  # (n, 2, 16)
    return _scaled(q, _half(blocks, 0).unsqueeze(-1), dtype)


# ---------------------------------------------------------------- 256-element K-quant super-blocks


def _q2_k(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # scales[16] (low nibble scale, high nibble min of each 16), qs[64] 2-bit, d, dmin: fp16
    scales = blocks[:, :16]
    scale = _half(blocks, 80) * (scales & 0x0F)  # (n, 16)
    low = _half(blocks, 82) * (scales >> 4)
    q = _fields(blocks[:, 16:80].reshape(-1, 2, 32), 2).reshape(-1, 16, 16)  # element 128*h + 32*j + i
    return _affine(q, scale.unsqueeze(-1), low.unsqueeze(-1), dtype, subtract=True)


def _q3_k(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # hmask[32] (bit 2 of element 32*j + i is bit j of hmask[i], stored inverted), qs[64] 2-bit,
    # scales[12] (16 signed 6-bit scales: low nibbles in bytes 0-7, high 2 bits in bytes 8-11), d: fp16
    low_scale = _fields(blocks[:, 96:104], 4).reshape(-1, 16)
    high_scale = _fields(blocks[:, 104:108], 2).reshape(-1, 16)
    scales = (low_scale | (high_scale << 4)).view(torch.int8) - 32
    scale = _half(blocks, 108) * scales  # (n, 16)
    low = _fields(blocks[:, 32:96].reshape(-1, 2, 32), 2).reshape(-1, QK_K)
    high = _fields(blocks[:, :32], 1).reshape(-1, QK_K)
    q = low.view(torch.int8) - ((high ^ 1) << 2).view(torch.int8)
    return _scaled(q.reshape(-1, 16, 16), scale.unsqueeze(-1), dtype)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins: (n, 8) each.
    Bytes 0-3: scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7: mins likewise;
    bytes 8-11: low nibble the low 4 bits of scales 4-7, high nibble those of mins 4-7."""
    first, second, last = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((first & 0x3F, (last & 0x0F) | ((first >> 2) & 0x30)), dim=-1)
    mins = torch.cat((second & 0x3F, (last >> 4) | ((second >> 2) & 0x30)), dim=-1)
    return scales, mins


def _q4_k(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d, dmin: fp16, scales[12], qs[128]: 64-element chunks, 32 bytes each, low nibbles first
    scales, mins = _k_scales(blocks[:, 4:16])
    scale = _half(blocks, 0) * scales  # (n, 8)
    low = _half(blocks, 2) * mins
    q = _fields(blocks[:, 16:].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)
    return _affine(q, scale.unsqueeze(-1), low.unsqueeze(-1), dtype, subtract=True)


def _q5_k(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d, dmin: fp16, scales[12], qh[32] (bit 4 of element 32*j + i is bit j of qh[i]), qs[128] as Q4_K
    scales, mins = _k_scales(blocks[:, 4:16])
    scale = _half(blocks, 0) * scales
    low = _half(blocks, 2) * mins
    q = _fields(blocks[:, 48:].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)
    q = q | (_fields(blocks[:, 16:48], 1) << 4)
    return _affine(q, scale.unsqueeze(-1), low.unsqueeze(-1), dtype, subtract=True)


def _q6_k(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # ql[128] (128-element halves: 64 bytes, low nibbles first), qh[64] (per half 32 bytes of four 2-bit
    # fields), scales[16] int8, d: fp16
    low = _fields(blocks[:, :128].reshape(-1, 2, 64), 4).reshape(-1, QK_K)
    high = _fields(blocks[:, 128:192].reshape(-1, 2, 32), 2).reshape(-1, QK_K)
    q = (low | (high << 4)).view(torch.int8) - 32
    scale = _half(blocks, 208) * blocks[:, 192:208].view(torch.int8)  # (n, 16)
    return _scaled(q.reshape(-1, 16, 16), scale.unsqueeze(-1), dtype)


def _iq4_xs(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d: fp16, scales_h: uint16 (2 high bits of each of 8 scales), scales_l[4] (low nibbles), qs[128]:
    # 32-element sub-blocks of 16 bytes, low nibbles first, indexes into IQ4_LEVELS
    low_scale = _fields(blocks[:, 4:8], 4).transpose(-1, -2).reshape(-1, 8)
    high_scale = _fields(blocks[:, 2:4], 2).transpose(-1, -2).reshape(-1, 8)
    scales = (low_scale | (high_scale << 4)).view(torch.int8) - 32
    scale = _half(blocks, 0) * scales  # (n, 8)
    index = _fields(blocks[:, 8:].reshape(-1, 8, 16), 4).reshape(-1, 8, 32)
    q = _constant(IQ4_LEVELS, torch.int8, blocks.device)[index.int()]
    return _scaled(q, scale.unsqueeze(-1), dtype)


DEQUANTIZERS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
}
