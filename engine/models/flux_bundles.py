"""FLUX.1 on node links: its MODEL (the transformer, flow-matching sampling) and its CLIP (CLIP-L + T5-XXL).

ComfyUI's conventions (comfy/model_base.py Flux, comfy/text_encoders/flux.py):
- LATENT holds the VAE's raw 16-channel latent; the model samples `(latent - 0.1159) * 0.3611`.
- CONDITIONING is `[[t5 hidden [1, T, 4096], {"pooled_output": CLIP-L pooled [1, 768], "guidance": g}]]`;
  the guidance embedding (dev only) reads `guidance`, 3.5 when a conditioning does not set it.
- CLIP-L is read at its last layer through the final LayerNorm, its pooled feature unprojected; T5-XXL's
  prompt is padded to at least 256 tokens and never cut.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine.memory.runtime import torch_device
from engine.models.bundles import (
    ConditioningList,
    DiffusionModel,
    EmbeddingLookup,
    TextEncoder,
    _lookup_for,
    _tokenizer_for,
)
from engine.models.clip import CLIPTextModel
from engine.models.conditioning import (
    EOS_ID,
    Conditioning,
    EncoderConvention,
    encode_weighted,
    sampler_entries,
)
from engine.models.t5 import T5Encoder
from engine.models.t5_tokenizer import T5Tokenizer
from engine.models.t5_tokenizer import encode_weighted as encode_weighted_t5
from engine.sampling import guidance

DEFAULT_GUIDANCE = 3.5  # ComfyUI's Flux.extra_conds when a conditioning carries no guidance
FLUX_CLIP_L = EncoderConvention("clip_l", default_clip_skip=1, norm_hidden=True, pad_id=EOS_ID)
T5_KIND = "t5xxl"


@dataclass
class FluxDiffusionModel(DiffusionModel):
    """FLUX.1 dev or schnell: the transformer stands where an SD model has its UNet (ComfyUI's
    diffusion_model), with flow-matching sampling and FLUX's latent scale and shift."""

    @property
    def dtype(self) -> torch.dtype:
        return self.unet.dtype  # the activations'; fp8 weights compute in it

    @property
    def latent_format(self) -> str:
        return "flux"

    @property
    def has_guidance(self) -> bool:
        """Whether the transformer embeds a guidance scale (dev), not step-distilled (schnell)."""
        return self.unet.config.guidance_embed

    @torch.no_grad()
    def apply(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
              y: torch.Tensor | None = None, guidance: torch.Tensor | None = None) -> torch.Tensor:
        """The velocity for x [B, 16, h, w] at flow time `timesteps` [B] (sigma in [0, 1])."""
        if y is None:
            raise ValueError("a FLUX model needs the pooled CLIP-L feature; encode the prompt with FLUX's "
                             "text encoder (DualCLIPLoader type flux)")
        return self.run_network(x, timesteps, context, y, guidance if self.has_guidance else None)

    def guidance_conditioning(self, conditioning: ConditioningList, width: int, height: int, seed: int = 0,
                              ) -> list[guidance.Conditioning]:
        """ComfyUI CONDITIONING -> the sampler's entries: per entry (context, y = pooled CLIP-L, guidance) and
        where and when it applies (engine/models/conditioning.py, sampler_entries). `seed` is the SD models'
        (for unCLIP noise augmentation); FLUX does not read it."""
        return sampler_entries(conditioning, height // 8, width // 8, self.model_sampling, self._model_inputs)

    def _model_inputs(self, context: torch.Tensor, extras: Mapping[str, Any],
                      ) -> tuple[torch.Tensor, torch.Tensor, float | None]:
        width_needed = self.unet.config.context_in_dim
        if context.shape[-1] != width_needed:
            raise ValueError(f"conditioning width {context.shape[-1]} does not suit this FLUX model (it "
                             f"reads T5-XXL's {width_needed}-wide output); encode the prompt with a FLUX "
                             f"text encoder (DualCLIPLoader type flux: CLIP-L + T5-XXL)")
        pooled = extras.get("pooled_output")
        if pooled is None or pooled.shape[-1] != self.unet.config.vec_in_dim:
            found = "none" if pooled is None else f"{pooled.shape[-1]} wide"
            raise ValueError(f"this FLUX model needs CLIP-L's pooled feature ({self.unet.config.vec_in_dim} "
                             f"wide); the conditioning has {found}")
        scale = extras.get("guidance", DEFAULT_GUIDANCE) if self.has_guidance else None
        return context, pooled, scale


@functools.cache
def _t5_tokenizer() -> T5Tokenizer:
    return T5Tokenizer()


class FluxConditioner:
    """FLUX.1's text conditioning: T5-XXL's hidden states as context, CLIP-L's pooled feature as vector."""

    def __init__(self, clip_l: Any, t5: Any) -> None:
        self.clip_l = clip_l  # a CLIPTextModel or a ManagedEncoder standing in for one
        self.t5 = t5  # tokens [B, T] -> hidden [B, T, 4096]: plain_t5(model) or a ManagedT5

    def encode(self, chunks: Mapping[str, Any], clip_skip: int | None = None) -> Conditioning:
        _, pooled = encode_weighted(self.clip_l, FLUX_CLIP_L, chunks["clip_l"], clip_skip, return_pooled=True)
        context = encode_weighted_t5(self.t5, chunks[T5_KIND])  # (1, T >= 256, 4096)
        return Conditioning(context.float(), pooled)


@dataclass
class FluxTextEncoder(TextEncoder):
    """CLIP-L and T5-XXL (ComfyUI's CLIP of type flux); `encoders` is (CLIP-L, T5)."""

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("clip_l", T5_KIND)

    def clone_with_clip_skip(self, stop_at_clip_layer: int) -> FluxTextEncoder:
        """ComfyUI's CLIPSetLastLayer on FLUX reads CLIP-L's layer; only its pooled feature is used, which
        always comes from the last layer, so the choice is kept but changes nothing."""
        layers = self.encoders[0].config.layers
        if not -layers <= stop_at_clip_layer <= -1:
            raise ValueError(f"stop_at_clip_layer {stop_at_clip_layer} is out of range for CLIP-L ({layers} "
                             f"layers); accepted: -1 to {-layers}")
        return dataclasses.replace(self, clip_skip=-stop_at_clip_layer)

    def tokenize(self, text: str, embedding_lookup: EmbeddingLookup | None = None) -> dict[str, list]:
        """CLIP-L's weighted 77-token chunks and T5's weighted tokens (at least 256) of `text`."""
        return {"clip_l": self._tokenize_clip_l(text, embedding_lookup),
                T5_KIND: _t5_tokenizer().tokenize_weighted(text)}

    def _tokenize_clip_l(self, text: str, embedding_lookup: EmbeddingLookup | None) -> list:
        clip_l: CLIPTextModel = self.encoders[0]
        return _tokenizer_for("clip_l").tokenize_weighted(text, _lookup_for(clip_l, embedding_lookup))

    @torch.no_grad()
    def encode_flux(self, clip_l: str, t5xxl: str, guidance_scale: float,
                    embedding_lookup: EmbeddingLookup | None = None) -> ConditioningList:
        """CLIPTextEncodeFlux: separate CLIP-L and T5 prompts, and the guidance scale."""
        chunks = {"clip_l": self._tokenize_clip_l(clip_l, embedding_lookup),
                  T5_KIND: _t5_tokenizer().tokenize_weighted(t5xxl)}
        conditioning = self.encode_tokens(chunks)
        conditioning[0][1]["guidance"] = guidance_scale
        return conditioning

    def encode_tokens(self, chunks: Mapping[str, list]) -> ConditioningList:
        encoded = self.conditioner.encode(chunks, self.clip_skip)
        return [[encoded.context.cpu(), {"pooled_output": encoded.pooled.cpu()}]]


class ManagedT5:
    """Runs a T5Encoder through the memory runtime: `(tokens [B, T]) -> hidden [B, T, d_model]`."""

    def __init__(self, model: T5Encoder, memory: Any, index: int) -> None:
        self.model, self.memory, self.index = model, memory, index

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(torch_device(self.memory.compute))
        state = self.memory.run(self.index, self.model, self.model.stages(), self.model.initial_state(tokens))
        return state["hidden"]


def plain_t5(model: T5Encoder) -> Any:
    """A T5Encoder as the conditioner calls it: tokens go to its device first."""
    def call(tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens.to(next(model.parameters()).device))

    return call
