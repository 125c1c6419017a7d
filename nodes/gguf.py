"""ComfyUI-GGUF's loader nodes (city96/ComfyUI-GGUF) with its names, inputs and outputs: its workflows import.

- UnetLoaderGGUF: a diffusion model from a `.gguf` file of diffusion_models/ (or unet/): ComfyUI-GGUF's files
  (FLUX, SD1, SDXL) and stable-diffusion.cpp's.
- UnetLoaderGGUFAdvanced: the same, with ComfyUI-GGUF's dequant_dtype, patch_dtype and patch_on_device.
  Sluice dequantises each weight straight into the model's compute dtype and computes runtime LoRA branches
  in it (ComfyUI-GGUF's "target"): "default", "target" and the compute dtype's own name run as that; another
  dtype (a second rounding step in ComfyUI-GGUF) is refused, naming the accepted ones. patch_on_device is
  accepted either way: the memory runtime places the weights, and LoRA branches compute on the model's device.
- CLIPLoaderGGUF / DualCLIPLoaderGGUF: text encoders from text_encoders/ (or clip/), `.gguf` (llama.cpp-style
  T5 files, as ComfyUI-GGUF reads them) or any other format the ordinary loaders read.
- TripleCLIPLoaderGGUF / QuadrupleCLIPLoaderGGUF: their inputs import, and running one is an error that names
  the text encoders it loads (SD3's, HiDream's) and the sets Sluice runs: Sluice has no model that uses them.

Quantised weights rest quantised and are dequantised as each layer runs (engine/quant). Each node ends with
Sluice's `backend` and `params_backend`, after ComfyUI-GGUF's inputs, as every loader does
(nodes/loaders.py), so ComfyUI's positional widget values still import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.graph.spec import Input, NodeType, Output, RunContext, bool_input, combo_input
from engine.memory.runtime import get_runtime
from engine.models.loader import load_diffusion_model, load_text_encoders
from engine.settings import SettingsError
from nodes.loaders import (
    CLIP_TYPES,
    DUAL_CLIP_TYPES,
    LOADERS,
    current_settings,
    file_fingerprint,
    model_choices,
    model_path,
    node_targets,
    node_weight_types,
    placement_inputs,
)


def gguf_choices(kind: str) -> Any:
    """The `.gguf` files of `kind` in the models folder (ComfyUI-GGUF's unet_gguf list)."""
    def choices() -> list[str]:
        try:
            return current_settings().list_models(kind, (".gguf",))
        except SettingsError:
            return []

    return choices


class UnetLoaderGGUF(NodeType):
    display_name = "Unet Loader (GGUF)"
    category = "bootleg"
    description = ("Loads a GGUF diffusion model (FLUX, SD1, SDXL; ComfyUI-GGUF's or stable-diffusion.cpp's "
                   "files) from diffusion_models/ (or unet/); quantised weights stay quantised.")
    memory_module = "diffusion"
    inputs = (combo_input("unet_name", gguf_choices("diffusion_models")), *placement_inputs())
    outputs = (Output("MODEL", "MODEL"),)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, "diffusion_models", widgets["unet_name"]))

    @classmethod
    def memory_files(cls, settings: Any, widgets: dict[str, Any]) -> dict[str, list[Path]]:
        return {"diffusion": [model_path(settings, "diffusion_models", widgets["unet_name"])]}

    def run(self, ctx: RunContext, unet_name: str, backend: str = "auto", params_backend: str = "auto",
            ) -> tuple:
        path = model_path(ctx.settings, "diffusion_models", unet_name)
        widgets = {"unet_name": unet_name, "backend": backend, "params_backend": params_backend}
        devices, homes = node_targets(ctx, UnetLoaderGGUF, widgets)
        types = node_weight_types(ctx, UnetLoaderGGUF, widgets)["diffusion"]
        return (load_diffusion_model(path, None, devices["diffusion"], homes["diffusion"], get_runtime(),
                                     types),)


DEQUANT_DTYPES = ("default", "target", "float32", "float16", "bfloat16")  # ComfyUI-GGUF's choices, in order


def check_compute_dtype(name: str, value: str, dtype: torch.dtype) -> None:
    """Refuse a dequant_dtype / patch_dtype `value` that is not the model's compute `dtype` (Sluice computes
    dequantised weights and LoRA branches in it), naming the accepted values."""
    if value in ("default", "target") or getattr(torch, value) == dtype:
        return
    accepted = ", ".join(["default", "target", str(dtype).removeprefix("torch.")])
    raise ValueError(f"UnetLoaderGGUFAdvanced: {name} {value!r} is not this model's compute dtype "
                     f"({str(dtype).removeprefix('torch.')}); Sluice dequantises weights and computes LoRA "
                     f"branches in the compute dtype only; accepted: {accepted}")


class UnetLoaderGGUFAdvanced(UnetLoaderGGUF):
    display_name = "Unet Loader (GGUF/Advanced)"
    description = ("Unet Loader (GGUF) with ComfyUI-GGUF's dequantisation options: Sluice dequantises into "
                   "the model's compute dtype (target); another dtype is refused.")
    inputs = (UnetLoaderGGUF.inputs[0],
              combo_input("dequant_dtype", DEQUANT_DTYPES, "default",
                          description="dtype weights are dequantised to: default/target (the compute dtype)"),
              combo_input("patch_dtype", DEQUANT_DTYPES, "default",
                          description="dtype LoRA patches compute in: default/target (the compute dtype)"),
              bool_input("patch_on_device", False,
                         description="accepted either way: LoRA branches compute on the model's device"),
              *placement_inputs())

    def run(self, ctx: RunContext, unet_name: str, dequant_dtype: str = "default",
            patch_dtype: str = "default", patch_on_device: bool = False, backend: str = "auto",
            params_backend: str = "auto") -> tuple:
        for name, value in (("dequant_dtype", dequant_dtype), ("patch_dtype", patch_dtype)):
            if value not in DEQUANT_DTYPES:
                raise ValueError(f"UnetLoaderGGUFAdvanced: unknown {name} {value!r}; accepted: "
                                 f"{', '.join(DEQUANT_DTYPES)}")
        model = super().run(ctx, unet_name, backend, params_backend)[0]
        check_compute_dtype("dequant_dtype", dequant_dtype, model.dtype)
        check_compute_dtype("patch_dtype", patch_dtype, model.dtype)
        return (model,)


def _clip_name_input(name: str) -> Input:
    return combo_input(name, model_choices("text_encoders"))


class CLIPLoaderGGUF(NodeType):
    display_name = "CLIPLoader (GGUF)"
    category = "bootleg"
    description = ("Loads a text encoder from text_encoders/ (or clip/): a GGUF file (llama.cpp-style T5 "
                   "names too) or any format CLIPLoader reads.")
    memory_module = "te"
    inputs = (_clip_name_input("clip_name"), combo_input("type", tuple(CLIP_TYPES), "stable_diffusion"),
              *placement_inputs())
    outputs = (Output("CLIP", "CLIP"),)
    file_inputs: tuple[str, ...] = ("clip_name",)  # the file widgets, in order
    families: dict[str, str | None] = CLIP_TYPES  # type widget -> text encoder family

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(*(model_path(settings, "text_encoders", widgets[n]) for n in cls.file_inputs))

    @classmethod
    def memory_files(cls, settings: Any, widgets: dict[str, Any]) -> dict[str, list[Path]]:
        return {"te": [model_path(settings, "text_encoders", widgets[name]) for name in cls.file_inputs]}

    def run(self, ctx: RunContext, type: str, backend: str = "auto", params_backend: str = "auto",
            **names: str) -> tuple:
        cls = self.__class__
        paths = [model_path(ctx.settings, "text_encoders", names[name]) for name in cls.file_inputs]
        widgets = {**names, "backend": backend, "params_backend": params_backend}
        devices, homes = node_targets(ctx, cls, widgets)
        types = node_weight_types(ctx, cls, widgets)["te"]
        return (load_text_encoders(paths, cls.families[type], None, devices["te"], homes["te"], get_runtime(),
                                   types),)


class DualCLIPLoaderGGUF(CLIPLoaderGGUF):
    display_name = "DualCLIPLoader (GGUF)"
    description = ("Loads two text encoders (GGUF or not): SDXL's CLIP-L and OpenCLIP-bigG (type sdxl), or "
                   "FLUX's CLIP-L and T5-XXL (type flux).")
    inputs = (_clip_name_input("clip_name1"), _clip_name_input("clip_name2"),
              combo_input("type", tuple(DUAL_CLIP_TYPES), "sdxl"), *placement_inputs())
    file_inputs = ("clip_name1", "clip_name2")
    families = DUAL_CLIP_TYPES


class TripleCLIPLoaderGGUF(NodeType):
    display_name = "TripleCLIPLoader (GGUF)"
    category = "bootleg"
    description = ("ComfyUI-GGUF's loader of SD3's text encoders (CLIP-L, CLIP-G, T5-XXL): imports, but "
                   "Sluice has no SD3 model; use CLIPLoaderGGUF or DualCLIPLoaderGGUF.")
    inputs: tuple[Input, ...] = tuple(_clip_name_input(f"clip_name{i}") for i in (1, 2, 3))
    outputs = (Output("CLIP", "CLIP"),)
    loads = "SD3's text encoders (CLIP-L, CLIP-G and T5-XXL)"  # what ComfyUI-GGUF loads with it

    def run(self, ctx: RunContext, **names: str) -> tuple:
        raise ValueError(f"{self.type_name} loads {self.loads}, for a model Sluice does not run; text "
                         f"encoders Sluice runs: CLIPLoaderGGUF (type {', '.join(CLIP_TYPES)}) and "
                         f"DualCLIPLoaderGGUF (type {', '.join(DUAL_CLIP_TYPES)})")


class QuadrupleCLIPLoaderGGUF(TripleCLIPLoaderGGUF):
    display_name = "QuadrupleCLIPLoader (GGUF)"
    description = ("ComfyUI-GGUF's loader of HiDream's text encoders (CLIP-L, CLIP-G, T5-XXL, Llama): "
                   "imports, but Sluice has no HiDream model; use CLIPLoaderGGUF or DualCLIPLoaderGGUF.")
    inputs = tuple(_clip_name_input(f"clip_name{i}") for i in (1, 2, 3, 4))
    loads = "HiDream's text encoders (CLIP-L, CLIP-G, T5-XXL and Llama 3.1)"


NODE_TYPES = (UnetLoaderGGUF, UnetLoaderGGUFAdvanced, CLIPLoaderGGUF, DualCLIPLoaderGGUF,
              TripleCLIPLoaderGGUF, QuadrupleCLIPLoaderGGUF)
LOADERS.update({node_type.type_name: node_type for node_type in NODE_TYPES
                if node_type.memory_module})  # auto-fit plans them too
