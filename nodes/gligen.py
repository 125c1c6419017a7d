"""GLIGEN nodes with ComfyUI's names, inputs (in ComfyUI's order), defaults and outputs: GLIGENLoader and
GLIGENTextBoxApply (SD1 text-box grounding, engine/models/gligen.py).

GLIGENLoader ends with a `backend` input: the device it loads to (the fusers run inside the UNet's
transformers, so a sampler on another device moves them there). GLIGENTextBoxApply appends the text's box
to each entry's ("position", GLIGEN, boxes) under "gligen", with the text's pooled CLIP-L feature (first
chunk, last layer, unprojected) as ComfyUI.
"""

from __future__ import annotations

from typing import Any

import nodes.loaders
from engine.graph.spec import NodeType, Output, RunContext, combo_input, int_input, link_input, string_input
from engine.models.bundles import TextEncoder, require
from engine.models.conditioning import SD1_CLIP_L, check_conditioning, encode_weighted
from engine.models.gligen import GLIGEN, gligen_position, load_gligen
from nodes.conditioning import embedding_lookup
from nodes.latent import MAX_RESOLUTION
from nodes.loaders import file_fingerprint, model_choices, model_path

FOLDER = "gligen"


class GLIGENLoader(NodeType):
    display_name = "GLIGENLoader"
    category = "loaders"
    description = ("Loads a GLIGEN text-box model (SD1) from gligen/; backend is its compute device, which "
                   "must be the diffusion model's (auto: the workflow's).")
    inputs = (combo_input("gligen_name", model_choices(FOLDER)), string_input("backend", "auto"))
    outputs = (Output("GLIGEN", "GLIGEN"),)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, FOLDER, widgets["gligen_name"]))

    def run(self, ctx: RunContext, gligen_name: str, backend: str = "auto") -> tuple:
        device = nodes.loaders.COMPUTE_DEVICE if backend.strip().lower() in ("", "auto") else backend
        return (load_gligen(model_path(ctx.settings, FOLDER, gligen_name), None, device),)


class GLIGENTextBoxApply(NodeType):
    display_name = "GLIGENTextBoxApply"
    category = "conditioning/gligen"
    description = ("Grounds a text in a box of the image (x, y, width, height in pixels) with a GLIGEN "
                   "model; chain several for several boxes.")
    inputs = (link_input("conditioning_to", "CONDITIONING"), link_input("clip", "CLIP"),
              link_input("gligen_textbox_model", "GLIGEN"), string_input("text", "", multiline=True),
              int_input("width", 64, min=8, max=MAX_RESOLUTION, step=8),
              int_input("height", 64, min=8, max=MAX_RESOLUTION, step=8),
              int_input("x", 0, min=0, max=MAX_RESOLUTION, step=8),
              int_input("y", 0, min=0, max=MAX_RESOLUTION, step=8))
    outputs = (Output("CONDITIONING", "CONDITIONING"),)

    def run(self, ctx: RunContext, conditioning_to: Any, clip: Any, gligen_textbox_model: Any, text: str,
            width: int, height: int, x: int, y: int) -> tuple:
        conditioning = check_conditioning(conditioning_to, "conditioning_to")
        clip = require(clip, "CLIP", TextEncoder)
        gligen = require(gligen_textbox_model, "GLIGEN", GLIGEN)
        if clip.family != "sd1":
            raise ValueError(f"GLIGEN text boxes take an SD1 text encoder (CLIP-L); this one is "
                             f"{clip.family}")
        chunks = clip.tokenize(text, embedding_lookup(ctx.settings))["clip_l"]
        _, pooled = encode_weighted(clip.conditioner.clip_l, SD1_CLIP_L, chunks, clip.clip_skip,
                                    return_pooled=True)  # (1, 768): CLIP-L has no projection in SD1 files
        box = (pooled.cpu(), height // 8, width // 8, y // 8, x // 8)
        out = []
        for context, options in conditioning:
            earlier = gligen_position(options["gligen"]).boxes if options.get("gligen") is not None else []
            out.append([context, {**options, "gligen": ("position", gligen, [*earlier, box])}])
        return (out,)


NODE_TYPES = (GLIGENLoader, GLIGENTextBoxApply)
