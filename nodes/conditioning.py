"""Conditioning nodes with ComfyUI's names, input order and defaults: the text encoders (CLIPTextEncode,
CLIPTextEncodeSDXL, CLIPSetLastLayer), FluxGuidance, ConditioningZeroOut, and the combinators of several
prompts (ConditioningCombine, ...Concat, ...Average) and of where and when a prompt applies
(ConditioningSetArea, ...AreaPercentage, ...AreaStrength, ...Mask, ...TimestepRange), which the sampler
honours (engine/sampling/guidance.py). Prompts accept (emphasis:1.2) and `embedding:name` (files of
models/embeddings). Nodes that change a CONDITIONING return a new list of new entry dicts; the tensors of
the input are never written to."""

from __future__ import annotations

from typing import Any

import torch

from engine.graph.spec import (
    NodeType,
    Output,
    RunContext,
    combo_input,
    float_input,
    int_input,
    link_input,
    string_input,
)
from engine.models.bundles import EmbeddingLookup, TextEncoder, require
from engine.models.conditioning import (
    average_conditioning,
    check_conditioning,
    concat_conditioning,
    set_values,
)
from engine.models.loader import load_embedding
from engine.settings import Settings
from nodes.loaders import current_settings
from nodes.masks import as_masks

MAX_RESOLUTION = 16384
EMBEDDING_EXTENSIONS = (".safetensors", ".pt", ".bin")


def embedding_lookup(settings: Settings | None) -> EmbeddingLookup:
    """name -> the tensors of models/embeddings/name(.safetensors|.pt|.bin), or None when there is none."""
    settings = current_settings(settings)

    def lookup(name: str) -> dict[str, torch.Tensor] | None:
        files = settings.list_models("embeddings", EMBEDDING_EXTENSIONS)
        for candidate in (name, *(name + extension for extension in EMBEDDING_EXTENSIONS)):
            if candidate in files:
                return load_embedding(settings.resolve_model("embeddings", candidate))
        return None

    return lookup


class CLIPTextEncode(NodeType):
    display_name = "CLIP Text Encode (Prompt)"
    category = "conditioning"
    description = "Encodes a prompt with the text encoder into the conditioning a sampler follows."
    inputs = (string_input("text", "", multiline=True), link_input("clip", "CLIP"))
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, text: str, clip: Any) -> tuple:
        clip = require(clip, "CLIP", TextEncoder)
        return (clip.encode(text, embedding_lookup(ctx.settings)),)


class CLIPTextEncodeSDXL(NodeType):
    display_name = "CLIPTextEncodeSDXL"
    category = "advanced/conditioning"
    description = ("SDXL prompt with separate texts for OpenCLIP-bigG (text_g) and CLIP-L (text_l), and the "
                   "size conditioning: original size, crop offset, target size.")
    inputs = (link_input("clip", "CLIP"),
              int_input("width", 1024, min=0, max=MAX_RESOLUTION),
              int_input("height", 1024, min=0, max=MAX_RESOLUTION),
              int_input("crop_w", 0, min=0, max=MAX_RESOLUTION),
              int_input("crop_h", 0, min=0, max=MAX_RESOLUTION),
              int_input("target_width", 1024, min=0, max=MAX_RESOLUTION),
              int_input("target_height", 1024, min=0, max=MAX_RESOLUTION),
              string_input("text_g", "", multiline=True),
              string_input("text_l", "", multiline=True))
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, clip: Any, width: int, height: int, crop_w: int, crop_h: int,
            target_width: int, target_height: int, text_g: str, text_l: str) -> tuple:
        clip = require(clip, "CLIP", TextEncoder)
        return (clip.encode_sdxl(text_g, text_l, embedding_lookup(ctx.settings), width=width, height=height,
                                 crop_w=crop_w, crop_h=crop_h, target_width=target_width,
                                 target_height=target_height),)


class CLIPSetLastLayer(NodeType):
    display_name = "CLIP Set Last Layer"
    category = "conditioning"
    description = "Reads the prompt from an earlier encoder layer: -1 = last, -2 = penultimate (clip skip 2)."
    inputs = (link_input("clip", "CLIP"), int_input("stop_at_clip_layer", -1, min=-24, max=-1))
    outputs = (Output("CLIP", "CLIP"),)

    def run(self, ctx: RunContext, clip: Any, stop_at_clip_layer: int) -> tuple:
        return (require(clip, "CLIP", TextEncoder).clone_with_clip_skip(stop_at_clip_layer),)


def conditioning_entries(conditioning: Any) -> list[list[Any]]:
    """The [context, extras] pairs of a CONDITIONING, with a clear error for anything else."""
    return check_conditioning(conditioning)


class ConditioningZeroOut(NodeType):
    category = "advanced/conditioning"
    description = "The same conditioning with its context and pooled output set to zeros."
    inputs = (link_input("conditioning", "CONDITIONING"),)
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, conditioning: Any) -> tuple:
        zeroed = []
        for context, extras in conditioning_entries(conditioning):
            extras = dict(extras)
            if extras.get("pooled_output") is not None:
                extras["pooled_output"] = torch.zeros_like(extras["pooled_output"])
            zeroed.append([torch.zeros_like(context), extras])
        return (zeroed,)


class FluxGuidance(NodeType):
    category = "advanced/conditioning/flux"
    description = ("Sets the guidance strength a guidance-distilled model (FLUX dev) is conditioned on; "
                   "models without a guidance input ignore it.")
    inputs = (link_input("conditioning", "CONDITIONING"),
              float_input("guidance", 3.5, min=0.0, max=100.0, step=0.1))
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, conditioning: Any, guidance: float) -> tuple:
        return ([[context, {**extras, "guidance": float(guidance)}]
                 for context, extras in conditioning_entries(conditioning)],)


def strength_input(name: str = "strength") -> Any:
    return float_input(name, 1.0, min=0.0, max=10.0, step=0.01)


class ConditioningCombine(NodeType):
    display_name = "Conditioning (Combine)"
    category = "conditioning"
    description = ("Both conditionings at once: the sampler predicts with each and averages the predictions, "
                   "weighted by their strengths, areas and masks.")
    inputs = (link_input("conditioning_1", "CONDITIONING"), link_input("conditioning_2", "CONDITIONING"))
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, conditioning_1: Any, conditioning_2: Any) -> tuple:
        return (check_conditioning(conditioning_1, "conditioning_1")
                + check_conditioning(conditioning_2, "conditioning_2"),)


class ConditioningConcat(NodeType):
    display_name = "Conditioning (Concat)"
    category = "conditioning"
    description = ("Appends the tokens of conditioning_from (its first entry) to each entry of "
                   "conditioning_to: one prompt the model attends to as a whole.")
    inputs = (link_input("conditioning_to", "CONDITIONING"), link_input("conditioning_from", "CONDITIONING"))
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, conditioning_to: Any, conditioning_from: Any) -> tuple:
        return (concat_conditioning(conditioning_to, conditioning_from),)


class ConditioningAverage(NodeType):
    display_name = "Conditioning (Average)"
    category = "conditioning"
    description = ("Mixes each entry of conditioning_to with the first of conditioning_from: "
                   "to_strength * to + (1 - to_strength) * from, context and pooled output alike.")
    inputs = (link_input("conditioning_to", "CONDITIONING"), link_input("conditioning_from", "CONDITIONING"),
              float_input("conditioning_to_strength", 1.0, min=0.0, max=1.0, step=0.01))
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, conditioning_to: Any, conditioning_from: Any,
            conditioning_to_strength: float) -> tuple:
        return (average_conditioning(conditioning_to, conditioning_from, conditioning_to_strength),)


class ConditioningSetArea(NodeType):
    display_name = "Conditioning (Set Area)"
    category = "conditioning"
    description = ("Applies the conditioning to a rectangle of the image only (pixels, in steps of 8), with "
                   "its predictions weighted by strength where it overlaps others.")
    inputs = (link_input("conditioning", "CONDITIONING"),
              int_input("width", 64, min=64, max=MAX_RESOLUTION, step=8),
              int_input("height", 64, min=64, max=MAX_RESOLUTION, step=8),
              int_input("x", 0, min=0, max=MAX_RESOLUTION, step=8),
              int_input("y", 0, min=0, max=MAX_RESOLUTION, step=8),
              strength_input())
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, conditioning: Any, width: int, height: int, x: int, y: int,
            strength: float) -> tuple:
        area = (height // 8, width // 8, y // 8, x // 8)  # latent cells: (height, width, top, left)
        return (set_values(conditioning, area=area, strength=strength, set_area_to_bounds=False),)


class ConditioningSetAreaPercentage(NodeType):
    display_name = "Conditioning (Set Area with Percentage)"
    category = "conditioning"
    description = "Applies the conditioning to a rectangle given in fractions of the image's size."
    inputs = (link_input("conditioning", "CONDITIONING"),
              float_input("width", 1.0, min=0.0, max=1.0, step=0.01),
              float_input("height", 1.0, min=0.0, max=1.0, step=0.01),
              float_input("x", 0.0, min=0.0, max=1.0, step=0.01),
              float_input("y", 0.0, min=0.0, max=1.0, step=0.01),
              strength_input())
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, conditioning: Any, width: float, height: float, x: float, y: float,
            strength: float) -> tuple:
        return (set_values(conditioning, area=("percentage", height, width, y, x), strength=strength,
                           set_area_to_bounds=False),)


class ConditioningSetAreaStrength(NodeType):
    category = "conditioning"
    description = "Sets the weight of the conditioning's predictions where it overlaps other conditionings."
    inputs = (link_input("conditioning", "CONDITIONING"), strength_input())
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, conditioning: Any, strength: float) -> tuple:
        return (set_values(conditioning, strength=strength),)


class ConditioningSetMask(NodeType):
    display_name = "Conditioning (Set Mask)"
    category = "conditioning"
    description = ("Applies the conditioning where the mask is, weighted by the mask times strength; 'mask "
                   "bounds' predicts only the mask's bounding box (faster, the same weights).")
    inputs = (link_input("conditioning", "CONDITIONING"), link_input("mask", "MASK"), strength_input(),
              combo_input("set_cond_area", ("default", "mask bounds"), "default"))
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, conditioning: Any, mask: Any, strength: float,
            set_cond_area: str) -> tuple:
        return (set_values(conditioning, mask=as_masks(mask), set_area_to_bounds=set_cond_area != "default",
                           mask_strength=strength),)


class ConditioningSetTimestepRange(NodeType):
    category = "advanced/conditioning"
    description = ("Applies the conditioning only from `start` to `end` of the sampling (fractions of the "
                   "way from pure noise to the image, through the model's noise schedule).")
    inputs = (link_input("conditioning", "CONDITIONING"),
              float_input("start", 0.0, min=0.0, max=1.0, step=0.001),
              float_input("end", 1.0, min=0.0, max=1.0, step=0.001))
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, conditioning: Any, start: float, end: float) -> tuple:
        return (set_values(conditioning, start_percent=start, end_percent=end),)


NODE_TYPES = (CLIPTextEncode, CLIPTextEncodeSDXL, CLIPSetLastLayer, ConditioningZeroOut, FluxGuidance,
              ConditioningCombine, ConditioningConcat, ConditioningAverage, ConditioningSetArea,
              ConditioningSetAreaPercentage, ConditioningSetAreaStrength, ConditioningSetMask,
              ConditioningSetTimestepRange)
