"""engine.quant.dequantize against gguf-py's reference dequantiser: bit-exact on random blocks, with extreme
fp16 scales (largest finite, smallest normal, subnormal, zero, negative), every output dtype."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.quant import dequant
from engine.quant.dequant import dequantize
from engine.quant.types import DEQUANTIZABLE, GGML_TYPES, UnsupportedQuantTypeError

# byte offsets of each type's fp16 scale fields inside its block
FP16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}
EXTREME_SCALES = np.array([65504.0, -65504.0, 6.1035e-05, 5.96e-08, -5.96e-08, 3.0e-06, 0.0, -0.0, 1.0],
                          dtype=np.float16)


def random_blocks(qtype: str, n_blocks: int, seed: int) -> np.ndarray:
    """Random bytes for `n_blocks` blocks whose fp16 scales are finite: random finite halves (any exponent
    below inf/nan's), with the extreme values above in every field at least once."""
    rng = np.random.default_rng(seed)
    t = GGML_TYPES[qtype]
    blocks = rng.integers(0, 256, (n_blocks, t.type_size), dtype=np.uint8)
    for offset in FP16_FIELDS.get(qtype, ()):
        bits = rng.integers(0, 0x7C00, n_blocks, dtype=np.uint16) | (rng.integers(0, 2, n_blocks,
                                                                               dtype=np.uint16) << 15)
        halves = bits.view(np.float16)
        halves[: len(EXTREME_SCALES)] = EXTREME_SCALES
        halves[len(EXTREME_SCALES): 2 * len(EXTREME_SCALES)] = rng.permutation(EXTREME_SCALES)
        blocks[:, offset:offset + 2] = halves.view(np.uint8).reshape(n_blocks, 2)
    if t.block_size == 1:  # plain float types: random finite values of the type
        values = {"F32": rng.standard_normal(n_blocks).astype(np.float32) * 1e30,
                  "F16": rng.standard_normal(n_blocks).astype(np.float16),
                  "BF16": (rng.standard_normal(n_blocks).astype(np.float32).view(np.uint32) >> 16)
                  .astype(np.uint16)}[qtype]
        blocks = values.view(np.uint8).reshape(n_blocks, t.type_size)
    return blocks


def reference(blocks: np.ndarray, qtype: str, rows: int) -> torch.Tensor:
    values = gguf.quants.dequantize(blocks.reshape(rows, -1), gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def assert_bits_equal(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert ours.shape == expected.shape and ours.dtype == expected.dtype
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[ours.dtype]
    mismatched = (ours.view(bits) != expected.view(bits)).sum().item()
    assert mismatched == 0, f"{mismatched} of {ours.numel()} values differ in their bits"


@pytest.mark.parametrize("qtype", DEQUANTIZABLE)
def test_dequantize_is_bit_exact_against_gguf_on_random_blocks_with_extreme_scales(qtype):
    t = GGML_TYPES[qtype]
    rows, blocks_per_row = 6, 2048 // t.block_size
    blocks = random_blocks(qtype, rows * blocks_per_row, seed=sum(map(ord, qtype)))
    expected = reference(blocks, qtype, rows)
    raw = torch.from_numpy(blocks.reshape(rows, -1))
    ours = dequantize(raw, qtype, (rows, blocks_per_row * t.block_size))
    assert_bits_equal(ours, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K", "Q6_K", "IQ4_XS", "BF16"])
def test_dequantize_to_a_half_dtype_rounds_like_casting_the_float32_result(qtype, dtype):
    t = GGML_TYPES[qtype]
    blocks = random_blocks(qtype, 4 * 2048 // t.block_size, seed=7)
    expected = reference(blocks, qtype, 4).to(dtype)
    ours = dequantize(torch.from_numpy(blocks.reshape(4, -1)), qtype, (4, 2048), dtype)
    assert_bits_equal(ours, expected)


def test_dequantize_gives_the_logical_shape_from_any_byte_layout_and_an_unaligned_slice():
    blocks = random_blocks("Q4_K", 24, seed=3)
    expected = reference(blocks, "Q4_K", 24).reshape(2, 12, 16, 16)
    flat = torch.from_numpy(blocks.reshape(-1))
    assert_bits_equal(dequantize(flat, "Q4_K", (2, 12, 16, 16)), expected)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), flat])[1:]  # storage offset 1
    assert_bits_equal(dequantize(shifted, "q4_k", (2, 12, 16, 16)), expected)


def test_f32_to_f32_is_a_view_of_the_bytes():
    raw = torch.arange(8, dtype=torch.float32).view(torch.uint8)
    values = dequantize(raw, "F32", (2, 4))
    assert values.data_ptr() == raw.data_ptr() and values.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_unsupported_type_names_the_type_and_lists_the_accepted_ones():
    with pytest.raises(UnsupportedQuantTypeError, match=r"unsupported GGML type 'IQ2_XXS'; accepted: F32, "
                                                        r"F16, BF16, Q4_0.*IQ4_XS"):
        dequantize(torch.zeros(66, dtype=torch.uint8), "IQ2_XXS", (256,))
    with pytest.raises(UnsupportedQuantTypeError, match="unknown GGML type 'Q9_9'"):
        dequantize(torch.zeros(66, dtype=torch.uint8), "Q9_9", (256,))


@pytest.mark.parametrize(("numel", "shape", "message"), [
    (34, (2, 12), r"shape \(2, 12\) is not whole Q8_0 blocks \(32 elements each\)"),
    (33, (32,), "Q8_0 tensor of shape \\(32,\\) takes 34 bytes, got 33"),
])
def test_wrong_byte_count_or_partial_block_row_is_a_clear_error(numel, shape, message):
    with pytest.raises(ValueError, match=message):
        dequantize(torch.zeros(numel, dtype=torch.uint8), "Q8_0", shape)


def test_every_quantised_type_has_a_dequantiser_and_the_table_agrees_with_gguf():
    assert set(dequant.DEQUANTIZERS) | set(dequant.PLAIN_DTYPES) == set(DEQUANTIZABLE)
    for name, t in GGML_TYPES.items():
        qtype = gguf.GGMLQuantizationType[name]
        assert (t.type_id, t.block_size, t.type_size) == (int(qtype), *gguf.GGML_QUANT_SIZES[qtype])
    assert set(GGML_TYPES) == {q.name for q in gguf.GGMLQuantizationType}


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "IQ4_XS"])
def test_dequantize_traces_as_one_graph_for_torch_compile(qtype):
    t = GGML_TYPES[qtype]
    blocks = random_blocks(qtype, 4 * 2048 // t.block_size, seed=11)
    torch._dynamo.reset()
    # fullgraph: a graph break (a .item(), a data-dependent shape) is an error
    traced = torch.compile(dequantize, backend="eager", fullgraph=True, dynamic=False)
    ours = traced(torch.from_numpy(blocks.reshape(4, -1)), qtype, (4, 2048), torch.bfloat16)
    assert_bits_equal(ours, reference(blocks, qtype, 4).to(torch.bfloat16))
