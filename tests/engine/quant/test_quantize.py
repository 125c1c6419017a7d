"""engine.quant.quantize against gguf-py's reference quantisers: identical bytes on random, constant, zero,
tied, huge and tiny blocks, from float32, float16 and bfloat16 tensors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.quant.dequant import dequantize
from engine.quant.quantize import QUANTIZABLE, quantize
from engine.quant.types import UnsupportedQuantTypeError

# gguf-py has no K-quant or IQ4 quantiser (test_kquants.py, test_iquants.py check those against ggml's C)
GGUF_QUANTIZABLE = [t for t in QUANTIZABLE if not t.endswith("_K") and not t.startswith("IQ")]
# gguf's numpy warns when a scale overflows fp16 (the awkward rows make some do so on purpose)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")


def awkward_rows(seed: int) -> torch.Tensor:
    """(24, 256) float32: each row of 32-element blocks at another scale, plus zero, constant, tied-extreme,
    fp16-overflowing and fp16-subnormal blocks and values that land exactly on rounding midpoints."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(24, 256, generator=generator)
    rows *= torch.logspace(-9, 6, 24).unsqueeze(1)  # 1e-9 (subnormal fp16 scales) to 1e6 (beyond fp16)
    rows[0, :32] = 0
    rows[0, 32:64] = 3.25
    rows[1, :32] = torch.linspace(-1, 1, 32)  # +-1 tie: the first of equal magnitudes wins
    rows[1, 32:64] = torch.arange(32) - 15.5  # halves after scaling
    rows[2, :32] = torch.arange(-16, 16) * (127 / 16)
    rows[2, 32:64] = torch.arange(-15.5, 16.5)  # with 127 below: Q8_0's scale is 1, every value a midpoint
    rows[2, 63] = 127
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", GGUF_QUANTIZABLE)
def test_quantize_gives_the_bytes_gguf_gives(qtype, dtype):
    x = awkward_rows(seed=len(qtype)).to(dtype)
    if dtype == torch.float16:
        # the tiniest rows flush to zeros of either sign, and gguf's numpy min/max picks a zero's sign by
        # SIMD order (ggml's C and we keep the first): make them +0
        x = x.clamp(-60000, 60000) + 0.0
    expected = gguf.quants.quantize(x.float().numpy(), gguf.GGMLQuantizationType[qtype])
    expected = torch.from_numpy(np.ascontiguousarray(expected).view(np.uint8))
    ours = quantize(x, qtype)
    assert ours.dtype == torch.uint8 and ours.shape == expected.shape
    mismatched = (ours != expected).sum().item()
    assert mismatched == 0, f"{mismatched} of {ours.numel()} bytes differ"


def test_bf16_keeps_a_nan_sign_and_payload_quiet_as_ggml_does():
    bits = np.array([0xFF800001, 0x3F800000, 0x7FC12345, 0x7F7FFFFF, 0x3F808000], dtype=np.uint32)
    x = torch.from_numpy(bits.view(np.float32))  # -sNaN, 1, qNaN with payload, max float, a tie
    expected = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.BF16).view(np.uint8)
    assert torch.equal(quantize(x, "BF16").reshape(-1), torch.from_numpy(expected.reshape(-1)))


def test_a_zero_minimum_takes_the_sign_of_the_first_zero_as_in_ggml():
    block = torch.zeros(32)
    block[5] = -0.0
    assert quantize(block, "Q4_1")[0, 2:4].tolist() == [0, 0]  # +0, the first zero
    block[0] = -0.0
    assert quantize(block, "Q4_1")[0, 2:4].tolist() == [0, 0x80]  # -0


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q5_0"])
def test_quantize_then_dequantize_keeps_the_shape_and_is_close(qtype):
    x = torch.randn(3, 4, 64)
    raw = quantize(x, qtype)
    assert raw.shape[0] == 12
    back = dequantize(raw, qtype, (3, 4, 64))
    assert (back - x).abs().max() < 0.3


def test_quantize_refuses_a_row_that_is_not_whole_blocks_and_types_it_cannot_write():
    with pytest.raises(ValueError, match=r"shape \(4, 48\) to Q8_0: its last dim must be a multiple of 32"):
        quantize(torch.zeros(4, 48), "Q8_0")
    with pytest.raises(UnsupportedQuantTypeError, match="'IQ2_XXS'; accepted: F32, F16, BF16, Q8_0"):
        quantize(torch.zeros(256), "IQ2_XXS")
