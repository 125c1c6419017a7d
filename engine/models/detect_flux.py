"""Detection of FLUX.1 files and T5-XXL encoders from tensor names and shapes (no tensor data is read).

The layouts users have (issue 16):
- ComfyUI / BFL single files: `double_blocks.0.img_attn.norm.key_norm.scale`, `img_in.weight`, ..., bare or
  under `model.diffusion_model.`;
- diffusers transformer files: `transformer_blocks.0.attn.norm_k.weight`, `single_transformer_blocks.*`,
  `x_embedder.weight` (converted to BFL names lazily, engine/models/flux_keys.py);
- full checkpoints with the transformer, CLIP-L (`text_encoders.clip_l.transformer.text_model.`), T5-XXL
  (`text_encoders.t5xxl.transformer.`) and the 16-channel VAE (`vae.`) inside;
- T5-XXL encoder files (transformers' T5EncoderModel keys, `encoder.block.N.layer...`), alone.

The variant is `flux_dev` when the transformer has a guidance embedding (`guidance_in`), else `flux_schnell`.
The VAE scale and shift are FLUX's (0.3611, 0.1159); they belong to the diffusion model, the VAE works in raw
latents.
"""

from __future__ import annotations

from engine.models.detect import (
    TEXT_ROOTS,
    VAE_ROOTS,
    ComponentStats,
    ModelInfo,
    UnsupportedModelError,
    _Table,
    _text_config,
    _vae_config,
)
from engine.models.flux import flux_config_from_shapes
from engine.models.flux_keys import diffusers_flux_shapes
from engine.models.t5 import t5_config_from_shapes

FLUX_SCALE_FACTOR, FLUX_SHIFT_FACTOR = 0.3611, 0.1159
BFL_MARKER = "double_blocks.0.img_attn.qkv.weight"
DIFFUSERS_MARKER = "single_transformer_blocks.0.attn.to_q.weight"
T5_MARKER = "encoder.block.0.layer.0.SelfAttention.q.weight"
BFL_ROOTS = {"img_in", "time_in", "vector_in", "guidance_in", "txt_in", "double_blocks", "single_blocks",
             "final_layer"}
DIFFUSERS_ROOTS = {"x_embedder", "time_text_embed", "context_embedder", "transformer_blocks",
                   "single_transformer_blocks", "norm_out", "proj_out"}
T5_ROOTS = {"shared", "encoder"}


def _prefixes_of(t: _Table, marker: str) -> list[str]:
    return sorted(k[: -len(marker)] for k in t.entries if k.endswith(marker))


def _one_prefix(t: _Table, marker: str, what: str) -> str | None:
    found = _prefixes_of(t, marker)
    if len(found) > 1:
        raise UnsupportedModelError(f"{t.name} holds {len(found)} {what}s (under "
                                    f"{', '.join(map(repr, found))}); one is accepted")
    return found[0] if found else None


def _flux_markers(t: _Table) -> bool:
    """Whether the file holds a FLUX transformer (possibly incomplete): any double-block key."""
    return any("double_blocks." in k for k in t.entries) or bool(_prefixes_of(t, DIFFUSERS_MARKER))


def _shapes_under(t: _Table, prefix: str) -> dict[str, tuple[int, ...]]:
    return {k[len(prefix):]: e.shape for k, e in t.entries.items() if k.startswith(prefix)}


def _flux_prefix(t: _Table) -> tuple[str, str]:
    """(key prefix, layout) of the transformer; an incomplete one is an error naming what is missing."""
    diffusers = _one_prefix(t, DIFFUSERS_MARKER, "diffusers FLUX transformer")
    if diffusers is not None:
        return diffusers, "diffusers"
    bfl = _one_prefix(t, BFL_MARKER, "FLUX transformer")
    if bfl is None:
        some = next(k for k in t.entries if "double_blocks." in k)
        prefix = some[: some.index("double_blocks.")]
        raise UnsupportedModelError(f"{t.name}: a FLUX transformer needs '{prefix}{BFL_MARKER}'; the file "
                                    f"has double_blocks keys without it (truncated or not a FLUX.1 file)")
    return bfl, "bfl"


def _stats(t: _Table, components: dict[str, list[tuple[str, set[str]]]],
           ) -> tuple[dict[str, ComponentStats], ComponentStats, list[str]]:
    """Tensors, parameters, bytes and dtypes per component; each component is (prefix, roots) pairs."""
    stats = {name: ComponentStats() for name in components}
    unassigned, examples = ComponentStats(), []
    ordered = sorted(((len(p), name, p, roots) for name, parts in components.items() for p, roots in parts),
                     reverse=True)
    for key, entry in t.entries.items():
        owner = next((name for _, name, p, roots in ordered
                      if key.startswith(p) and key[len(p):].split(".", 1)[0] in roots), None)
        s = stats[owner] if owner else unassigned
        if owner is None and len(examples) < 5:
            examples.append(key)
        s.tensors += 1
        count = 1
        for d in entry.shape:
            count *= d
        s.parameters += count
        s.bytes += entry.nbytes
        s.dtypes[entry.type_name] = s.dtypes.get(entry.type_name, 0) + 1
    return stats, unassigned, examples


def _common_prefix(prefixes: list[str]) -> str:
    """The longest shared dotted prefix: "text_encoders." of "text_encoders.clip_l..." and "...t5xxl...")."""
    if len(prefixes) == 1:
        return prefixes[0]
    parts = [p.split(".") for p in prefixes]
    shared = []
    for pieces in zip(*parts, strict=False):
        if len(set(pieces)) != 1:
            break
        shared.append(pieces[0])
    return ".".join(shared) + "." if shared else ""


def detect_flux(t: _Table) -> ModelInfo | None:
    """ModelInfo of a FLUX file (transformer, with CLIP-L, T5 and VAE where present) or of a T5 encoder file;
    None when the file holds neither (the SD detection then reads it)."""
    has_flux, t5_prefix = _flux_markers(t), _one_prefix(t, T5_MARKER, "T5 encoder")
    if not has_flux and t5_prefix is None:
        return None
    components: dict[str, str] = {}
    parts: dict[str, list[tuple[str, set[str]]]] = {}
    flux = layout = None
    if has_flux:
        prefix, layout = _flux_prefix(t)
        shapes = _shapes_under(t, prefix)
        try:
            flux = flux_config_from_shapes(diffusers_flux_shapes(shapes) if layout == "diffusers" else shapes)
        except ValueError as error:
            raise UnsupportedModelError(f"{t.name}: {error}") from None
        components["diffusion"] = prefix
        parts["diffusion"] = [(prefix, DIFFUSERS_ROOTS if layout == "diffusers" else BFL_ROOTS)]
    t5 = None
    if t5_prefix is not None:
        try:
            t5 = t5_config_from_shapes(_shapes_under(t, t5_prefix))
        except ValueError as error:
            raise UnsupportedModelError(f"{t.name}: {error}") from None
    clip_prefixes = sorted(k[: -len("embeddings.token_embedding.weight")] for k in t.entries
                           if k.endswith("embeddings.token_embedding.weight"))
    texts = [_text_config(t, p, "hf") for p in clip_prefixes] if has_flux else []
    text_parts = [(p.removesuffix("text_model."), TEXT_ROOTS) for p in clip_prefixes] if has_flux else []
    if t5_prefix is not None:
        text_parts.append((t5_prefix, T5_ROOTS))
    if text_parts:
        components["te"] = _common_prefix([p for p, _ in text_parts])
        parts["te"] = text_parts
    vae = None
    vae_prefixes = [k[: -len("encoder.down.0.block.0.conv1.weight")] for k in t.entries
                    if k.endswith("encoder.down.0.block.0.conv1.weight")]
    if has_flux and vae_prefixes:
        components["vae"] = vae_prefixes[0]
        parts["vae"] = [(vae_prefixes[0], VAE_ROOTS)]
        vae = _vae_config(t, vae_prefixes[0], "flux")
        vae.scale_factor, vae.shift_factor = FLUX_SCALE_FACTOR, FLUX_SHIFT_FACTOR
    if flux is not None:
        family = "flux_dev" if flux.guidance_embed else "flux_schnell"
    else:
        family = "t5xxl"
    stats, unassigned, examples = _stats(t, parts)
    return ModelInfo(family=family, layout="flux" if flux is not None else "t5xxl", components=components,
                     unet=None, vae=vae, text_encoders=texts, stats=stats, unassigned=unassigned,
                     unassigned_examples=examples, flux=flux, flux_layout=layout, t5=t5, t5_prefix=t5_prefix)

