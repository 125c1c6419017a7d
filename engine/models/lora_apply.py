"""Applying matched LoRAs to models, in the two modes of reference/000's LoRA apply mode.

- "merge": each touched weight of a copy of the model becomes W + sum(strength * delta), computed in float32
  from the base tensor. The base model's tensors are never written, so removing the LoRAs, or changing a
  strength, rebuilds from them bit-exactly (the aim of ComfyUI's ModelPatcher backups).
- "runtime": the weights stay as they are and each adapted layer gets a side branch added to its output,
  strength * scale * up(down(x)), through forward hooks: for weights that cannot be rewritten (quantised,
  re-read from disk, sharded). On a quantised layer (engine/quant/modules.py) this is stable-diffusion.cpp's
  at_runtime mode: each call dequantises the weight for its product, and the LoRA's delta is added to it
  (as its own product with the input), so the quantised bytes are never rewritten.
- "auto": merge unless the weights are one of those; a quantised weight is never merged ("merge" refuses it,
  naming its GGML type).

A patched module is a structural copy of the base module that shares every untouched parameter; it carries its
base and its LoRAs, so that stacking another LoRA (or removing them all) starts again from the base.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import attention
from engine.models.bundles import DiffusionModel, ManagedEncoder, TextEncoder, build_conditioner
from engine.models.clip import OpenClipAttention
from engine.models.lora import LoraFile, LoraLayer, LoraMatch, LoraTarget, match_lora, read_lora
from engine.quant.modules import quant_type, weight_shape

log = logging.getLogger(__name__)

MODES = ("auto", "merge", "runtime")
MERGEABLE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
PATCH_ATTRIBUTE = "_sluice_lora_patches"
Rows = tuple[int, int] | None  # the rows of a fused parameter, or None for the whole of it


@dataclass(frozen=True)
class AppliedLora:
    """One LoRA on one module: its matched layers, strength and resolved mode ("merge" or "runtime")."""

    name: str
    patches: tuple[tuple[LoraTarget, LoraLayer], ...]
    strength: float
    mode: str


@dataclass(frozen=True)
class PatchState:
    base: nn.Module  # the unpatched module
    applied: tuple[AppliedLora, ...]  # in the order they were applied


def patch_state(module: nn.Module) -> PatchState | None:
    return module.__dict__.get(PATCH_ATTRIBUTE)


def base_module(module: nn.Module) -> nn.Module:
    """The unpatched module under `module` (itself when it carries no LoRA)."""
    state = patch_state(module)
    return module if state is None else state.base


def applied_loras(module: nn.Module) -> tuple[AppliedLora, ...]:
    state = patch_state(module)
    return () if state is None else state.applied


# ---------------------------------------------------------------------------------------------- mode


def runtime_reason(module: nn.Module, targets: Sequence[LoraTarget], params_location: str = "device",
                   ) -> str | None:
    """Why `targets` of `module` cannot be merged into, or None when they can."""
    if params_location == "disk":
        return "its weights are re-read from disk"
    for target in targets:
        layer = module.get_submodule(target.module)
        weight = layer._parameters[target.weight]
        qtype = quant_type(layer, target.weight)
        if qtype is not None:
            return (f"{target.weight_name} is quantised ({qtype}): quantised weights take LoRAs at runtime "
                    f"only")
        if type(weight) not in (torch.Tensor, nn.Parameter):
            return f"{target.weight_name} is a {type(weight).__name__} (quantised or sharded)"
        if weight.dtype not in MERGEABLE_DTYPES:
            return f"{target.weight_name} is stored as {weight.dtype} (quantised)"
        if weight.is_meta:
            return f"{target.weight_name} is not materialised (on the meta device)"
    return None


def resolve_mode(mode: str, module: nn.Module, targets: Sequence[LoraTarget],
                 params_location: str = "device") -> str:
    """"merge" or "runtime" for `mode` ("auto" picks merge unless `runtime_reason` finds a reason)."""
    if mode not in MODES:
        raise ValueError(f"unknown LoRA apply mode {mode!r}; accepted: {', '.join(MODES)}")
    reason = runtime_reason(module, targets, params_location)
    if mode == "merge" and reason:
        raise ValueError(f"cannot merge a LoRA into this model: {reason}; use mode 'runtime' or 'auto'")
    if mode == "auto":
        return "runtime" if reason else "merge"
    return mode


# ---------------------------------------------------------------------------------------------- patching


def structural_copy(module: nn.Module) -> nn.Module:
    """A copy of the module tree that shares every parameter and buffer tensor but owns its dicts of them
    (and of hooks), so that replacing a parameter or adding a hook on the copy leaves `module` as it was."""
    clone = copy.copy(module)
    for key, value in module.__dict__.items():
        if isinstance(value, dict):
            clone.__dict__[key] = type(value)(value)
    clone.__dict__.pop(PATCH_ATTRIBUTE, None)
    clone._modules = {name: None if child is None else structural_copy(child)
                      for name, child in module._modules.items()}
    return clone


def patch_module(base: nn.Module, applied: Sequence[AppliedLora]) -> nn.Module:
    """A structural copy of `base` with `applied` LoRAs merged into its weights or hooked onto its layers;
    `base` itself when there is nothing to apply."""
    applied = tuple(a for a in applied if a.patches and a.strength != 0)
    if not applied:
        return base
    patched = structural_copy(base)
    merges: dict[tuple[str, str], list[tuple[Rows, Callable[[torch.Size], torch.Tensor]]]] = {}
    branches: dict[str, list[tuple[Rows, RuntimeBranch]]] = {}
    for entry in applied:
        for target, layer in entry.patches:
            module = base.get_submodule(target.module)
            if entry.mode == "runtime" and isinstance(module, (nn.Linear, nn.Conv2d, OpenClipAttention)):
                branches.setdefault(target.module, []).append(
                    (target.rows, RuntimeBranch(layer, entry.strength, module, target)))
                continue
            if entry.mode == "runtime":  # norms and embeddings have no additive side branch
                reason = runtime_reason(base, [target])
                if reason:
                    raise ValueError(f"LoRA {entry.name}: cannot apply layer {layer.name} to "
                                     f"{type(module).__name__} {target.module} at runtime, nor merge it: "
                                     f"{reason}")
                log.info("LoRA %s: %s (%s) merged: runtime branches cover linear and convolution layers only",
                         entry.name, layer.name, type(module).__name__)
            if layer.has_weight_delta:
                merges.setdefault((target.module, target.weight), []).append(
                    (target.rows, _delta_fn(layer, entry.strength)))
            if "diff_b" in layer.tensors:
                merges.setdefault((target.module, target.bias), []).append(
                    (target.rows, _bias_fn(layer, entry.strength)))
    for (module_name, param), deltas in merges.items():
        original = base.get_submodule(module_name)._parameters[param]
        if original.dtype not in MERGEABLE_DTYPES:
            raise ValueError(f"cannot merge a LoRA into {module_name}.{param}: stored as {original.dtype}; "
                             f"use mode 'runtime' or 'auto'")
        work = original.detach().to(torch.promote_types(original.dtype, torch.float32), copy=True)
        for rows, delta in deltas:
            view = work if rows is None else work[rows[0]:rows[1]]
            view += delta(view.shape).to(device=work.device, dtype=work.dtype)
        patched.get_submodule(module_name)._parameters[param] = nn.Parameter(
            work.to(original.dtype), requires_grad=original.requires_grad)
    for module_name, module_branches in branches.items():
        _install_branches(patched.get_submodule(module_name), module_branches)
    patched.__dict__[PATCH_ATTRIBUTE] = PatchState(base, applied)
    return patched


def _delta_fn(layer: LoraLayer, strength: float) -> Callable[[torch.Size], torch.Tensor]:
    return lambda shape: layer.weight_delta(shape) * strength


def _bias_fn(layer: LoraLayer, strength: float) -> Callable[[torch.Size], torch.Tensor]:
    return lambda shape: layer.bias_delta().reshape(shape) * strength


class RuntimeBranch:
    """strength * scale * up(down(x)) for a LoRA on a Linear or a convolution (down takes the layer's stride
    and padding); the layer's own operation with the whole delta for LoHa, LoKr, LoCon cores and diffs."""

    def __init__(self, layer: LoraLayer, strength: float, module: nn.Module, target: LoraTarget):
        self.factor = strength * layer.scale
        self.conv = module if isinstance(module, nn.Conv2d) else None
        full = weight_shape(module, target.weight)  # a quantised layer's logical shape
        rows = full[0] if target.rows is None else target.rows[1] - target.rows[0]
        shape = (rows, *full[1:])
        self.low_rank = layer.kind == "lora" and "mid" not in layer.tensors
        if self.low_rank:
            down, up = layer.tensors["down"].float(), layer.tensors["up"].float()
            rank = down.shape[0]
            if self.conv is None:
                self.tensors = (down.flatten(1), up.flatten(1))  # (r, in), (out, r)
            else:
                kernel = tuple(down.shape[2:]) or (1, 1)  # a linear-style down on a 1x1 convolution
                self.tensors = (down.reshape(rank, shape[1], *kernel), up.reshape(rows, rank, 1, 1))
        else:
            bias = layer.bias_delta()
            delta = layer.weight_delta(shape) if layer.has_weight_delta else torch.zeros(shape)
            self.tensors = (delta * strength, None if bias is None else bias * strength)
        self._cast: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor | None, ...]] = {}

    def _tensors(self, x: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        key = (x.device, x.dtype)
        if key not in self._cast:
            self._cast[key] = tuple(None if t is None else t.to(device=x.device, dtype=x.dtype)
                                    for t in self.tensors)
        return self._cast[key]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self._tensors(x)
        conv = self.conv
        if self.low_rank:
            if conv is None:
                return F.linear(F.linear(x, first), second) * self.factor
            hidden = F.conv2d(x, first, None, conv.stride, conv.padding, conv.dilation, conv.groups)
            return F.conv2d(hidden, second) * self.factor
        if conv is None:
            return F.linear(x, first, second)
        return F.conv2d(x, first, second, conv.stride, conv.padding, conv.dilation, conv.groups)


def _install_branches(module: nn.Module, branches: list[tuple[Rows, RuntimeBranch]]) -> None:
    if isinstance(module, OpenClipAttention):
        module.__dict__["forward"] = _fused_qkv_forward(module, branches)
        return

    def add_branches(_module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        for _, branch in branches:
            output = output + branch(args[0])
        return output

    module.register_forward_hook(add_branches)


def _fused_qkv_forward(attn: OpenClipAttention, branches: list[tuple[Rows, RuntimeBranch]],
                       ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """OpenClipAttention.forward with side branches added to row slices of the fused q, k, v projection."""
    def forward(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        qkv = F.linear(x, attn.in_proj_weight, attn.in_proj_bias)  # (B, T, 3 * W)
        for rows, branch in branches:
            start, stop = rows if rows is not None else (0, qkv.shape[-1])
            qkv = torch.cat([qkv[..., :start], qkv[..., start:stop] + branch(x), qkv[..., stop:]], dim=-1)
        q, k, v = qkv.chunk(3, dim=-1)  # 3 x (B, T, W)
        return attn.out_proj(attention(q, k, v, attn.heads, mask=mask))

    return forward


# ---------------------------------------------------------------------------------------------- bundles


@dataclass
class LoraApplication:
    """What `apply_lora` returns: the patched bundles, the match (with its unmatched keys) and the modes."""

    model: DiffusionModel | None
    clip: TextEncoder | None
    match: LoraMatch
    modes: dict[str, str]  # "unet", "te0", "te1" -> "merge" or "runtime"


def apply_lora(model: DiffusionModel | None, clip: TextEncoder | None, lora: LoraFile | str,
               strength_model: float = 1.0, strength_clip: float = 1.0, mode: str = "auto",
               ) -> LoraApplication:
    """Clones of `model` and `clip` with `lora` added to the LoRAs they already carry (inputs untouched).

    `lora` is a parsed LoraFile or a path; a strength of 0 leaves that bundle as it was."""
    if mode not in MODES:
        raise ValueError(f"unknown LoRA apply mode {mode!r}; accepted: {', '.join(MODES)}")
    lora = lora if isinstance(lora, LoraFile) else read_lora(lora)
    for bundle, strength in ((model, strength_model), (clip, strength_clip)):
        _check_patchable(bundle, strength)
    base_unet = base_module(model.unet) if model is not None else None
    base_encoders = tuple(base_module(e) for e in clip.encoders) if clip is not None else ()
    match = match_lora(lora, base_unet, base_encoders)
    modes: dict[str, str] = {}
    if model is not None and strength_model != 0:
        patches = tuple(match.for_module("unet"))
        if patches:
            modes["unet"] = resolve_mode(mode, base_unet, [t for t, _ in patches], model.params_location)
            entry = AppliedLora(lora.name, patches, strength_model, modes["unet"])
            model = _with_unet(model, base_unet, applied_loras(model.unet) + (entry,))
    if clip is not None and strength_clip != 0:
        encoders = list(clip.encoders)
        for index, base in enumerate(base_encoders):
            patches = tuple(match.for_module("te", index))
            if patches:
                chosen = resolve_mode(mode, base, [t for t, _ in patches], clip.params_location)
                modes[f"te{index}"] = chosen
                entry = AppliedLora(lora.name, patches, strength_clip, chosen)
                encoders[index] = patch_module(base, applied_loras(encoders[index]) + (entry,))
        clip = _with_encoders(clip, tuple(encoders))
    return LoraApplication(model, clip, match, modes)


def remove_loras(model: DiffusionModel | None = None, clip: TextEncoder | None = None,
                 ) -> tuple[DiffusionModel | None, TextEncoder | None]:
    """Clones of the bundles on their unpatched modules: the base weights, bit for bit."""
    if model is not None:
        model = _with_unet(model, base_module(model.unet), ())
    if clip is not None:
        clip = _with_encoders(clip, tuple(base_module(e) for e in clip.encoders))
    return model, clip


def _check_patchable(bundle: DiffusionModel | TextEncoder | None, strength: float) -> None:
    """A patched copy runs as a plain module (engine/models/bundles.py), so its base weights must rest on the
    compute device; weights the memory runtime keeps in RAM or on disk are streamed into the base only."""
    memory = None if bundle is None or strength == 0 else bundle.memory
    if memory is not None and memory.params != "device":
        raise ValueError(f"cannot apply a LoRA to the {memory.kind} model while the memory runtime keeps its "
                         f"weights at {memory.params!r}; load it with params_backend device")


def _with_unet(model: DiffusionModel, base: nn.Module, applied: tuple[AppliedLora, ...]) -> DiffusionModel:
    clone = model.clone()
    clone.unet = patch_module(base, applied)
    clone.options["loras"] = tuple((a.name, a.strength, a.mode) for a in applied)
    if not applied:
        del clone.options["loras"]
    return clone


def _with_encoders(clip: TextEncoder, encoders: tuple[nn.Module, ...]) -> TextEncoder:
    if all(new is old for new, old in zip(encoders, clip.encoders, strict=True)):
        return clip
    memory = clip.memory  # the registered encoders keep running through the memory runtime
    runners = [ManagedEncoder(encoder, memory, index) if memory is not None and memory.holds(index, encoder)
               else encoder for index, encoder in enumerate(encoders)]
    return dataclasses.replace(clip, encoders=encoders, conditioner=build_conditioner(clip.family, runners))
