"""Model patch, guider, merge and save nodes with ComfyUI's names, input order and defaults:
ModelSamplingDiscrete, RescaleCFG, PerpNeg, PerpNegGuider, DualCFGGuider, FreeU_V2, ModelMergeSimple,
CheckpointSave and VAESave.

A patch node returns a clone of its MODEL: the incoming bundle is never changed. The model's patches live in
its options (engine/models/bundles.py) and reach the sampler through its denoiser; the guiders are GUIDER
link values for SamplerCustomAdvanced, which resolve each of their prompts for the latent as CFGGuider's
Guider resolves its positive one (`resolved_prompts`). The save nodes write ComfyUI's file names
(prefix_00001_.safetensors) under the output folder, with the workflow and its API prompt as metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.graph.spec import (
    NodeType,
    Output,
    RunContext,
    bool_input,
    combo_input,
    float_input,
    link_input,
    string_input,
)
from engine.images import workflow_chunks
from engine.models.bundles import DiffusionModel, TextEncoder, VAEModel, require
from engine.models.checkpoint_save import checkpoint_tensors, vae_tensors, write_safetensors
from engine.models.conditioning import check_conditioning
from engine.models.model_patches import merge_simple, with_freeu_v2
from engine.sampling.guidance import DualCFGDenoiser, PerpNegCfg, PerpNegDenoiser, RescaleCfg
from engine.sampling.model_sampling import DISCRETE_PREDICTIONS, RectifiedFlow, discrete_model_sampling
from engine.settings import output_prefix_problem
from nodes.custom_sampling import Guider
from nodes.loaders import current_settings

CHECKPOINT_EXTENSION = ".safetensors"


def cfg_input(name: str) -> Any:
    return float_input(name, 8.0, min=0.0, max=100.0, step=0.1)


def patched(model: Any) -> DiffusionModel:
    """A clone of the MODEL input, for a patch node to change."""
    return require(model, "MODEL", DiffusionModel).clone()


class ModelSamplingDiscrete(NodeType):
    category = "advanced/model"
    description = ("Samples an SD model as predicting eps, v (v_prediction), an LCM-distilled eps (lcm) or "
                   "the clean image (x0), optionally on a zero-terminal-SNR schedule (zsnr).")
    inputs = (link_input("model", "MODEL"), combo_input("sampling", tuple(DISCRETE_PREDICTIONS), "eps"),
              bool_input("zsnr", False))
    outputs = (Output("MODEL", "MODEL"),)

    def run(self, ctx: RunContext, model: Any, sampling: str, zsnr: bool) -> tuple:
        clone = patched(model)
        if isinstance(clone.model_sampling, RectifiedFlow):
            raise ValueError(f"ModelSamplingDiscrete sets a discrete noise schedule for SD models; this "
                             f"{clone.family} model samples a rectified flow")
        clone.model_sampling = discrete_model_sampling(sampling, zsnr)
        return (clone,)


class RescaleCFG(NodeType):
    category = "advanced/model"
    description = ("Rescales the guided prediction to the positive prediction's spread (in v space), mixed "
                   "in by multiplier: for v-prediction and zero-terminal-SNR models at high cfg.")
    inputs = (link_input("model", "MODEL"), float_input("multiplier", 0.7, min=0.0, max=1.0, step=0.01))
    outputs = (Output("MODEL", "MODEL"),)

    def run(self, ctx: RunContext, model: Any, multiplier: float) -> tuple:
        clone = patched(model)
        clone.options["sampler_cfg_function"] = RescaleCfg(multiplier)
        return (clone,)


class PerpNeg(NodeType):
    display_name = "Perp-Neg (DEPRECATED by PerpNegGuider)"
    category = "_for_testing"
    description = ("Guides against only the part of the negative prompt perpendicular to the positive one, "
                   "measured from the empty prompt (a further model call per step).")
    inputs = (link_input("model", "MODEL"), link_input("empty_conditioning", "CONDITIONING"),
              float_input("neg_scale", 1.0, min=0.0, max=100.0, step=0.01))
    outputs = (Output("MODEL", "MODEL"),)

    def run(self, ctx: RunContext, model: Any, empty_conditioning: Any, neg_scale: float) -> tuple:
        clone = patched(model)
        empty = check_conditioning(empty_conditioning, "empty_conditioning")
        clone.options["sampler_cfg_function"] = PerpNegCfg(empty, neg_scale)
        return (clone,)


def resolved_prompts(model: DiffusionModel, prompts: tuple[list, ...], args: tuple, kwargs: dict,
                     ) -> tuple[list[list], Callable[[], None] | None]:
    """Each CONDITIONING as the sampler's entries, resolved by Guider.denoiser(*args, **kwargs) as the
    positive prompt of a guider without negative; and the interrupt check it was given."""
    guided = [Guider(model, prompt, None, 1.0).denoiser(*args, **kwargs) for prompt in prompts]
    return [denoiser.sides[0] for denoiser in guided], guided[0].check_interrupt


@dataclass(frozen=True)
class PerpNegGuidance(Guider):
    """The GUIDER of PerpNegGuider: Guider's model, prompts and cfg, the empty prompt and neg_scale."""

    empty: list
    neg_scale: float

    def denoiser(self, *args: Any, **kwargs: Any) -> PerpNegDenoiser:
        """Guider.denoiser's arguments -> the Perp-Neg denoiser."""
        (positive, negative, empty), check_interrupt = resolved_prompts(
            self.model, (self.positive, self.negative, self.empty), args, kwargs)
        return PerpNegDenoiser(self.model.denoiser(), positive, negative, empty, self.cfg, self.neg_scale,
                               check_interrupt=check_interrupt)


class PerpNegGuider(NodeType):
    category = "_for_testing"
    description = ("Classifier-free guidance against only the part of the negative prompt perpendicular to "
                   "the positive one, measured from the empty prompt (Perp-Neg); for SamplerCustomAdvanced.")
    inputs = (link_input("model", "MODEL"), link_input("positive", "CONDITIONING"),
              link_input("negative", "CONDITIONING"), link_input("empty_conditioning", "CONDITIONING"),
              cfg_input("cfg"), float_input("neg_scale", 1.0, min=0.0, max=100.0, step=0.01))
    outputs = (Output("GUIDER", "GUIDER"),)

    def run(self, ctx: RunContext, model: Any, positive: Any, negative: Any, empty_conditioning: Any,
            cfg: float, neg_scale: float) -> tuple:
        return (PerpNegGuidance(require(model, "MODEL", DiffusionModel), positive, negative, cfg,
                                empty_conditioning, neg_scale),)


@dataclass(frozen=True)
class DualCFGGuidance(Guider):
    """The GUIDER of DualCFGGuider: Guider's fields hold cond1, the negative prompt and cfg_conds."""

    middle: list  # cond2
    cfg_middle: float  # cfg_cond2_negative
    nested: bool

    def denoiser(self, *args: Any, **kwargs: Any) -> DualCFGDenoiser:
        """Guider.denoiser's arguments -> the DualCFG denoiser."""
        (cond1, cond2, negative), check_interrupt = resolved_prompts(
            self.model, (self.positive, self.middle, self.negative), args, kwargs)
        return DualCFGDenoiser(self.model.denoiser(), cond1, cond2, negative, self.cfg, self.cfg_middle,
                               self.nested, check_interrupt=check_interrupt)


class DualCFGGuider(NodeType):
    category = "sampling/custom_sampling/guiders"
    description = ("Two guidance scales: cond2 guided away from the negative prompt (cfg_cond2_negative), "
                   "cond1 away from cond2 (cfg_conds); 'nested' guides cond1 from cond2 first.")
    inputs = (link_input("model", "MODEL"), link_input("cond1", "CONDITIONING"),
              link_input("cond2", "CONDITIONING"), link_input("negative", "CONDITIONING"),
              cfg_input("cfg_conds"), cfg_input("cfg_cond2_negative"),
              combo_input("style", ("regular", "nested"), "regular"))
    outputs = (Output("GUIDER", "GUIDER"),)

    def run(self, ctx: RunContext, model: Any, cond1: Any, cond2: Any, negative: Any, cfg_conds: float,
            cfg_cond2_negative: float, style: str) -> tuple:
        return (DualCFGGuidance(require(model, "MODEL", DiffusionModel), cond1, negative, cfg_conds, cond2,
                                cfg_cond2_negative, style == "nested"),)


class FreeU_V2(NodeType):  # noqa: N801 (ComfyUI's type name)
    category = "model_patches/unet"
    description = ("FreeU v2: strengthens the UNet's backbone features (b1, b2) and damps the low "
                   "frequencies of its skip connections (s1, s2) at the two deepest levels.")
    inputs = (link_input("model", "MODEL"),
              float_input("b1", 1.3, min=0.0, max=10.0, step=0.01),
              float_input("b2", 1.4, min=0.0, max=10.0, step=0.01),
              float_input("s1", 0.9, min=0.0, max=10.0, step=0.01),
              float_input("s2", 0.2, min=0.0, max=10.0, step=0.01))
    outputs = (Output("MODEL", "MODEL"),)

    def run(self, ctx: RunContext, model: Any, b1: float, b2: float, s1: float, s2: float) -> tuple:
        return (with_freeu_v2(require(model, "MODEL", DiffusionModel), b1, b2, s1, s2),)


class ModelMergeSimple(NodeType):
    category = "advanced/model_merging"
    description = "Merges two models of one architecture: ratio * model1 + (1 - ratio) * model2 per weight."
    inputs = (link_input("model1", "MODEL"), link_input("model2", "MODEL"),
              float_input("ratio", 1.0, min=0.0, max=1.0, step=0.01))
    outputs = (Output("MODEL", "MODEL"),)

    def run(self, ctx: RunContext, model1: Any, model2: Any, ratio: float) -> tuple:
        model1, model2 = require(model1, "MODEL", DiffusionModel), require(model2, "MODEL", DiffusionModel)
        return (merge_simple(model1, model2, ratio),)


def _save(ctx: RunContext, tensors: dict, filename_prefix: str) -> None:
    path = current_settings(ctx.settings).output_path(filename_prefix, CHECKPOINT_EXTENSION)
    write_safetensors(path, tensors, workflow_chunks(ctx.workflow) or None)


class CheckpointSave(NodeType):
    display_name = "Save Checkpoint"
    category = "advanced/model_merging"
    description = ("Saves the model, text encoder and VAE as one checkpoint (prefix_00001_.safetensors in "
                   "the output folder) in the key layout of their family, which Sluice and ComfyUI load.")
    output_node = True
    inputs = (link_input("model", "MODEL"), link_input("clip", "CLIP"), link_input("vae", "VAE"),
              string_input("filename_prefix", "checkpoints/ComfyUI", check=output_prefix_problem))
    outputs = ()

    def run(self, ctx: RunContext, model: Any, clip: Any, vae: Any, filename_prefix: str) -> tuple:
        tensors = checkpoint_tensors(require(model, "MODEL", DiffusionModel),
                                     require(clip, "CLIP", TextEncoder), require(vae, "VAE", VAEModel))
        _save(ctx, tensors, filename_prefix)
        return ()


class VAESave(NodeType):
    category = "advanced/model_merging"
    description = "Saves the VAE alone (prefix_00001_.safetensors in the output folder), with bare keys."
    output_node = True
    inputs = (link_input("vae", "VAE"),
              string_input("filename_prefix", "vae/ComfyUI_vae", check=output_prefix_problem))
    outputs = ()

    def run(self, ctx: RunContext, vae: Any, filename_prefix: str) -> tuple:
        _save(ctx, vae_tensors(require(vae, "VAE", VAEModel)), filename_prefix)
        return ()


NODE_TYPES = (ModelSamplingDiscrete, RescaleCFG, PerpNeg, PerpNegGuider, DualCFGGuider, FreeU_V2,
              ModelMergeSimple, CheckpointSave, VAESave)
