"""Text conditioning nodes with ComfyUI's names and input order: CLIPTextEncode, CLIPTextEncodeSDXL,
CLIPSetLastLayer, ConditioningZeroOut, FluxGuidance. Prompts accept (emphasis:1.2) and `embedding:name` (files
of models/embeddings). Nodes that change a CONDITIONING return a new list of new entry dicts; the tensors of
the input are never written to."""

from __future__ import annotations

from typing import Any

import torch

from engine.graph.spec import NodeType, Output, RunContext, float_input, int_input, link_input, string_input
from engine.models.bundles import EmbeddingLookup, TextEncoder, require
from engine.models.conditioning import check_conditioning
from engine.models.loader import load_embedding
from engine.settings import Settings
from nodes.loaders import current_settings

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


NODE_TYPES = (CLIPTextEncode, CLIPTextEncodeSDXL, CLIPSetLastLayer, ConditioningZeroOut, FluxGuidance)
