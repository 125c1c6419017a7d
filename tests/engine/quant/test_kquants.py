"""K-quant quantisers against ggml's C reference: identical bytes, and llama.cpp's own error bounds.

data/kquant_reference.npz holds the inputs and the bytes ggml's `quantize_row_q{2..6}_K_ref` wrote for them
(ggml commit d99724f2, src/ggml-quants.c built with gcc -O2 -ffp-contract=off for x86-64): llama.cpp's
test-quantize-fns data (0.1 + 2 cos i, 4096 values), heavy-tailed weights at scales 2^-12 to 2^3, standard
normal values (whose Q4_K weights need a correctly rounded square root), and edge blocks (zero, constant,
tiny, all-negative, all-positive, one spike, half zero, outliers, small integers).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.quant.dequant import dequantize
from engine.quant.quantize import quantize

REFERENCE = np.load(Path(__file__).parent / "data" / "kquant_reference.npz")
DATASETS = ("llama_cpp_test_data", "weights", "normal", "edge_cases")
K_TYPES = ("Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K")
# tests/test-quantize-fns.cpp: MAX_QUANTIZATION_TOTAL_ERROR (_3BITS, _2BITS), its array_rmse being
# sqrt(sum of squared differences) / n
LLAMA_CPP_TOTAL_ERROR = {"Q6_K": 0.002, "Q5_K": 0.002, "Q4_K": 0.002, "Q3_K": 0.004, "Q2_K": 0.0075}


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_quants_give_the_bytes_of_ggmls_reference_quantiser(qtype, dataset):
    x = torch.from_numpy(REFERENCE[dataset]).reshape(-1, 256)
    expected = torch.from_numpy(REFERENCE[f"{dataset}.{qtype}"])
    ours = quantize(x, qtype)
    differing = (ours != expected).any(dim=1).nonzero().flatten().tolist()
    assert differing == [], f"blocks {differing} of {len(expected)} differ from ggml's"


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_quant_error_is_within_llama_cpps_bound_on_its_test_data(qtype):
    x = torch.from_numpy(REFERENCE["llama_cpp_test_data"])
    back = dequantize(quantize(x, qtype), qtype, tuple(x.shape))
    error = torch.sqrt(((back.double() - x.double()) ** 2).sum()) / x.numel()
    assert error < LLAMA_CPP_TOTAL_ERROR[qtype]


def test_k_quants_take_any_leading_shape_and_row_of_whole_super_blocks():
    x = torch.randn(2, 3, 512)
    assert quantize(x, "Q4_K").shape == (6, 2 * 144)
    with pytest.raises(ValueError, match=r"its last dim must be a multiple of 256"):
        quantize(torch.randn(4, 128), "Q6_K")
