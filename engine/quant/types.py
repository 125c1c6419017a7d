"""The GGML tensor types: id, block size and bytes per block (ggml.c's type_traits, gguf's GGML_QUANT_SIZES).

A GGML row of `n` elements of a block type is `n / block_size` blocks of `type_size` bytes each; plain types
(F32, F16, ...) are blocks of one element. Every type a GGUF file may name is listed, so a reader can size
any tensor; `DEQUANTIZABLE` is the subset this engine turns into torch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

QK_K = 256  # elements in a K-quant (and IQ4_XS) super-block


@dataclass(frozen=True)
class GGMLType:
    name: str  # "Q4_K", as ggml and gguf spell it
    type_id: int  # the number stored in a GGUF tensor info
    block_size: int  # elements per block
    type_size: int  # bytes per block


GGML_TYPES: dict[str, GGMLType] = {
    t.name: t
    for t in (
        GGMLType("F32", 0, 1, 4),
        GGMLType("F16", 1, 1, 2),
        GGMLType("Q4_0", 2, 32, 2 + 16),
        GGMLType("Q4_1", 3, 32, 2 + 2 + 16),
        GGMLType("Q5_0", 6, 32, 2 + 4 + 16),
        GGMLType("Q5_1", 7, 32, 2 + 2 + 4 + 16),
        GGMLType("Q8_0", 8, 32, 2 + 32),
        GGMLType("Q8_1", 9, 32, 4 + 4 + 32),
        GGMLType("Q2_K", 10, QK_K, 2 + 2 + QK_K // 16 + QK_K // 4),
        GGMLType("Q3_K", 11, QK_K, 2 + QK_K // 4 + QK_K // 8 + 12),
        GGMLType("Q4_K", 12, QK_K, 2 + 2 + QK_K // 2 + 12),
        GGMLType("Q5_K", 13, QK_K, 2 + 2 + QK_K // 2 + QK_K // 8 + 12),
        GGMLType("Q6_K", 14, QK_K, 2 + QK_K // 2 + QK_K // 4 + QK_K // 16),
        GGMLType("Q8_K", 15, QK_K, 4 + QK_K + QK_K // 8),
        GGMLType("IQ2_XXS", 16, QK_K, 2 + QK_K // 4),
        GGMLType("IQ2_XS", 17, QK_K, 2 + QK_K // 4 + QK_K // 32),
        GGMLType("IQ3_XXS", 18, QK_K, 2 + QK_K // 4 + QK_K // 8),
        GGMLType("IQ1_S", 19, QK_K, 2 + QK_K // 8 + QK_K // 16),
        GGMLType("IQ4_NL", 20, 32, 2 + 16),
        GGMLType("IQ3_S", 21, QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
        GGMLType("IQ2_S", 22, QK_K, 2 + QK_K // 4 + QK_K // 16),
        GGMLType("IQ4_XS", 23, QK_K, 2 + 2 + QK_K // 2 + QK_K // 64),
        GGMLType("I8", 24, 1, 1),
        GGMLType("I16", 25, 1, 2),
        GGMLType("I32", 26, 1, 4),
        GGMLType("I64", 27, 1, 8),
        GGMLType("F64", 28, 1, 8),
        GGMLType("IQ1_M", 29, QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
        GGMLType("BF16", 30, 1, 2),
        GGMLType("TQ1_0", 34, QK_K, 2 + 4 * 13),
        GGMLType("TQ2_0", 35, QK_K, 2 + 64),
        GGMLType("MXFP4", 39, 32, 1 + 16),
        GGMLType("NVFP4", 40, 64, 4 + 32),
        GGMLType("Q1_0", 41, 128, 2 + 16),
    )
}
GGML_TYPES_BY_ID: dict[int, GGMLType] = {t.type_id: t for t in GGML_TYPES.values()}

# the types `engine.quant.dequantize` turns into floating-point torch tensors
DEQUANTIZABLE = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
)
# the types that are quantised blocks (not plain floats); they stay as bytes until dequantised
QUANTIZED = tuple(name for name in DEQUANTIZABLE if GGML_TYPES[name].block_size > 1)


class UnsupportedQuantTypeError(ValueError):
    """A GGML type this engine cannot dequantise (or quantise to); the message lists the accepted ones."""


def ggml_type(qtype: str, tensor: str | None = None, accepted: tuple[str, ...] = DEQUANTIZABLE) -> GGMLType:
    """The GGMLType named `qtype` (any case); an error naming the tensor and listing `accepted` otherwise."""
    name = qtype.upper()
    if name not in accepted:
        where = f" of tensor '{tensor}'" if tensor is not None else ""
        kind = "unknown GGML type" if name not in GGML_TYPES else "unsupported GGML type"
        raise UnsupportedQuantTypeError(f"{kind} {qtype!r}{where}; accepted: {', '.join(accepted)}")
    return GGML_TYPES[name]


def row_bytes(qtype: str, row_elements: int, tensor: str | None = None) -> int:
    """Bytes of one row of `row_elements` elements of `qtype`; the row must be whole blocks."""
    t = GGML_TYPES[qtype]
    if row_elements % t.block_size:
        where = f"tensor '{tensor}': " if tensor is not None else ""
        raise ValueError(f"{where}a row of {row_elements} elements is not a whole number of {qtype} blocks "
                         f"({t.block_size} elements each)")
    return row_elements // t.block_size * t.type_size
