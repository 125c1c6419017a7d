"""LoRA loader nodes with ComfyUI's names, inputs (in ComfyUI's order) and outputs.

The LoRA is added to the LoRAs the incoming MODEL and CLIP already carry, on clones: the incoming bundles (and
the loader's cached checkpoint) keep their weights. The apply mode is "auto" (engine/models/lora_apply.py).
"""

from __future__ import annotations

from typing import Any

from engine.graph.spec import NodeType, Output, RunContext, combo_input, float_input, link_input
from engine.models.bundles import DiffusionModel, TextEncoder, require
from engine.models.lora import read_lora
from engine.models.lora_apply import apply_lora
from nodes.loaders import file_fingerprint, model_choices, model_path

STRENGTH_RANGE = {"min": -100.0, "max": 100.0, "step": 0.01}


class LoraLoader(NodeType):
    display_name = "Load LoRA"
    category = "loaders"
    description = ("Adds a LoRA from loras/ to the diffusion model and the text encoder (kohya, "
                   "diffusers/PEFT, LoCon, LoHa, LoKr); a strength of 0 leaves that part as it was.")
    inputs = (link_input("model", "MODEL"), link_input("clip", "CLIP"),
              combo_input("lora_name", model_choices("loras")),
              float_input("strength_model", 1.0, **STRENGTH_RANGE),
              float_input("strength_clip", 1.0, **STRENGTH_RANGE))
    outputs = (Output("MODEL", "MODEL"), Output("CLIP", "CLIP"))

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, "loras", widgets["lora_name"]))

    def run(self, ctx: RunContext, model: Any, clip: Any, lora_name: str, strength_model: float,
            strength_clip: float) -> tuple:
        model = require(model, "MODEL", DiffusionModel)
        clip = require(clip, "CLIP", TextEncoder)
        if strength_model == 0 and strength_clip == 0:
            return (model, clip)
        lora = read_lora(model_path(ctx.settings, "loras", lora_name))
        applied = apply_lora(model, clip, lora, strength_model, strength_clip)
        return (applied.model, applied.clip)


class LoraLoaderModelOnly(NodeType):
    display_name = "LoraLoaderModelOnly"
    category = "loaders"
    description = "Adds a LoRA from loras/ to the diffusion model only."
    inputs = (link_input("model", "MODEL"), combo_input("lora_name", model_choices("loras")),
              float_input("strength_model", 1.0, **STRENGTH_RANGE))
    outputs = (Output("MODEL", "MODEL"),)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, "loras", widgets["lora_name"]))

    def run(self, ctx: RunContext, model: Any, lora_name: str, strength_model: float) -> tuple:
        model = require(model, "MODEL", DiffusionModel)
        if strength_model == 0:
            return (model,)
        lora = read_lora(model_path(ctx.settings, "loras", lora_name))
        return (apply_lora(model, None, lora, strength_model, 0.0).model,)


NODE_TYPES = (LoraLoader, LoraLoaderModelOnly)
