"""GGML blocks to floats in one Triton kernel per tensor (issue 17): the GPU path of engine.quant.dequantize.

Each kernel reads a tensor's raw blocks (uint8, as QuantLinear holds them, at any byte alignment) and writes
the compute dtype (float32, float16 or bfloat16) directly: one launch, no intermediates. A program takes a
group of whole blocks (`ELEMENTS_PER_PROGRAM` elements); its loads are tiles of consecutive bytes, its stores
runs of consecutive elements.

The reference is engine/quant/dequant.py (itself bit-exact against gguf-py): every value is computed with the
same float32 operations in the same order (a K-quant's sub-block scale `d * sc` first, then `q * scale`,
then `- dmin * m` as its own rounding), and the float32 result is rounded to the output dtype once, to
nearest even, as `.to(dtype)` rounds. Kernels are launched with `enable_fp_fusion=False` so the compiler
does not contract `q * scale - low` into one fused multiply-add, which would round once instead of twice.
Results are then bit-identical to dequant.py's for every finite value, infinity and signed zero; a NaN
comes out as a NaN where the reference has one (its payload bits may differ: torch's own CUDA casts, for
one, make other NaNs than its CPU casts). sm_90 PTX of every kernel holds mul.rn/sub.rn and no fma.

A kernel is compiled once per output dtype and byte alignment, for any number of blocks (n_blocks is not
specialised on). Launches allocate only the output (torch's caching allocator, so a CUDA graph captures
them) and never synchronise with the host. Tests run these kernels on the CPU under Triton's interpreter
(TRITON_INTERPRET=1 set before this module is imported), where bfloat16 is rounded on the bits (see _write);
tests/engine/quant/test_triton_dequant_cuda.py checks the compiled kernels on a GPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from engine.quant.dequant import IQ4_LEVELS
from engine.quant.types import GGML_TYPES

ELEMENTS_PER_PROGRAM = 2048  # elements one program writes (64 blocks of 32, or 8 super-blocks of 256)
NUM_WARPS = 4
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)  # kernels run by Triton's CPU interpreter


def dequantize_triton(raw: torch.Tensor, qtype: str, shape: tuple[int, ...], dtype: torch.dtype,
                      elements_per_program: int = ELEMENTS_PER_PROGRAM, num_warps: int = NUM_WARPS,
                      ) -> torch.Tensor:
    """`raw` (uint8, whole blocks of `qtype`, on a CUDA device or, under the interpreter, the CPU) as a new
    tensor of `shape` and `dtype`, in one kernel launch. engine.quant.dequantize checks the arguments and
    calls this where dequant_backend says so; `elements_per_program` and `num_warps` are for benchmarks."""
    if qtype not in KERNELS:
        raise ValueError(f"no Triton kernel for GGML type {qtype!r}; kernels: {', '.join(KERNELS)}")
    if dtype not in DTYPES:
        raise ValueError(f"Triton dequantisation writes {', '.join(map(str, DTYPES))}, not {dtype}")
    t = GGML_TYPES[qtype]
    n_blocks = raw.numel() // t.type_size
    out = torch.empty(shape, dtype=dtype, device=raw.device)
    if n_blocks == 0:
        return out
    blocks = max(1, elements_per_program // t.block_size)
    extra = (_levels(raw.device),) if qtype in ("IQ4_NL", "IQ4_XS") else ()
    grid = (triton.cdiv(n_blocks, blocks),)
    with torch.cuda.device(raw.device) if raw.is_cuda else contextlib.nullcontext():
        KERNELS[qtype][grid](raw.reshape(-1).contiguous(), out, n_blocks, *extra, BLOCKS=blocks,
                             num_warps=num_warps, enable_fp_fusion=False)
    return out


@functools.cache
def _levels(device: torch.device) -> torch.Tensor:
    """IQ4_LEVELS as int8 on `device`, made once per device (never while a graph is captured: the first,
    eager, call of a shape makes it)."""
    return torch.tensor(IQ4_LEVELS, dtype=torch.int8).to(device)


# ---------------------------------------------------------------- helpers


@triton.jit
def _half(ptr, ok):
    """The fp16 stored little-endian at `ptr` (any alignment) as float32; 0 where not `ok`."""
    low = tl.load(ptr, mask=ok, other=0).to(tl.uint16)
    high = tl.load(ptr + 1, mask=ok, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr, ok):
    """The byte at `ptr` as int32 (0 to 255); 0 where not `ok`."""
    return tl.load(ptr, mask=ok, other=0).to(tl.int32)


@triton.jit
def _write(out, offsets, values, ok):
    """float32 `values` rounded to out's dtype (to nearest even, the GPU's cvt.rn) at `offsets`. Triton's
    interpreter truncates float32 to bfloat16, so under it bfloat16 is rounded on the bits instead, as torch's
    CPU cast rounds (a NaN becoming 0x7FC0)."""
    if INTERPRETED and out.dtype.element_ty == tl.bfloat16:
        bits = values.to(tl.uint32, bitcast=True)
        rounded = tl.where(values != values, 0x7FC0, (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16)
        tl.store(out + offsets, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=ok)
    else:
        tl.store(out + offsets, values.to(out.dtype.element_ty), mask=ok)


@triton.jit
def _program_blocks(n_blocks, BLOCKS: tl.constexpr):
    """(BLOCKS,) int64 indices of this program's blocks and whether each exists."""
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    return block, block < n_blocks


@triton.jit
def _k_scale_min(sc, s, ok):
    """Q4_K/Q5_K sub-block `s`'s 6-bit scale and min (int32) from the 12 bytes at `sc` (ggml's
    get_scale_min_k4): sub-blocks 0-3 take the low 6 bits of bytes s and s+4; 4-7 take the nibbles of
    byte s+4 with the top 2 bits of bytes s-4 and s."""
    a = _byte(sc + s + 4, ok)
    b = _byte(sc + (s & 3), ok)
    c = _byte(sc + s, ok)
    scale = tl.where(s < 4, b & 63, (a & 15) | ((b >> 6) << 4))
    low = tl.where(s < 4, a & 63, (a >> 4) | ((c >> 6) << 4))
    return scale, low


# ---------------------------------------------------------------- 32-element block types
# Per-block values (scales) are computed on (B,) tensors and per-sub-block ones on (B, S) tensors, then
# broadcast: computed on the element tile's shape instead, each thread would repeat them per element it holds.


@triton.jit(do_not_specialize=["n_blocks"])
def _q8_0(raw, out, n_blocks, BLOCKS: tl.constexpr):
    # d: fp16, qs[32] int8
    block, ok = _program_blocks(n_blocks, BLOCKS)  # (B,)
    src = raw + block * 34
    d = _half(src, ok)[:, None]  # (B, 1)
    i = tl.arange(0, 32)[None, :]
    q = tl.load(src[:, None] + 2 + i, mask=ok[:, None], other=0).to(tl.int8, bitcast=True).to(tl.float32)
    _write(out, block[:, None] * 32 + i, q * d, ok[:, None])


@triton.jit(do_not_specialize=["n_blocks"])
def _q4_0(raw, out, n_blocks, BLOCKS: tl.constexpr):
    # d: fp16, qs[16]: element i in the low nibble of byte i, element i+16 in its high nibble
    block, ok = _program_blocks(n_blocks, BLOCKS)
    src = raw + block * 18
    d = _half(src, ok)[:, None]
    i = tl.arange(0, 16)[None, :]
    packed = _byte(src[:, None] + 2 + i, ok[:, None])  # (B, 16)
    _write(out, block[:, None] * 32 + i, ((packed & 15) - 8).to(tl.float32) * d, ok[:, None])
    _write(out, block[:, None] * 32 + 16 + i, ((packed >> 4) - 8).to(tl.float32) * d, ok[:, None])


@triton.jit(do_not_specialize=["n_blocks"])
def _q4_1(raw, out, n_blocks, BLOCKS: tl.constexpr):
    # d, m: fp16, qs[16] as Q4_0; value = d * q + m
    block, ok = _program_blocks(n_blocks, BLOCKS)
    src = raw + block * 20
    d, m = _half(src, ok)[:, None], _half(src + 2, ok)[:, None]
    i = tl.arange(0, 16)[None, :]
    packed = _byte(src[:, None] + 4 + i, ok[:, None])
    _write(out, block[:, None] * 32 + i, (packed & 15).to(tl.float32) * d + m, ok[:, None])
    _write(out, block[:, None] * 32 + 16 + i, (packed >> 4).to(tl.float32) * d + m, ok[:, None])


@triton.jit
def _five_bit(src, ok, QH: tl.constexpr):
    """Q5_0/Q5_1 values (int32, 0-31) of elements i and i+16 (i: 0-15, (B, 16) each) of the blocks at `src`
    (B,): nibbles of qs (after the 4 bytes of qh at QH); bit 4 of element k is bit k of qh (little-endian)."""
    qh = (_byte(src + QH, ok) | (_byte(src + QH + 1, ok) << 8) | (_byte(src + QH + 2, ok) << 16)
          | (_byte(src + QH + 3, ok) << 24)).to(tl.uint32, bitcast=True)[:, None]  # (B, 1)
    i = tl.arange(0, 16)[None, :]
    packed = _byte(src[:, None] + QH + 4 + i, ok[:, None])  # (B, 16)
    low_bit = ((qh >> i) & 1).to(tl.int32)
    high_bit = ((qh >> (i + 16)) & 1).to(tl.int32)
    return (packed & 15) | (low_bit << 4), (packed >> 4) | (high_bit << 4)


@triton.jit(do_not_specialize=["n_blocks"])
def _q5_0(raw, out, n_blocks, BLOCKS: tl.constexpr):
    # d: fp16, qh[4], qs[16]
    block, ok = _program_blocks(n_blocks, BLOCKS)
    src = raw + block * 22
    d = _half(src, ok)[:, None]
    i = tl.arange(0, 16)[None, :]
    first, second = _five_bit(src, ok, 2)
    _write(out, block[:, None] * 32 + i, (first - 16).to(tl.float32) * d, ok[:, None])
    _write(out, block[:, None] * 32 + 16 + i, (second - 16).to(tl.float32) * d, ok[:, None])


@triton.jit(do_not_specialize=["n_blocks"])
def _q5_1(raw, out, n_blocks, BLOCKS: tl.constexpr):
    # d, m: fp16, qh[4], qs[16]; value = d * q + m
    block, ok = _program_blocks(n_blocks, BLOCKS)
    src = raw + block * 24
    d, m = _half(src, ok)[:, None], _half(src + 2, ok)[:, None]
    i = tl.arange(0, 16)[None, :]
    first, second = _five_bit(src, ok, 4)
    _write(out, block[:, None] * 32 + i, first.to(tl.float32) * d + m, ok[:, None])
    _write(out, block[:, None] * 32 + 16 + i, second.to(tl.float32) * d + m, ok[:, None])


@triton.jit(do_not_specialize=["n_blocks"])
def _iq4_nl(raw, out, n_blocks, levels, BLOCKS: tl.constexpr):
    # d: fp16, qs[16] as Q4_0, each nibble an index into IQ4_LEVELS
    block, ok = _program_blocks(n_blocks, BLOCKS)
    src = raw + block * 18
    d = _half(src, ok)[:, None]
    i = tl.arange(0, 16)[None, :]
    packed = _byte(src[:, None] + 2 + i, ok[:, None])
    _write(out, block[:, None] * 32 + i, tl.load(levels + (packed & 15)).to(tl.float32) * d, ok[:, None])
    _write(out, block[:, None] * 32 + 16 + i, tl.load(levels + (packed >> 4)).to(tl.float32) * d, ok[:, None])


# ---------------------------------------------------------------- 256-element K-quant super-blocks


@triton.jit(do_not_specialize=["n_blocks"])
def _q2_k(raw, out, n_blocks, BLOCKS: tl.constexpr):
    # scales[16] (low nibble scale, high nibble min of each 16 elements), qs[64] 2-bit, d, dmin: fp16.
    # Element 128h + 32j + 16c + t is field j (bits 2j, 2j+1) of qs byte 32h + 16c + t, sub-block 8h + 2j + c;
    # the tile's middle axis is u = 2h + c.
    block, ok = _program_blocks(n_blocks, BLOCKS)
    src = raw + block * 84
    d, dmin = _half(src + 80, ok)[:, None], _half(src + 82, ok)[:, None]  # (B, 1)
    u = tl.arange(0, 4)
    h, c = (u >> 1)[None, :], (u & 1)[None, :]  # (1, 4)
    t = tl.arange(0, 16)[None, None, :]
    ok3 = ok[:, None, None]
    packed = _byte(src[:, None, None] + 16 + 16 * u[None, :, None] + t, ok3)  # (B, 4, 16)
    at = block[:, None, None] * 256 + (128 * h + 16 * c)[:, :, None] + t
    for j in tl.static_range(4):
        sc = _byte(src[:, None] + 8 * h + 2 * j + c, ok[:, None])  # (B, 4)
        scale = (d * (sc & 15).to(tl.float32))[:, :, None]
        low = (dmin * (sc >> 4).to(tl.float32))[:, :, None]
        q = ((packed >> (2 * j)) & 3).to(tl.float32)
        _write(out, at + 32 * j, q * scale - low, ok3)


@triton.jit(do_not_specialize=["n_blocks"])
def _q3_k(raw, out, n_blocks, BLOCKS: tl.constexpr):
    # hmask[32], qs[64] 2-bit, scales[12] (16 signed 6-bit scales), d: fp16. Element 128h + 32j + 16c + t:
    # low 2 bits field j of qs byte 32h + 16c + t, bit 2 (stored inverted) bit 4h + j of hmask byte 16c + t,
    # scale k = 8h + 2j + c: low 4 bits nibble k // 8 of byte k % 8, high 2 bits field k // 4 of byte
    # 8 + k % 4, minus 32. The tile's middle axis is u = 2h + c.
    block, ok = _program_blocks(n_blocks, BLOCKS)
    src = raw + block * 110
    d = _half(src + 108, ok)[:, None]
    u = tl.arange(0, 4)
    h, c = (u >> 1)[None, :], (u & 1)[None, :]
    t = tl.arange(0, 16)[None, None, :]
    ok3 = ok[:, None, None]
    packed = _byte(src[:, None, None] + 32 + 16 * u[None, :, None] + t, ok3)  # (B, 4, 16)
    mask = _byte(src[:, None, None] + 16 * c[:, :, None] + t, ok3)
    high_shift = (4 * h)[:, :, None]
    at = block[:, None, None] * 256 + (128 * h + 16 * c)[:, :, None] + t
    for j in tl.static_range(4):
        k = 8 * h + 2 * j + c  # (1, 4)
        low_scale = (_byte(src[:, None] + 96 + (k & 7), ok[:, None]) >> (4 * (k >> 3))) & 15  # (B, 4)
        high_scale = (_byte(src[:, None] + 104 + (k & 3), ok[:, None]) >> (2 * (k >> 2))) & 3
        scale = (d * ((low_scale | (high_scale << 4)) - 32).to(tl.float32))[:, :, None]
        q = ((packed >> (2 * j)) & 3) - ((((mask >> (high_shift + j)) & 1) ^ 1) << 2)
        _write(out, at + 32 * j, q.to(tl.float32) * scale, ok3)


@triton.jit
def _k_scales(src, ok, d, dmin, S: tl.constexpr):
    """Q4_K/Q5_K's float32 scale d * sc and offset dmin * m of sub-blocks 2j + S (j: 0-3) of the blocks at
    `src` (B,), as (B, 4, 1) tensors."""
    scale, low = _k_scale_min(src[:, None] + 4, 2 * tl.arange(0, 4)[None, :] + S, ok[:, None])  # (B, 4)
    return (d * scale.to(tl.float32))[:, :, None], (dmin * low.to(tl.float32))[:, :, None]


@triton.jit(do_not_specialize=["n_blocks"])
def _q4_k(raw, out, n_blocks, BLOCKS: tl.constexpr):
    # d, dmin: fp16, scales[12], qs[128]: 64-element chunks j of 32 bytes, sub-block 2j in the low nibbles,
    # 2j + 1 in the high ones
    block, ok = _program_blocks(n_blocks, BLOCKS)
    src = raw + block * 144
    d, dmin = _half(src, ok)[:, None], _half(src + 2, ok)[:, None]  # (B, 1)
    j = tl.arange(0, 4)[None, :, None]
    i = tl.arange(0, 32)[None, None, :]
    ok3 = ok[:, None, None]
    packed = _byte(src[:, None, None] + 16 + 32 * j + i, ok3)  # (B, 4, 32)
    at = block[:, None, None] * 256 + 64 * j + i
    scale, low = _k_scales(src, ok, d, dmin, 0)
    _write(out, at, (packed & 15).to(tl.float32) * scale - low, ok3)
    scale, low = _k_scales(src, ok, d, dmin, 1)
    _write(out, at + 32, (packed >> 4).to(tl.float32) * scale - low, ok3)


@triton.jit(do_not_specialize=["n_blocks"])
def _q5_k(raw, out, n_blocks, BLOCKS: tl.constexpr):
    # d, dmin: fp16, scales[12], qh[32] (bit 4 of element 32s + i is bit s of qh[i]), qs[128] as Q4_K
    block, ok = _program_blocks(n_blocks, BLOCKS)
    src = raw + block * 176
    d, dmin = _half(src, ok)[:, None], _half(src + 2, ok)[:, None]
    j = tl.arange(0, 4)[None, :, None]
    i = tl.arange(0, 32)[None, None, :]
    ok3 = ok[:, None, None]
    packed = _byte(src[:, None, None] + 48 + 32 * j + i, ok3)  # (B, 4, 32)
    # qh[i] for every j: loaded on the (B, 4, 32) tile, so the loads share the tile's layout
    high = _byte(tl.broadcast_to(src[:, None, None] + 16 + i, (BLOCKS, 4, 32)), ok3) >> (2 * j)
    at = block[:, None, None] * 256 + 64 * j + i
    scale, low = _k_scales(src, ok, d, dmin, 0)
    _write(out, at, ((packed & 15) | ((high & 1) << 4)).to(tl.float32) * scale - low, ok3)
    scale, low = _k_scales(src, ok, d, dmin, 1)
    _write(out, at + 32, ((packed >> 4) | ((high & 2) << 3)).to(tl.float32) * scale - low, ok3)


@triton.jit(do_not_specialize=["n_blocks"])
def _q6_k(raw, out, n_blocks, BLOCKS: tl.constexpr):
    # ql[128], qh[64], scales[16] int8, d: fp16. Element 128h + 32k + 16c + t: low 4 bits nibble k // 2 of
    # ql byte 64h + 32(k % 2) + 16c + t, high 2 bits field k of qh byte 32h + 16c + t, scale 8h + 2k + c.
    # The tile's middle axis is u = 2h + c.
    block, ok = _program_blocks(n_blocks, BLOCKS)
    src = raw + block * 210
    d = _half(src + 208, ok)[:, None]
    u = tl.arange(0, 4)
    h, c = (u >> 1)[None, :], (u & 1)[None, :]
    t = tl.arange(0, 16)[None, None, :]
    ok3 = ok[:, None, None]
    ql = src[:, None, None] + (64 * h + 16 * c)[:, :, None] + t
    first, second = _byte(ql, ok3), _byte(ql + 32, ok3)  # (B, 4, 16)
    high = _byte(src[:, None, None] + 128 + 16 * u[None, :, None] + t, ok3)
    at = block[:, None, None] * 256 + (128 * h + 16 * c)[:, :, None] + t
    scales = src[:, None] + 192 + 8 * h + c  # (B, 4)
    _q6_k_quarter(out, at, scales, first, high, d, ok, 0)
    _q6_k_quarter(out, at, scales, second, high, d, ok, 1)
    _q6_k_quarter(out, at, scales, first, high, d, ok, 2)
    _q6_k_quarter(out, at, scales, second, high, d, ok, 3)


@triton.jit
def _q6_k_quarter(out, at, scales, packed, high, d, ok, K: tl.constexpr):
    """Elements 128h + 32K + 16c + t of Q6_K (see _q6_k); `packed` the ql bytes holding their low bits."""
    q = (((packed >> (4 * (K // 2))) & 15) | (((high >> (2 * K)) & 3) << 4)) - 32
    sc = tl.load(scales + 2 * K, mask=ok[:, None], other=0).to(tl.int8, bitcast=True)  # (B, 4)
    scale = (d * sc.to(tl.float32))[:, :, None]
    _write(out, at + 32 * K, q.to(tl.float32) * scale, ok[:, None, None])


@triton.jit(do_not_specialize=["n_blocks"])
def _iq4_xs(raw, out, n_blocks, levels, BLOCKS: tl.constexpr):
    # d: fp16, scales_h: 2 bytes (field s % 4 of byte s // 4: high 2 bits of sub-block s's scale),
    # scales_l[4] (nibble s % 2 of byte s // 2), qs[128]: sub-block s of 16 bytes, low nibbles first,
    # indexes into IQ4_LEVELS
    block, ok = _program_blocks(n_blocks, BLOCKS)
    src = raw + block * 136
    s = tl.arange(0, 8)[None, :]  # (1, 8)
    low_scale = (_byte(src[:, None] + 4 + (s >> 1), ok[:, None]) >> (4 * (s & 1))) & 15  # (B, 8)
    high_scale = (_byte(src[:, None] + 2 + (s >> 2), ok[:, None]) >> (2 * (s & 3))) & 3
    scale = (_half(src, ok)[:, None] * ((low_scale | (high_scale << 4)) - 32).to(tl.float32))[:, :, None]
    i = tl.arange(0, 16)[None, None, :]
    ok3 = ok[:, None, None]
    packed = _byte(src[:, None, None] + 8 + 16 * s[:, :, None] + i, ok3)  # (B, 8, 16)
    at = block[:, None, None] * 256 + 32 * s[:, :, None] + i
    _write(out, at, tl.load(levels + (packed & 15)).to(tl.float32) * scale, ok3)
    _write(out, at + 16, tl.load(levels + (packed >> 4)).to(tl.float32) * scale, ok3)


KERNELS = {
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
