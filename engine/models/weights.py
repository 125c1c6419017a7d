"""Bind checkpoint tensors to a model built on the `meta` device, without copying them."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

_SHOWN = 10  # how many offending keys an error lists per kind


class WeightBindingError(ValueError):
    """The tensors given to `bind_weights` do not match the module's parameters by name and shape."""


def _listing(kind: str, keys: list[str]) -> str:
    more = f", ... ({len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else ""
    return f"{len(keys)} {kind} key(s): {', '.join(keys[:_SHOWN])}{more}"


def bind_weights(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Make `tensors` the module's parameters and buffers by name (strict, `assign=True`: no copy).

    Raises WeightBindingError listing missing keys, unexpected keys and shape mismatches
    (the first 10 of each with their counts) before anything is bound.
    """
    expected = module.state_dict(keep_vars=True)
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    mismatched = sorted(
        f"{key} (expected {tuple(expected[key].shape)}, got {tuple(tensors[key].shape)})"
        for key in expected.keys() & tensors.keys()
        if tuple(expected[key].shape) != tuple(tensors[key].shape)
    )
    problems = [_listing(kind, keys) for kind, keys in
                (("missing", missing), ("unexpected", unexpected), ("shape-mismatched", mismatched)) if keys]
    if problems:
        raise WeightBindingError(f"cannot bind weights to {type(module).__name__}: " + "; ".join(problems))
    module.load_state_dict(dict(tensors), strict=True, assign=True)
