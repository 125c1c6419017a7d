"""IQ4_NL / IQ4_XS quantisers against ggml's C: identical bytes, a round trip close to the input, and a GGUF
that `sluice convert --type iq4_xs` writes as gguf-py reads and dequantises it.

data/iquant_reference.npz holds the bytes ggml-quants.c's `quantize_iq4_nl` / `quantize_iq4_xs` wrote (their
`quantize_row_iq4_nl_impl` with 7 tries and no importance matrix, as ggml_quantize_chunk calls it; the C
built with gcc -O2 -ffp-contract=off for x86-64, fp16 rounded to nearest even) for the inputs of
data/kquant_reference.npz (llama.cpp's test data, heavy-tailed weights, normal values, edge blocks) and for
"wide": 32-element blocks at scales 1e-8 to 1e4, with quarter steps and integers (ties between levels), a zero
block and one below GROUP_MAX_EPS. gguf-py has no quantiser for these types.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.quant.convert import convert_checkpoint
from engine.quant.dequant import IQ4_LEVELS, dequantize
from engine.quant.iquants import _best_index
from engine.quant.quantize import quantize

DATA = Path(__file__).parent / "data"
REFERENCE = np.load(DATA / "iquant_reference.npz")
INPUTS = np.load(DATA / "kquant_reference.npz")
DATASETS = ("llama_cpp_test_data", "weights", "normal", "edge_cases", "wide")


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS"])
def test_iq4_quantisers_give_the_bytes_of_ggmls(qtype, dataset):
    x = torch.from_numpy(REFERENCE[dataset] if dataset in REFERENCE else INPUTS[dataset])
    expected = torch.from_numpy(REFERENCE[f"{dataset}.{qtype}"])
    ours = quantize(x.reshape(-1, 256), qtype).reshape(expected.shape)
    differing = (ours != expected).any(dim=1).nonzero().flatten().tolist()
    assert differing == [], f"blocks {differing} of {len(expected)} differ from ggml's"


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS"])
def test_iq4_round_trip_is_close_on_llama_cpps_test_data(qtype):
    x = torch.from_numpy(INPUTS["llama_cpp_test_data"])
    back = dequantize(quantize(x, qtype), qtype, tuple(x.shape))
    error = torch.sqrt(((back.double() - x.double()) ** 2).sum()) / x.numel()
    assert error < 0.002  # llama.cpp's MAX_QUANTIZATION_TOTAL_ERROR, which it applies to 4-bit types


def test_the_nearest_level_breaks_ties_upwards_as_ggmls_binary_search_does():
    levels = torch.tensor(IQ4_LEVELS, dtype=torch.float32)
    x = torch.tensor([7.0, 6.9, -115.5, 0.0, -127.0, 113.0, 200.0, -200.0, float("nan")])
    assert _best_index(x, levels).tolist() == [9, 8, 1, 8, 0, 15, 15, 0, 15]


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS"])
def test_convert_writes_iq4_that_gguf_reads_and_dequantises_as_we_do(tmp_path, qtype):
    proj = "double_blocks.0.img_attn.proj.weight"
    state = {proj: torch.randn(64, 256, generator=torch.Generator().manual_seed(2)),
             "double_blocks.0.img_attn.proj.bias": torch.zeros(64)}
    save_file(state, tmp_path / "flux.safetensors")
    convert_checkpoint(tmp_path / "flux.safetensors", tmp_path / "flux.gguf", qtype.lower())
    tensor = {t.name: t for t in gguf.GGUFReader(tmp_path / "flux.gguf").tensors}[proj]
    assert tensor.tensor_type.name == qtype
    data = np.array(tensor.data).reshape(64, -1)
    assert np.array_equal(data, quantize(state[proj], qtype).numpy())
    theirs = torch.from_numpy(gguf.quants.dequantize(data, tensor.tensor_type)).reshape(64, 256)
    assert torch.equal(dequantize(torch.from_numpy(data), qtype, (64, 256)), theirs)
