"""FLUX.1 nodes with ComfyUI's names and input order: CLIPTextEncodeFlux, ModelSamplingFlux, ModelSamplingSD3.

The loaders (UNETLoader, DualCLIPLoader type flux, CheckpointLoaderSimple), FluxGuidance,
EmptySD3LatentImage and the custom-sampling nodes live with their SD siblings.
"""

from __future__ import annotations

from typing import Any

from engine.graph.spec import NodeType, Output, RunContext, float_input, int_input, link_input, string_input
from engine.models.bundles import DiffusionModel, TextEncoder, require
from engine.models.flux_bundles import FluxTextEncoder
from engine.sampling.model_sampling import FlowMatching, FluxFlowMatching, flux_shift_for
from nodes.conditioning import MAX_RESOLUTION, embedding_lookup


class CLIPTextEncodeFlux(NodeType):
    display_name = "CLIPTextEncodeFlux"
    category = "advanced/conditioning/flux"
    description = "FLUX prompt with separate texts for CLIP-L (clip_l) and T5-XXL (t5xxl), and the guidance."
    inputs = (link_input("clip", "CLIP"),
              string_input("clip_l", "", multiline=True),
              string_input("t5xxl", "", multiline=True),
              float_input("guidance", 3.5, min=0.0, max=100.0, step=0.1))
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, clip: Any, clip_l: str, t5xxl: str, guidance: float) -> tuple:
        clip = require(clip, "CLIP", TextEncoder)
        if not isinstance(clip, FluxTextEncoder):
            raise ValueError(f"CLIPTextEncodeFlux needs a FLUX text encoder (CLIP-L + T5-XXL: DualCLIPLoader "
                             f"type flux); this one is {clip.family}")
        return (clip.encode_flux(clip_l, t5xxl, guidance, embedding_lookup(ctx.settings)),)


def _flow_model(model: Any, node: str) -> DiffusionModel:
    model = require(model, "MODEL", DiffusionModel)
    if not isinstance(model.model_sampling, (FlowMatching, FluxFlowMatching)):
        raise ValueError(f"{node} needs a flow-matching model (FLUX, SD3); this {model.family} model "
                         f"predicts noise")
    return model


class ModelSamplingFlux(NodeType):
    display_name = "ModelSamplingFlux"
    category = "advanced/model"
    description = ("FLUX's resolution-dependent time shift: base_shift at 256 image tokens to max_shift at "
                   "4096 (a 1024x1024 image), linear in the token count between.")
    inputs = (link_input("model", "MODEL"),
              float_input("max_shift", 1.15, min=0.0, max=100.0, step=0.01),
              float_input("base_shift", 0.5, min=0.0, max=100.0, step=0.01),
              int_input("width", 1024, min=16, max=MAX_RESOLUTION, step=8),
              int_input("height", 1024, min=16, max=MAX_RESOLUTION, step=8))
    outputs = (Output("MODEL", "MODEL"),)

    def run(self, ctx: RunContext, model: Any, max_shift: float, base_shift: float, width: int,
            height: int) -> tuple:
        patched = _flow_model(model, "ModelSamplingFlux").clone()
        patched.model_sampling = FluxFlowMatching(shift=flux_shift_for(width, height, base_shift, max_shift))
        return (patched,)


class ModelSamplingSD3(NodeType):
    display_name = "ModelSamplingSD3"
    category = "advanced/model"
    description = "A constant time shift for flow-matching models: sigma = shift*t / (1 + (shift - 1)*t)."
    inputs = (link_input("model", "MODEL"), float_input("shift", 3.0, min=0.0, max=100.0, step=0.01))
    outputs = (Output("MODEL", "MODEL"),)

    def run(self, ctx: RunContext, model: Any, shift: float) -> tuple:
        patched = _flow_model(model, "ModelSamplingSD3").clone()
        multiplier = getattr(patched.model_sampling, "multiplier", 1.0)  # FLUX embeds t * 1000 itself: 1
        patched.model_sampling = FlowMatching(shift=shift, multiplier=multiplier)
        return (patched,)


NODE_TYPES = (CLIPTextEncodeFlux, ModelSamplingFlux, ModelSamplingSD3)
