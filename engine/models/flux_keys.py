"""FLUX transformer files in the diffusers layout (FluxTransformer2DModel), read as BFL-layout tensors.

engine/models/flux.py names its parameters as BFL's files do. A diffusers file splits some of them:
the double blocks' qkv into to_q / to_k / to_v (image) and add_q_proj / add_k_proj / add_v_proj (text),
the single blocks' linear1 into to_q / to_k / to_v / proj_mlp, and its final adaLN projection orders
(scale, shift) where BFL orders (shift, scale). Here each BFL tensor has a recipe: the diffusers tensors
it is made of and how they combine, so shapes come from the header alone and tensors are assembled one
BFL tensor at a time when read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

BFL_PREFIX = "model.diffusion_model."  # the diffusion model's prefix in BFL / ComfyUI single files

Value = TypeVar("Value")


def strip_prefix(entries: Mapping[str, Value], prefix: str = BFL_PREFIX) -> dict[str, Value]:
    """The entries under `prefix`, without it, when any key has it (a full checkpoint); else all of them."""
    if not any(key.startswith(prefix) for key in entries):
        return dict(entries)
    return {key[len(prefix) :]: value for key, value in entries.items() if key.startswith(prefix)}


@dataclass(frozen=True)
class _Recipe:
    sources: tuple[str, ...]  # diffusers keys, in order
    combine: str  # "same" (one tensor), "cat" (concatenated along dim 0), "swap" (its two halves swapped)


# BFL module -> diffusers modules (several: concatenated); names relative to the model or to one block.
_TOP = {
    "img_in": ("x_embedder",),
    "txt_in": ("context_embedder",),
    "time_in.in_layer": ("time_text_embed.timestep_embedder.linear_1",),
    "time_in.out_layer": ("time_text_embed.timestep_embedder.linear_2",),
    "vector_in.in_layer": ("time_text_embed.text_embedder.linear_1",),
    "vector_in.out_layer": ("time_text_embed.text_embedder.linear_2",),
    "guidance_in.in_layer": ("time_text_embed.guidance_embedder.linear_1",),
    "guidance_in.out_layer": ("time_text_embed.guidance_embedder.linear_2",),
    "final_layer.linear": ("proj_out",),
}
_DOUBLE = {
    "img_mod.lin": ("norm1.linear",),
    "txt_mod.lin": ("norm1_context.linear",),
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn.proj": ("attn.to_out.0",),
    "txt_attn.proj": ("attn.to_add_out",),
    "img_mlp.0": ("ff.net.0.proj",),
    "img_mlp.2": ("ff.net.2",),
    "txt_mlp.0": ("ff_context.net.0.proj",),
    "txt_mlp.2": ("ff_context.net.2",),
}
_DOUBLE_NORMS = {
    "img_attn.norm.query_norm": "attn.norm_q",
    "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q",
    "txt_attn.norm.key_norm": "attn.norm_added_k",
}
_SINGLE = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation.lin": ("norm.linear",),
}
_SINGLE_NORMS = {"norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"}


def is_diffusers_flux(keys: Iterable[str]) -> bool:
    """Whether the keys are a diffusers FluxTransformer2DModel's state dict."""
    keys = set(keys)
    return {"x_embedder.weight", "context_embedder.weight", "norm_out.linear.weight"} <= keys and any(
        key.startswith("single_transformer_blocks.") for key in keys)


def _recipes(keys: Iterable[str]) -> dict[str, _Recipe]:
    """BFL name -> recipe for every tensor the diffusers keys make (biases where the file has them)."""
    keys = set(keys)
    modules: dict[str, tuple[tuple[str, ...], str]] = {}  # BFL module -> (diffusers modules, combine)
    for bfl, sources in _TOP.items():
        modules[bfl] = (sources, "same")
    modules["final_layer.adaLN_modulation.1"] = (("norm_out.linear",), "swap")
    for root, bfl_root, table in (("transformer_blocks", "double_blocks", _DOUBLE),
                                  ("single_transformer_blocks", "single_blocks", _SINGLE)):
        for index in _indices(keys, root):
            for bfl, sources in table.items():
                modules[f"{bfl_root}.{index}.{bfl}"] = (tuple(f"{root}.{index}.{s}" for s in sources),
                                                        "same" if len(sources) == 1 else "cat")
    recipes: dict[str, _Recipe] = {}
    for bfl, (sources, combine) in modules.items():
        for suffix in ("weight", "bias"):
            parts = tuple(f"{source}.{suffix}" for source in sources)
            if any(part in keys for part in parts):
                recipes[f"{bfl}.{suffix}"] = _Recipe(parts, combine)
    for root, bfl_root, norms in (("transformer_blocks", "double_blocks", _DOUBLE_NORMS),
                                  ("single_transformer_blocks", "single_blocks", _SINGLE_NORMS)):
        for index in _indices(keys, root):
            for bfl, source in norms.items():
                source_key = f"{root}.{index}.{source}.weight"
                recipes[f"{bfl_root}.{index}.{bfl}.scale"] = _Recipe((source_key,), "same")
    return recipes


def _indices(keys: set[str], root: str) -> list[int]:
    pattern = re.compile(re.escape(root) + r"\.(\d+)\.")
    return sorted({int(m.group(1)) for key in keys if (m := pattern.match(key))})


def _missing(recipe: _Recipe, name: str, keys: Iterable[str]) -> None:
    absent = [part for part in recipe.sources if part not in keys]
    if absent:
        raise ValueError(f"a diffusers FLUX file needs {', '.join(absent)} to make {name}; it is missing")


def diffusers_flux_shapes(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """BFL name -> shape of the tensors a diffusers-layout file makes, from its header shapes alone."""
    out = {}
    for name, recipe in _recipes(shapes).items():
        _missing(recipe, name, shapes)
        parts = [tuple(shapes[part]) for part in recipe.sources]
        if recipe.combine == "cat":
            if any(part[1:] != parts[0][1:] for part in parts):
                raise ValueError(f"cannot concatenate {', '.join(recipe.sources)} of shapes {parts} "
                                 f"into {name}")
            out[name] = (sum(part[0] for part in parts), *parts[0][1:])
        else:
            out[name] = parts[0]
    return out


def diffusers_flux_getter(get: Callable[[str], torch.Tensor],
                          keys: Iterable[str]) -> Callable[[str], torch.Tensor]:
    """A reader of BFL-named tensors from a diffusers-layout file whose tensors `get` reads by key: each call
    reads the diffusers tensors of one BFL tensor and combines them."""
    keys = set(keys)
    recipes = _recipes(keys)

    def read(name: str) -> torch.Tensor:
        recipe = recipes.get(name)
        if recipe is None:
            raise KeyError(f"{name!r} is not a tensor this diffusers FLUX file makes "
                           f"({len(recipes)} BFL tensors, e.g. {next(iter(recipes), 'none')})")
        _missing(recipe, name, keys)
        parts = [get(part) for part in recipe.sources]
        if recipe.combine == "cat":
            return torch.cat(parts, dim=0)
        if recipe.combine == "swap":
            scale, shift = parts[0].chunk(2, dim=0)
            return torch.cat([shift, scale], dim=0)
        return parts[0]

    return read
