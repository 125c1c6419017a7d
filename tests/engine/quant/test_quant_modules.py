"""Quantised layers (engine/quant/modules.py): a QuantLinear / QuantConv2d computes exactly what nn.Linear /
nn.Conv2d compute with gguf's own dequantisation of the same bytes; quantise_modules swaps a meta model's
layers in place and refuses what it cannot; a row split keeps quantised shards."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.memory.row_split import RowShardedLinear, shard_transformer_linears
from engine.quant.modules import (
    QuantConv2d,
    QuantLinear,
    QuantSpec,
    float_weight,
    quantise_modules,
    raw_shape,
    weight_shape,
)
from tests.engine.quant.gguf_models import quantise


def blocks(shape: tuple[int, ...], qtype: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes as uint8 rows of whole blocks, gguf's dequantisation in `shape`) of a random tensor."""
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.2
    row = shape[-1] if shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0] == 0 else 256
    raw = quantise(values.reshape(-1, row), qtype)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(shape)
    return torch.from_numpy(raw), torch.from_numpy(np.ascontiguousarray(expected))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_1", "Q4_K"])
def test_a_quant_linear_equals_nn_linear_on_the_dequantised_weight(qtype):
    model = nn.Sequential(nn.Linear(256, 64, device="meta"))
    quantise_modules(model, {"0.weight": QuantSpec(qtype, (64, 256))})
    raw, weight = blocks((64, 256), qtype)
    bias = torch.randn(64)
    model.load_state_dict({"0.weight": raw.reshape(raw_shape(qtype, (64, 256))), "0.bias": bias}, assign=True)
    x = torch.randn(3, 5, 256)
    assert isinstance(model[0], QuantLinear) and model[0].weight.dtype == torch.uint8
    assert torch.equal(model[0](x), F.linear(x, weight, bias))
    assert torch.equal(model[0](x.bfloat16()), F.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16()))


def test_a_quant_conv_stored_in_256_element_rows_equals_nn_conv2d():
    """ComfyUI-GGUF stores a 3x3 convolution as rows of 256 (comfy.gguf.orig_shape)."""
    shape = (64, 32, 3, 3)
    model = nn.Sequential(nn.Conv2d(32, 64, 3, stride=2, padding=1, device="meta"))
    quantise_modules(model, {"0.weight": QuantSpec("Q4_K", shape)})
    raw, weight = blocks(shape, "Q4_K")
    assert raw_shape("Q4_K", shape) == (64 * 32 * 9 // 256, 144)
    model.load_state_dict({"0.weight": raw.reshape(raw_shape("Q4_K", shape)), "0.bias": torch.zeros(64)},
                          assign=True)
    x = torch.randn(1, 32, 9, 9)
    assert isinstance(model[0], QuantConv2d) and weight_shape(model[0]) == shape
    assert torch.equal(model[0](x), F.conv2d(x, weight, torch.zeros(64), stride=2, padding=1))
    assert torch.equal(float_weight(model[0], torch.float32), weight)


def test_quantise_modules_refuses_what_is_not_a_linear_or_conv_weight_or_has_another_shape():
    model = nn.Sequential(nn.Linear(64, 32, device="meta"), nn.LayerNorm(32, device="meta"))
    with pytest.raises(ValueError, match=r"no Linear or Conv2d weight '1.weight'"):
        quantise_modules(model, {"1.weight": QuantSpec("Q8_0", (32,))})
    with pytest.raises(ValueError, match=r"0.weight has shape \(32, 64\); the Q8_0 tensor for it has "
                                         r"\(64, 32\)"):
        quantise_modules(model, {"0.weight": QuantSpec("Q8_0", (64, 32))})
    with pytest.raises(ValueError, match="whole blocks of 32"):
        raw_shape("Q8_0", (3, 5))
    assert type(model[0]) is nn.Linear  # nothing was swapped


def test_a_row_split_keeps_quantised_shards_and_equals_the_layer():
    layer = nn.Linear(256, 96, device="meta")
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Sequential(layer)])
    quantise_modules(model, {"layers.0.0.weight": QuantSpec("Q8_0", (96, 256))})
    raw, weight = blocks((96, 256), "Q8_0")
    bias = torch.randn(96)
    model.load_state_dict({"layers.0.0.weight": raw, "layers.0.0.bias": bias}, assign=True)
    x = torch.randn(4, 256)
    expected = layer(x)
    shard_transformer_linears(model, ["cpu", "cpu"], [1, 2])
    sharded = model.layers[0][0]
    assert isinstance(sharded, RowShardedLinear) and all(s.dtype == torch.uint8 for s in sharded.shards)
    assert [s.shape[0] for s in sharded.shards] == [32, 64]
    assert torch.allclose(sharded(x), expected, rtol=0, atol=1e-5)  # only the matmul blocking differs
    assert torch.equal(expected, F.linear(x, weight, bias))
