"""Layers whose weight rests quantised and is dequantised on the compute device as each call runs (issue 17).

A quantised weight is an ordinary `uint8` parameter of shape (rows, row bytes) holding the GGML blocks as a
file stores them, so everything that counts, copies and binds parameters (the weight store, the ledger, the
segment planner, streaming, the live panel) handles quantised bytes as it handles any other tensor. The layer
knows the weight's GGML type and its logical (torch-order) shape; its forward dequantises the bytes, on the
device they are on and into the input's dtype, just before the product, and drops the result after.

`quantise_modules` turns the `nn.Linear` (FLUX's `CastLinear` too) and `nn.Conv2d` layers of a model built on
the `meta` device into these layers in place (the objects stay the same, so a cached stage list still holds
them), each with a `meta` uint8 placeholder that the loader binds. Embeddings, norms and biases keep their
float types: only the weights of those layers rest quantised.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant.dequant import dequantize
from engine.quant.types import QUANTIZED, ggml_type


@dataclass(frozen=True)
class QuantSpec:
    """One weight that rests quantised: its type and both of its shapes."""

    qtype: str  # GGML type name, e.g. "Q4_K"
    shape: tuple[int, ...]  # the logical, torch-order shape the layer computes with, e.g. (out, in)

    @property
    def raw_shape(self) -> tuple[int, int]:
        return raw_shape(self.qtype, self.shape)


def raw_shape(qtype: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, row bytes) of the stored blocks of a `qtype` tensor of logical `shape`: rows of the last
    dimension when it is whole blocks (a Linear's output features), else one block per row (a ComfyUI-GGUF
    tensor reshaped to 256-element rows, e.g. a 3x3 convolution)."""
    t = ggml_type(qtype, accepted=QUANTIZED)
    numel = math.prod(shape)
    if numel % t.block_size:
        raise ValueError(f"a {t.name} tensor holds whole blocks of {t.block_size} elements; shape {shape} "
                         f"holds {numel}")
    row = shape[-1] if shape and shape[-1] % t.block_size == 0 else t.block_size
    return numel // row, row // t.block_size * t.type_size


class QuantLinear(nn.Linear):
    """nn.Linear whose weight rests as GGML blocks; weight and bias compute in the input's dtype (as FLUX's
    CastLinear)."""

    qtype: str
    weight_shape: tuple[int, ...]

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.qtype, self.weight_shape, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, qtype={self.qtype}"


class QuantConv2d(nn.Conv2d):
    """nn.Conv2d whose weight rests as GGML blocks; weight and bias compute in the input's dtype."""

    qtype: str
    weight_shape: tuple[int, ...]

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.qtype, self.weight_shape, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return self._conv_forward(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, qtype={self.qtype}"


QUANT_LAYERS = (QuantLinear, QuantConv2d)


def quantisable_weights(model: nn.Module) -> dict[str, nn.Module]:
    """Parameter name -> layer of every weight that may rest quantised: those of the model's `nn.Linear`
    and `nn.Conv2d` layers (subclasses included; already quantised ones too)."""
    return {f"{name}.weight" if name else "weight": module for name, module in model.named_modules()
            if isinstance(module, nn.Linear | nn.Conv2d) and module._parameters.get("weight") is not None}


def quantise_modules(model: nn.Module, specs: Mapping[str, QuantSpec]) -> list[str]:
    """Turn the layers whose weights `specs` names (parameter name -> spec) into QuantLinear / QuantConv2d
    with a `meta` uint8 weight of the spec's stored shape; returns the names, in model order.

    The model must be on `meta` (nothing is bound yet). A name that is not the weight of a Linear or Conv2d,
    or whose spec's shape is not the weight's, is an error naming it.
    """
    layers = quantisable_weights(model)
    unknown = sorted(set(specs) - set(layers))
    if unknown:
        raise ValueError(f"{type(model).__name__} has no Linear or Conv2d weight {unknown[0]!r} to quantise"
                         + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    done = []
    for name, layer in layers.items():
        spec = specs.get(name)
        if spec is None:
            continue
        weight = layer._parameters["weight"]
        if not weight.is_meta:
            raise ValueError(f"{name} is already bound; quantise the layers of a model built on meta")
        if tuple(weight_shape(layer)) != tuple(spec.shape):
            raise ValueError(f"{name} has shape {tuple(weight_shape(layer))}; the {spec.qtype} tensor for it "
                             f"has {tuple(spec.shape)}")
        layer.__class__ = QuantConv2d if isinstance(layer, nn.Conv2d) else QuantLinear
        layer.qtype, layer.weight_shape = spec.qtype, tuple(spec.shape)
        layer.weight = nn.Parameter(torch.empty(spec.raw_shape, dtype=torch.uint8, device="meta"),
                                    requires_grad=False)
        done.append(name)
    return done


def weight_shape(module: nn.Module, name: str = "weight") -> torch.Size:
    """The logical shape of parameter `name` of `module`: a quantised layer's weight computes with its
    `weight_shape`, every other parameter with its own shape."""
    if name == "weight" and isinstance(module, QUANT_LAYERS):
        return torch.Size(module.weight_shape)
    return module._parameters[name].shape


def quant_type(module: nn.Module, name: str = "weight") -> str | None:
    """The GGML type parameter `name` of `module` rests in, or None for a float parameter."""
    return module.qtype if name == "weight" and isinstance(module, QUANT_LAYERS) else None


def float_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight of a Linear or Conv2d in `dtype`: dequantised for a quantised layer, cast otherwise."""
    if isinstance(module, QUANT_LAYERS):
        return module.dequantized_weight(dtype)
    return module.weight.to(dtype)
