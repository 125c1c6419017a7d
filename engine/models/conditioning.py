"""Text conditioning of the SD1, SD2 and SDXL families, read from CLIP encoders the way ComfyUI reads them.

Each family reads its encoders with fixed conventions (ComfyUI, comfy/sd1_clip.py, sd2_clip.py,
sdxl_clip.py, which follow the original ldm / sgm embedders):

| family       | encoder    | layer (default clip_skip) | final LayerNorm on it | pad id | pooled           |
| ------------ | ---------- | ------------------------- | --------------------- | ------ | ---------------- |
| SD1          | CLIP-L     | last (1)                  | yes                   | EOS    | unused           |
| SD2          | OpenCLIP-H | penultimate (2)           | yes (ldm's ln_final)  | 0      | unused           |
| SDXL         | CLIP-L     | penultimate (2)           | no                    | EOS    | unused           |
| SDXL         | OpenCLIP-G | penultimate (2)           | no                    | 0      | last, projected  |
| SDXL refiner | OpenCLIP-G | penultimate (2)           | no                    | 0      | last, projected  |

A user's clip_skip n (CLIPSetLastLayer -n) replaces the default layer and keeps the LayerNorm rule.
A prompt of several 77-token chunks is encoded chunk by chunk and concatenated along the tokens.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.clip import CLIPTextModel
from engine.models.detect import TextEncoderConfig
from engine.models.gligen import gligen_position
from engine.models.tokenizer import EmbeddingVector
from engine.sampling import guidance

log = logging.getLogger(__name__)

BOS_ID = 49406  # <|startoftext|>
EOS_ID = 49407  # <|endoftext|>, the largest id of the CLIP vocabulary

# A chunk holds, at each of its (usually 77) positions, a token and its prompt weight. A token is an id,
# or a textual-inversion vector (the tokenizer's EmbeddingVector, or a bare [width] tensor) that replaces
# the token embedding at that position.
WeightedChunk = Sequence[tuple[int | EmbeddingVector | torch.Tensor, float]]
EMBEDDING_PLACEHOLDER_ID = 0  # id at embedding positions; below EOS, so the pooled position is unchanged


@dataclass
class Conditioning:
    context: torch.Tensor  # [1, 77 * chunks, C]: cross-attention context of the diffusion model
    pooled: torch.Tensor | None  # [1, P]: pooled text feature (SDXL), None where the family has none


@dataclass(frozen=True)
class EncoderConvention:
    """How one family reads one text encoder (the options of ComfyUI's sd1_clip.SDClipModel)."""

    kind: str  # TextEncoderConfig.kind the encoder must have
    default_clip_skip: int  # 1 = last layer, 2 = penultimate
    norm_hidden: bool  # apply the final LayerNorm to the chosen layer (layer_norm_hidden_state)
    pad_id: int  # id after the end-of-text token (special_tokens["pad"])


SD1_CLIP_L = EncoderConvention("clip_l", default_clip_skip=1, norm_hidden=True, pad_id=EOS_ID)
SD2_OPENCLIP_H = EncoderConvention("openclip_h", default_clip_skip=2, norm_hidden=True, pad_id=0)
SDXL_CLIP_L = EncoderConvention("clip_l", default_clip_skip=2, norm_hidden=False, pad_id=EOS_ID)
SDXL_OPENCLIP_G = EncoderConvention("openclip_g", default_clip_skip=2, norm_hidden=False, pad_id=0)


def _check_encoder(model: CLIPTextModel, convention: EncoderConvention, role: str,
                   needs_projection: bool = False) -> None:
    if model.config.kind != convention.kind:
        raise ValueError(f"{role} needs a {convention.kind} text encoder, got {model.config.kind!r}")
    if needs_projection and model.config.projection_dim is None:
        raise ValueError(f"{role} needs the text_projection of its {convention.kind} encoder, "
                         "which this checkpoint lacks")


def _split_tokens(chunks: Sequence[WeightedChunk], config: TextEncoderConfig,
                  ) -> tuple[torch.Tensor, torch.Tensor, dict[tuple[int, int], torch.Tensor]]:
    """Chunks -> (token ids [n, T], weights [n, T], embedding vectors by (chunk, position))."""
    if not chunks:
        raise ValueError("a prompt needs at least one chunk of tokens; got none")
    width, max_positions = config.width, config.max_positions
    lengths = sorted({len(chunk) for chunk in chunks})
    if len(lengths) != 1 or not 2 <= lengths[0] <= max_positions:
        raise ValueError(f"prompt chunks must all have one length between 2 and {max_positions}, "
                         f"got lengths {[len(chunk) for chunk in chunks]}")
    ids, vectors = [], {}
    for chunk_index, chunk in enumerate(chunks):
        ids.append([])
        for position, (token, _) in enumerate(chunk):
            if isinstance(token, numbers.Integral):
                if not 0 <= token < config.vocab_size:
                    raise ValueError(f"token id {token} at (chunk {chunk_index}, position {position}) is "
                                     f"outside the {config.kind} vocabulary; "
                                     f"accepted: 0 to {config.vocab_size - 1}")
                ids[-1].append(int(token))
                continue
            vector = token.vector if isinstance(token, EmbeddingVector) else token
            if not isinstance(vector, torch.Tensor) or vector.shape != (width,):
                shape = tuple(vector.shape) if isinstance(vector, torch.Tensor) else type(vector).__name__
                raise ValueError(f"token at (chunk {chunk_index}, position {position}) is {shape}; accepted: "
                                 f"a token id, or an embedding vector of shape ({width},) for this encoder")
            ids[-1].append(EMBEDDING_PLACEHOLDER_ID)
            vectors[chunk_index, position] = vector
    weights = torch.tensor([[weight for _, weight in chunk] for chunk in chunks], dtype=torch.float32)
    return torch.tensor(ids, dtype=torch.long), weights, vectors


def _repad(ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Token ids [n, T] with every position after a row's first end-of-text token set to `pad_id`."""
    is_eos = (ids == EOS_ID).long()
    after_eos = is_eos.cumsum(dim=1) - is_eos > 0  # (n, T): an EOS stands strictly before
    return torch.where(after_eos, torch.full_like(ids, pad_id), ids)


def _empty_ids(length: int, pad_id: int) -> torch.Tensor:
    """The empty prompt [1, T]: BOS, EOS, then padding (ComfyUI's gen_empty_tokens)."""
    return torch.tensor([[BOS_ID, EOS_ID] + [pad_id] * (length - 2)], dtype=torch.long)


def encode_weighted(model: CLIPTextModel, convention: EncoderConvention, chunks: Sequence[WeightedChunk],
                    clip_skip: int | None = None, return_pooled: bool = False,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Encode weighted chunks -> (z [1, T * n, W], pooled of the first chunk [1, P] or None).

    Padding follows the convention whichever tokenizer made the chunks. Prompt weights follow ComfyUI's
    ClipTokenWeightEncoder.encode_token_weights (comfy/sd1_clip.py): when any weight differs from 1, the
    empty prompt is encoded in the same batch and each weighted position is moved away from it,
    `z[j] = (z[j] - z_empty[j]) * weight + z_empty[j]`.
    """
    ids, weights, vectors = _split_tokens(chunks, model.config)
    ids = _repad(ids, convention.pad_id)  # (n, T)
    has_weights = bool((weights != 1.0).any())
    batch = torch.cat([ids, _empty_ids(ids.shape[1], convention.pad_id)]) if has_weights else ids
    batch = batch.to(next(model.parameters()).device)  # (n [+ 1], T)

    token_embeds = None
    if vectors:
        token_embeds = model.token_embeddings(batch).clone()  # (n [+ 1], T, W)
        for (chunk, position), vector in vectors.items():
            token_embeds[chunk, position] = vector.to(token_embeds)

    skip = convention.default_clip_skip if clip_skip is None else clip_skip
    z, pooled = model(batch, clip_skip=skip, return_pooled=return_pooled, norm_hidden=convention.norm_hidden,
                      token_embeds=token_embeds)
    z = z.float()
    if has_weights:
        z_empty = z[-1:]  # (1, T, W)
        z = z[:-1]
        w = weights.to(z.device)[..., None]  # (n, T, 1)
        z = torch.where(w != 1.0, (z - z_empty) * w + z_empty, z)
    context = z.reshape(1, -1, z.shape[-1])  # (n, T, W) -> (1, n * T, W)
    return context, (pooled[:1].float() if pooled is not None else None)


class SD1Conditioner:
    """SD1.x: CLIP-L hidden states (768), last layer through the final LayerNorm."""

    def __init__(self, clip_l: CLIPTextModel):
        _check_encoder(clip_l, SD1_CLIP_L, "SD1 conditioning")
        self.clip_l = clip_l

    def encode(self, chunks: Sequence[WeightedChunk], clip_skip: int | None = None) -> Conditioning:
        context, _ = encode_weighted(self.clip_l, SD1_CLIP_L, chunks, clip_skip)
        return Conditioning(context, None)


class SD2Conditioner:
    """SD2.x: OpenCLIP-H hidden states (1024), penultimate layer through the final LayerNorm."""

    def __init__(self, clip_h: CLIPTextModel):
        _check_encoder(clip_h, SD2_OPENCLIP_H, "SD2 conditioning")
        self.clip_h = clip_h

    def encode(self, chunks: Sequence[WeightedChunk], clip_skip: int | None = None) -> Conditioning:
        context, _ = encode_weighted(self.clip_h, SD2_OPENCLIP_H, chunks, clip_skip)
        return Conditioning(context, None)


def _per_encoder(chunks: Sequence[WeightedChunk] | Mapping[str, Sequence[WeightedChunk]],
                 kinds: tuple[str, ...]) -> list[Sequence[WeightedChunk]]:
    """One chunk list per encoder: the same list for all, or a mapping from encoder kind to its own list
    (needed when textual-inversion vectors differ per encoder, like ComfyUI's {"l": ..., "g": ...})."""
    if not isinstance(chunks, Mapping):
        return [chunks for _ in kinds]
    if set(chunks) != set(kinds):
        raise ValueError(f"prompt chunks given for encoders {sorted(chunks)}; accepted: {', '.join(kinds)}")
    return [chunks[kind] for kind in kinds]


class SDXLConditioner:
    """SDXL base: CLIP-L (768) ++ bigG (1280) penultimate layers = 2048 channels; pooled from bigG."""

    def __init__(self, clip_l: CLIPTextModel, clip_g: CLIPTextModel):
        _check_encoder(clip_l, SDXL_CLIP_L, "SDXL conditioning (first encoder)")
        _check_encoder(clip_g, SDXL_OPENCLIP_G, "SDXL conditioning (second encoder)", needs_projection=True)
        self.clip_l = clip_l
        self.clip_g = clip_g

    def encode(self, chunks: Sequence[WeightedChunk] | Mapping[str, Sequence[WeightedChunk]],
               clip_skip: int | None = None) -> Conditioning:
        chunks_l, chunks_g = _per_encoder(chunks, ("clip_l", "openclip_g"))
        if len(chunks_l) != len(chunks_g):
            raise ValueError(f"the CLIP-L and bigG prompts must have as many chunks; got {len(chunks_l)} "
                             f"and {len(chunks_g)}")
        context_l, _ = encode_weighted(self.clip_l, SDXL_CLIP_L, chunks_l, clip_skip)
        context_g, pooled = encode_weighted(self.clip_g, SDXL_OPENCLIP_G, chunks_g, clip_skip,
                                            return_pooled=True)
        return Conditioning(torch.cat([context_l, context_g], dim=-1), pooled)  # (1, n * 77, 768 + 1280)


class SDXLRefinerConditioner:
    """SDXL refiner: OpenCLIP-bigG alone, penultimate layer (1280); pooled from its projection."""

    def __init__(self, clip_g: CLIPTextModel):
        _check_encoder(clip_g, SDXL_OPENCLIP_G, "SDXL refiner conditioning", needs_projection=True)
        self.clip_g = clip_g

    def encode(self, chunks: Sequence[WeightedChunk], clip_skip: int | None = None) -> Conditioning:
        context, pooled = encode_weighted(self.clip_g, SDXL_OPENCLIP_G, chunks, clip_skip, return_pooled=True)
        return Conditioning(context, pooled)


def size_embedding(values: Sequence[float], dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of each number, cos half first (Vaswani et al. 2017; diffusers'
    Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0)) -> [len(values) * dim]."""
    half = dim // 2
    freqs = torch.exp(-torch.log(torch.tensor(max_period)) * torch.arange(half, dtype=torch.float32) / half)
    args = torch.tensor(values, dtype=torch.float32)[:, None] * freqs[None]  # (n, half)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1).flatten()  # (n, dim) -> (n * dim,)


def sdxl_adm(pooled: torch.Tensor, width: int, height: int, crop_w: int = 0, crop_h: int = 0,
             target_width: int | None = None, target_height: int | None = None) -> torch.Tensor:
    """SDXL base vector condition y [B, 2816]: pooled (1280) ++ embeddings of original size (h, w), crop
    top-left (top, left) and target size (h, w), 256 each (Podell et al. 2023, SDXL micro-conditioning)."""
    target_width = width if target_width is None else target_width
    target_height = height if target_height is None else target_height
    sizes = size_embedding([height, width, crop_h, crop_w, target_height, target_width]).to(pooled)
    return torch.cat([pooled, sizes.expand(pooled.shape[0], -1)], dim=-1)


def sdxl_refiner_adm(pooled: torch.Tensor, width: int, height: int, crop_w: int = 0, crop_h: int = 0,
                     aesthetic_score: float = 6.0) -> torch.Tensor:
    """SDXL refiner vector condition y [B, 2560]: pooled (1280) ++ embeddings of original size (h, w),
    crop top-left (top, left) and aesthetic score, 256 each."""
    sizes = size_embedding([height, width, crop_h, crop_w, aesthetic_score]).to(pooled)
    return torch.cat([pooled, sizes.expand(pooled.shape[0], -1)], dim=-1)


# ---------------------------------------------------------------------------------------------- CONDITIONING
# A CONDITIONING (ComfyUI's type, on node links) is a list of [context [1, T, C], options] entries. The
# options dict is open: "pooled_output" [1, P], the SDXL size fields, "guidance" (FluxGuidance), "area"
# ((h, w, y, x) in latent cells, or ("percentage", h, w, y, x) in fractions of the latent), "strength",
# "mask" ([B, H, W] at any size) with "mask_strength" and "set_area_to_bounds", "start_percent" /
# "end_percent" (fractions of the sampling), "control" and "control_apply_to_uncond" (ControlNet),
# "unclip_conditioning" (unCLIPConditioning: engine/models/unclip.py), "gligen" (GLIGENTextBoxApply:
# engine/models/gligen.py), and whatever other nodes add. Nodes never write into an entry: they return new
# lists of new dicts (the tensors are shared).

ConditioningList = list[list[Any]]
# (context, options) -> the model's (context, y, guidance) for an entry
ModelInputs = Callable[[torch.Tensor, Mapping[str, Any]],
                       tuple[torch.Tensor, torch.Tensor | None, float | None]]


def check_conditioning(conditioning: Any, role: str = "conditioning") -> ConditioningList:
    """The list itself when it is a CONDITIONING (a list of [context [B, T, C], {...}] entries); else a clear
    error."""
    if not isinstance(conditioning, list) or not all(
            isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], torch.Tensor)
            and entry[0].ndim == 3 and isinstance(entry[1], dict) for entry in conditioning):
        raise ValueError(f"{role}: expected a CONDITIONING (a list of [context (batch, tokens, channels), "
                         f"{{options}}] entries), got {type(conditioning).__name__}")
    return conditioning


def set_values(conditioning: ConditioningList, **values: Any) -> ConditioningList:
    """Every entry with `values` set in a copy of its options (ComfyUI's conditioning_set_values)."""
    return [[context, {**options, **values}] for context, options in check_conditioning(conditioning)]


def first_entry(conditioning: ConditioningList, role: str) -> list[Any]:
    """The first entry of `conditioning`, which must have one; a warning when it has more (ComfyUI's nodes
    that read one entry use the first)."""
    if not check_conditioning(conditioning, role):
        raise ValueError(f"{role} is empty; connect the output of a CLIPTextEncode node")
    if len(conditioning) > 1:
        log.warning("%s holds %d entries; only the first one is used", role, len(conditioning))
    return conditioning[0]


def concat_conditioning(to: ConditioningList, source: ConditioningList) -> ConditioningList:
    """ConditioningConcat: each entry of `to` with the first context of `source` appended along the tokens."""
    appended = first_entry(source, "conditioning_from")[0]
    return [[torch.cat((context, appended.to(context)), dim=1), dict(options)]
            for context, options in check_conditioning(to, "conditioning_to")]


def average_conditioning(to: ConditioningList, source: ConditioningList, to_strength: float,
                         ) -> ConditioningList:
    """ConditioningAverage: each entry of `to` as to_strength * it + (1 - to_strength) * the first entry of
    `source`, whose context is cut or zero-padded to the entry's length; pooled outputs mix the same way (an
    entry without one takes `source`'s)."""
    source_context, source_options = first_entry(source, "conditioning_from")
    source_pooled = source_options.get("pooled_output")
    averaged = []
    for context, options in check_conditioning(to, "conditioning_to"):
        other = source_context[:, :context.shape[1]].to(context)
        if other.shape[1] < context.shape[1]:
            padding = context.new_zeros(1, context.shape[1] - other.shape[1], context.shape[2])
            other = torch.cat([other, padding], dim=1)
        options = dict(options)
        pooled = options.get("pooled_output", source_pooled)
        if source_pooled is not None and pooled is not None:
            options["pooled_output"] = pooled * to_strength + source_pooled * (1.0 - to_strength)
        elif source_pooled is not None:
            options["pooled_output"] = source_pooled
        averaged.append([context * to_strength + other * (1.0 - to_strength), options])
    return averaged


def _area_cells(area: Any, height: int, width: int) -> tuple[int, int, int, int]:
    """An entry's "area" in latent cells (height, width, top, left); fractions ("percentage", h, w, y, x) are
    resolved against the latent's size as ComfyUI's resolve_areas_and_cond_masks (Python's round)."""
    if isinstance(area, (tuple, list)) and len(area) == 5 and area[0] == "percentage":
        h, w, top, left = (float(v) for v in area[1:])
        return max(1, round(h * height)), max(1, round(w * width)), round(top * height), round(left * width)
    if isinstance(area, (tuple, list)) and len(area) == 4 and all(isinstance(v, int) for v in area):
        return tuple(area)
    raise ValueError(f"conditioning area {area!r} is not (height, width, y, x) in latent cells nor "
                     f"('percentage', height, width, y, x) in fractions")


def _mask_bounds(mask: torch.Tensor) -> tuple[int, int, int, int]:
    """The area (height, width, top, left) of the cells any mask of the batch covers, at least 8 x 8;
    (8, 8, 0, 0) for an empty mask (ComfyUI's set_area_to_bounds)."""
    covered = mask.abs().amax(dim=0) != 0  # (H, W)
    if not bool(covered.any()):
        return 8, 8, 0, 0
    rows, cols = torch.where(covered)
    top, left = int(rows.min()), int(cols.min())
    return max(8, int(rows.max()) - top + 1), max(8, int(cols.max()) - left + 1), top, left


def _latent_mask(mask: Any, height: int, width: int) -> torch.Tensor:
    """A MASK ([H, W] or [B, H, W]) resized to the latent (bilinear, as ComfyUI) -> [B, height, width]."""
    if not isinstance(mask, torch.Tensor) or mask.ndim not in (2, 3):
        shown = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"conditioning mask must be a MASK of shape (height, width) or (batch, height, "
                         f"width); got {shown}")
    mask = mask.float()[None] if mask.ndim == 2 else mask.float()
    if tuple(mask.shape[1:]) != (height, width):
        mask = F.interpolate(mask[:, None], size=(height, width), mode="bilinear", align_corners=False)[:, 0]
    return mask


def sampler_entries(conditioning: Any, height: int, width: int, model_sampling: Any,
                    model_inputs: ModelInputs, role: str = "conditioning") -> list[guidance.Conditioning]:
    """A CONDITIONING as the sampler's entries for a latent of height x width cells (ComfyUI's
    process_conds): areas in cells, masks at the latent's size (with their bounds as area for "mask bounds"),
    start and end percents as sigmas through `model_sampling.percent_to_sigma`, and the model's inputs
    (context, y, guidance) from `model_inputs(context, options)`."""
    if not check_conditioning(conditioning, role):
        raise ValueError(f"{role} is empty; connect the output of a CLIPTextEncode node")
    entries = []
    for context, options in conditioning:
        context, y, scale = model_inputs(context, options)
        area = None if options.get("area") is None else _area_cells(options["area"], height, width)
        mask = None if options.get("mask") is None else _latent_mask(options["mask"], height, width)
        if mask is not None and options.get("set_area_to_bounds", False):
            area = _mask_bounds(mask)
        sigma_start = sigma_end = None
        if "start_percent" in options:
            sigma_start = model_sampling.percent_to_sigma(float(options["start_percent"]))
        if "end_percent" in options:
            sigma_end = model_sampling.percent_to_sigma(float(options["end_percent"]))
        entries.append(guidance.Conditioning(
            context, y, scale, area=area, mask=mask, mask_strength=float(options.get("mask_strength", 1.0)),
            strength=float(options.get("strength", 1.0)), sigma_start=sigma_start, sigma_end=sigma_end,
            control=options.get("control"),
            control_apply_to_uncond=bool(options.get("control_apply_to_uncond", False)),
            middle_patch=None if options.get("gligen") is None else gligen_position(options["gligen"])))
    return entries
