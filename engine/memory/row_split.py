"""Row split (reference/000, "--split-mode row"): transformer-block linear weights sharded by rows.

Each sharded linear keeps its weight's rows (output features) in slices on the listed devices, in proportion
to their free memory; the forward copies the input to every device, runs one `F.linear` per slice there (the
devices compute in parallel: each launch is asynchronous on its own device), gathers the partial outputs on
the main (first) device along the feature dimension and adds the bias there. A row slice does not change any
output's reduction, so the result equals the unsharded layer's up to the matmul kernel's blocking.

Sharded weights are resident on their devices for good (split weights load synchronously, without the
segment prefetch); the bias stays an ordinary parameter of the module, so the main device's weight store owns
it with the rest of the model. Which linears: every `nn.Linear` inside a block list, an `nn.ModuleList`
attribute named in `BLOCK_LISTS` (the UNet's `transformer_blocks`, CLIP's `layers` or `resblocks`, FLUX's
`double_blocks` and `single_blocks`, T5's `block`).

A quantised linear (engine/quant/modules.py) whose stored rows are its output features keeps its shards
quantised, each dequantised on its device as it computes; one stored in other rows (a ComfyUI-GGUF tensor
reshaped to 256-element rows) is dequantised to its bias's dtype (float32 without a bias) before sharding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant.dequant import dequantize

BLOCK_LISTS = ("transformer_blocks", "layers", "resblocks", "double_blocks", "single_blocks", "block")

Source = Callable[[str], torch.Tensor]  # parameter name -> tensor (a checkpoint reader)
Reserve = Callable[[int, str, int], None]  # (device index in the list, slice name, bytes) before allocating


def split_rows(rows: int, fractions: Sequence[float]) -> list[int]:
    """Row counts per device summing to `rows`, proportional to `fractions` (largest remainder)."""
    if not fractions or any(f < 0 for f in fractions) or sum(fractions) <= 0:
        raise ValueError(f"row-split fractions {list(fractions)} must be non-negative with a positive sum")
    total = sum(fractions)
    exact = [rows * f / total for f in fractions]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[: rows - sum(counts)]:
        counts[i] += 1
    return counts


class RowShardedLinear(nn.Module):
    """`F.linear` with the weight's rows on several devices and the output gathered on the first device."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | nn.Parameter | None,
        shards: Sequence[tuple[torch.device | str, float]],
        name: str = "linear",
        reserve: Reserve | None = None,
        qtype: str | None = None,
        in_features: int | None = None,
    ) -> None:
        """`weight` [out, in] is sliced by rows over `shards` (device, fraction); the first device is the
        main one. `reserve` is called with each slice's bytes before it is allocated on its device. A
        quantised `weight` is its stored bytes [out, row bytes] of GGML type `qtype` with `in_features`
        elements a row."""
        super().__init__()
        if weight.ndim != 2:
            raise ValueError(f"{name}: a row split needs a 2-D weight, got shape {tuple(weight.shape)}")
        devices = [torch.device(device) for device, _ in shards]
        counts = split_rows(weight.shape[0], [fraction for _, fraction in shards])
        self.qtype = qtype
        self.in_features, self.out_features = in_features or weight.shape[1], weight.shape[0]
        self.main_device = devices[0]
        self.rows: list[tuple[int, int]] = []  # (start, stop) of each kept slice, in output order
        self.shards: list[torch.Tensor] = []  # [rows, in] slices, each on its device
        start = 0
        for index, (device, count) in enumerate(zip(devices, counts, strict=True)):
            if count == 0:
                continue
            part = weight[start : start + count]
            if reserve is not None:
                reserve(index, f"{name}.weight[{start}:{start + count}]", part.numel() * part.element_size())
            self.shards.append(part.to(device).contiguous())
            self.rows.append((start, start + count))
            start += count
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias.to(self.main_device), requires_grad=False)
        self.bias = bias

    @property
    def devices(self) -> list[torch.device]:
        return [shard.device for shard in self.shards]

    def shard_bytes(self) -> list[tuple[torch.device, int]]:
        return [(shard.device, shard.numel() * shard.element_size()) for shard in self.shards]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # copies first, then the other devices' matmuls, then the input device's: none waits for another
        inputs = {device: x.to(device, non_blocking=True) for device in self.devices}
        order = sorted(range(len(self.shards)), key=lambda i: self.shards[i].device == x.device)
        partial: list[torch.Tensor | None] = [None] * len(self.shards)
        for i in order:
            shard = self._weight(i, x.dtype)  # a stored (fp8, quantised) weight computes in the input's dtype
            partial[i] = F.linear(inputs[shard.device], shard)  # (..., rows of slice i)
        gathered = [p.to(x.device, non_blocking=True) for p in partial]
        out = gathered[0] if len(gathered) == 1 else torch.cat(gathered, dim=-1)  # (..., out_features)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def _weight(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        shard = self.shards[index]
        if self.qtype is None:
            return shard.to(dtype)
        return dequantize(shard, self.qtype, (shard.shape[0], self.in_features), dtype)

    def extra_repr(self) -> str:
        slices = ", ".join(f"{a}:{b}@{d}" for (a, b), d in zip(self.rows, self.devices, strict=True))
        return f"in_features={self.in_features}, out_features={self.out_features}, rows=[{slices}]"


def block_linears(model: nn.Module) -> list[str]:
    """Qualified names of the `nn.Linear` modules inside the model's block lists (see `BLOCK_LISTS`)."""
    names: dict[str, None] = {}
    for list_name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or list_name.rsplit(".", 1)[-1] not in BLOCK_LISTS:
            continue
        for sub_name, sub in module.named_modules(prefix=list_name):
            if isinstance(sub, nn.Linear):
                names[sub_name] = None
    return list(names)


def shard_transformer_linears(
    model: nn.Module,
    devices: Sequence[torch.device | str],
    fractions: Sequence[float],
    source: Source | None = None,
    reserve: Reserve | None = None,
) -> list[str]:
    """Replace the block lists' linears of `model` by RowShardedLinear over `devices` (first = main) in
    proportion to `fractions`; returns the replaced names. A weight on the meta device is read from
    `source` (called with the parameter name) and cast to the parameter's dtype."""
    if len(devices) != len(fractions):
        raise ValueError(f"{len(devices)} devices but {len(fractions)} row-split fractions")
    names = block_linears(model)
    for name in names:
        linear = model.get_submodule(name)
        weight = linear.weight
        if weight.is_meta:
            if source is None:
                raise ValueError(f"{name}: the weight is on the meta device; give a source to read it from")
            tensor = source(f"{name}.weight")
            if tuple(tensor.shape) != tuple(weight.shape):
                raise ValueError(f"tensor {name}.weight has shape {tuple(tensor.shape)}, the model expects "
                                 f"{tuple(weight.shape)}")
            weight = tensor.to(weight.dtype)
        qtype = getattr(linear, "qtype", None)
        if qtype is not None and weight.shape[0] != linear.out_features:  # stored in other rows: expand
            dtype = linear.bias.dtype if linear.bias is not None else torch.float32
            weight, qtype = dequantize(weight, qtype, tuple(linear.weight_shape), dtype), None
        sharded = RowShardedLinear(weight.detach(), linear.bias, list(zip(devices, fractions, strict=True)),
                                   name, reserve, qtype, linear.in_features)
        parent_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attribute, sharded)
    if names and hasattr(model, "forget_stages"):
        model.forget_stages()  # a cached stage may hold a replaced linear itself
    return names
