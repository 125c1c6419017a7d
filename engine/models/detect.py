"""Model detection: family, components and configs of SD1.x / SD2.x / SDXL files from tensor names and shapes.

Nothing here reads tensor data (stable-diffusion.cpp's `get_sd_version` approach, reference/003). The rules,
each one from diffusers' `single_file_utils` or the original LDM/SGM configs:

- Components are found by their key suffixes, wherever they sit: `input_blocks.0.0.weight` (UNet, LDM
  layout), `encoder.down.0.block.0.conv1.weight` (LDM VAE), `embeddings.token_embedding.weight` (HF CLIP
  text model) and `token_embedding.weight` (open_clip text tower). The text before the suffix is the
  component's prefix, so single files (`model.diffusion_model.`, `first_stage_model.`, `cond_stage_model.`,
  `conditioner.`) and split files with bare keys are read by the same code.
- UNet: model_channels and in_channels from `input_blocks.0.0.weight`; each input block is a ResBlock (its
  `out_layers.3` width gives the level's channel_mult) or a downsampler (`op`), which starts the next level;
  transformer depth per level = number of `transformer_blocks.N` in the level's first block; context_dim from
  `attn2.to_k.weight`; a 2-D `proj_in.weight` means linear projections; adm_in_channels from `label_emb.0.0`.
- Heads are not in the shapes. As in the LDM configs diffusers reads: conv projections (SD1) mean num_heads=8,
  linear projections (SD2, SDXL) mean num_head_channels=64; where a custom width does not divide, the other
  rule is tried, then one head. Metadata `sluice.num_heads` / `sluice.num_head_channels` override both.
  Text encoders use 64-wide heads (CLIP-L 12, OpenCLIP-H 16, OpenCLIP-bigG 20), one head for other widths.
- Family: the layout (sd1, sd2, sdxl, sdxl_refiner) comes from the text encoders, or without them from the
  UNet (ADM input: SDXL, refiner when adm_in_channels = context_dim + 5*256; linear projections: SD2; else
  SD1).
  The family is the layout when every component present has the canonical size (UNet in_channels aside, so
  inpainting models keep their family), else "sd_custom". A lone VAE is family "vae".
- Prediction: "v" when the file has a `v_pred` or `v_prediction` tensor (ComfyUI's marker) or its metadata
  says so (`prediction_type`, `modelspec.prediction_type` or `sluice.prediction`: v / v_prediction, or
  eps / epsilon); otherwise "eps", except for an SD2.1 unCLIP UNet (sd2 layout with an ADM input), which
  is "v" as ComfyUI's SD21UNCLIP. Without text encoders, an ADM input beside a 1024-wide context is sd2.
  Shapes cannot tell SD2-768-v from SD2-base.
- VAE scale_factor: 0.13025 for SDXL layouts, else 0.18215; metadata `sluice.vae_scale_factor` overrides.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.models.formats import TYPE_NAMES, CheckpointReader

TEXT_ENCODER_KINDS = ("clip_l", "openclip_h", "openclip_g")
FAMILIES = ("sd1", "sd2", "sdxl", "sdxl_refiner", "sd_custom", "vae", "flux_dev", "flux_schnell", "t5xxl")


class UnsupportedModelError(ValueError):
    """A file in which no SD-family component was recognised."""


@dataclass
class UNetConfig:
    in_channels: int  # latent channels in (9 for inpainting)
    out_channels: int
    model_channels: int  # width of the first level
    channel_mult: tuple[int, ...]  # level width = model_channels * mult
    num_res_blocks: int | tuple[int, ...]  # ResBlocks per input level (output levels have one more)
    attention_levels: tuple[int, ...]  # levels whose blocks carry a SpatialTransformer
    transformer_depth: tuple[int, ...]  # transformer blocks per level, 0 = none
    transformer_depth_middle: int
    num_heads: int  # -1 when num_head_channels is used
    num_head_channels: int  # -1 when num_heads is used
    context_dim: int | None  # cross-attention input width (None: no attention at all)
    use_linear_in_transformer: bool  # proj_in/proj_out are Linear (SD2, SDXL) rather than 1x1 Conv (SD1)
    adm_in_channels: int | None  # SDXL 2816, refiner 2560
    num_classes: str | None  # "sequential" when adm_in_channels is set
    prediction: str  # "eps" or "v"
    family: str


@dataclass
class VAEConfig:
    in_channels: int
    out_ch: int
    z_channels: int  # latent channels
    embed_dim: int
    ch: int
    ch_mult: tuple[int, ...]
    num_res_blocks: int
    resolution: int
    attn_resolutions: tuple[int, ...]  # encoder/decoder level attention (the mid block always has one)
    scale_factor: float
    shift_factor: float = 0.0
    use_quant_conv: bool = True  # quant_conv / post_quant_conv 1x1 convolutions (FLUX's VAE has none)


@dataclass
class TextEncoderConfig:
    kind: str  # "clip_l", "openclip_h" or "openclip_g"
    vocab_size: int
    max_positions: int
    width: int  # hidden size
    layers: int
    heads: int
    intermediate: int
    projection_dim: int | None  # None when the file has no text_projection
    activation: str  # "quick_gelu" (CLIP-L) or "gelu" (OpenCLIP)
    key_prefix: str  # e.g. "cond_stage_model.transformer.text_model." or "cond_stage_model.model."
    layout: str = "hf"  # "hf" (text_model.encoder.layers.N...) or "open_clip" (transformer.resblocks.N...)


@dataclass
class ComponentStats:
    tensors: int = 0
    parameters: int = 0
    bytes: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)  # type name -> number of tensors


@dataclass
class ModelInfo:
    family: str  # one of FAMILIES
    layout: str  # the canonical family whose key layout the file follows ("vae" for a lone VAE)
    components: dict[str, str]  # "diffusion" / "te" / "vae" -> key prefix ("" for bare split files)
    unet: UNetConfig | None
    vae: VAEConfig | None
    text_encoders: list[TextEncoderConfig]
    stats: dict[str, ComponentStats]  # per component
    unassigned: ComponentStats  # tensors outside every component (EMA copies, schedule buffers, ...)
    unassigned_examples: list[str]
    flux: Any = None  # FluxConfig of a FLUX transformer (engine/models/detect_flux.py), else None
    flux_layout: str | None = None  # "bfl" (ComfyUI / BFL keys) or "diffusers"
    t5: Any = None  # T5Config of a T5-XXL encoder, else None
    t5_prefix: str | None = None  # the T5 encoder's key prefix (before `encoder.block.`)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- canonical configs

# The UNet presets, from the original configs' yaml files: here beside UNetConfig, so detection compares with
# them (CANONICAL_UNETS) and engine/models/unet.py re-exports them.


def sd15_unet_config() -> UNetConfig:
    """Stable Diffusion 1.x (v1-inference.yaml)."""
    return UNetConfig(in_channels=4, out_channels=4, model_channels=320, channel_mult=(1, 2, 4, 4),
                      num_res_blocks=2, attention_levels=(0, 1, 2), transformer_depth=(1, 1, 1, 0),
                      transformer_depth_middle=1, num_heads=8, num_head_channels=-1, context_dim=768,
                      use_linear_in_transformer=False, adm_in_channels=None, num_classes=None,
                      prediction="eps", family="sd1")


def sd21_unet_config(prediction: str = "v") -> UNetConfig:
    """Stable Diffusion 2.x (v2-inference-v.yaml for "v", v2-inference.yaml for "eps")."""
    if prediction not in ("eps", "v"):
        raise ValueError(f"unknown prediction {prediction!r} for SD2.x; accepted: eps, v")
    return UNetConfig(in_channels=4, out_channels=4, model_channels=320, channel_mult=(1, 2, 4, 4),
                      num_res_blocks=2, attention_levels=(0, 1, 2), transformer_depth=(1, 1, 1, 0),
                      transformer_depth_middle=1, num_heads=-1, num_head_channels=64, context_dim=1024,
                      use_linear_in_transformer=True, adm_in_channels=None, num_classes=None,
                      prediction=prediction, family="sd2")


def sdxl_unet_config() -> UNetConfig:
    """SDXL base 1.0 (sd_xl_base.yaml)."""
    return UNetConfig(in_channels=4, out_channels=4, model_channels=320, channel_mult=(1, 2, 4),
                      num_res_blocks=2, attention_levels=(1, 2), transformer_depth=(0, 2, 10),
                      transformer_depth_middle=10, num_heads=-1, num_head_channels=64, context_dim=2048,
                      use_linear_in_transformer=True, adm_in_channels=2816, num_classes="sequential",
                      prediction="eps", family="sdxl")


def sdxl_refiner_unet_config() -> UNetConfig:
    """SDXL refiner 1.0 (sd_xl_refiner.yaml)."""
    return UNetConfig(in_channels=4, out_channels=4, model_channels=384, channel_mult=(1, 2, 4, 4),
                      num_res_blocks=2, attention_levels=(1, 2), transformer_depth=(0, 4, 4, 0),
                      transformer_depth_middle=4, num_heads=-1, num_head_channels=64, context_dim=1280,
                      use_linear_in_transformer=True, adm_in_channels=2560, num_classes="sequential",
                      prediction="eps", family="sdxl_refiner")


UNET_PRESETS = {"sd1": sd15_unet_config, "sd2": sd21_unet_config, "sdxl": sdxl_unet_config,
                "sdxl_refiner": sdxl_refiner_unet_config}
# The fields a detected UNet must share with its family's preset to be that family's canonical UNet.
CANONICAL_UNET_FIELDS = ("model_channels", "channel_mult", "num_res_blocks", "attention_levels",
                         "transformer_depth", "transformer_depth_middle", "context_dim",
                         "use_linear_in_transformer", "adm_in_channels")
CANONICAL_UNETS: dict[str, dict[str, Any]] = {
    family: {name: getattr(preset(), name) for name in CANONICAL_UNET_FIELDS}
    for family, preset in UNET_PRESETS.items()
}
CANONICAL_TEXT = {"clip_l": (768, 12, 3072), "openclip_h": (1024, 24, 4096), "openclip_g": (1280, 32, 5120)}
CANONICAL_VAE = dict(ch=128, ch_mult=(1, 2, 4, 4), num_res_blocks=2, z_channels=4, embed_dim=4)
CANONICAL_TEXT_SETS = {
    "sd1": ("clip_l",),
    "sd2": ("openclip_h",),
    "sdxl": ("clip_l", "openclip_g"),
    "sdxl_refiner": ("openclip_g",),
}
SD2_UNCLIP_CONTEXT = 1024  # an ADM input beside this context width is SD2.1 unCLIP (sd2 layout)
FOREIGN_MARKERS = {"joint_blocks.": "SD3", "blocks.0.cross_attn.": "Wan/DiT"}

UNET_ROOTS = {"time_embed", "label_emb", "input_blocks", "middle_block", "output_blocks", "out"}
VAE_ROOTS = {"encoder", "decoder", "quant_conv", "post_quant_conv"}
TEXT_ROOTS = {
    "text_model",
    "text_projection",
    "token_embedding",
    "positional_embedding",
    "transformer",
    "ln_final",
    "logit_scale",
}


# ---------------------------------------------------------------- the tensor table


@dataclass(frozen=True)
class _Entry:
    shape: tuple[int, ...]
    type_name: str
    nbytes: int


class _Table:
    """Names, shapes, type names and byte sizes of a file's tensors, plus its metadata."""

    def __init__(self, entries: dict[str, _Entry], metadata: Mapping[str, str], name: str):
        self.entries = entries
        self.metadata = dict(metadata)
        self.name = name

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def shape(self, key: str) -> tuple[int, ...]:
        entry = self.entries.get(key)
        if entry is None:
            raise UnsupportedModelError(
                f"{self.name}: expected tensor '{key}' is missing; the file is incomplete"
            )
        return entry.shape

    def indices(self, prefix: str) -> list[int]:
        """Sorted N of every key `prefix` + "N." ."""
        found = {
            int(m.group(1))
            for k in self.entries
            if k.startswith(prefix) and (m := re.match(r"(\d+)\.", k[len(prefix) :]))
        }
        return sorted(found)

    def first(self, prefix: str, suffix: str) -> str | None:
        return next((k for k in self.entries if k.startswith(prefix) and k.endswith(suffix)), None)


def _as_table(source: Any, metadata: Mapping[str, str] | None) -> _Table:
    if isinstance(source, CheckpointReader):
        entries = {}
        for key in source.keys():
            info = source.info(key)
            entries[key] = _Entry(info.shape, info.type_name, info.nbytes)
        return _Table(entries, {**source.metadata(), **(metadata or {})}, str(source.path))
    if isinstance(source, Mapping):
        entries = {}
        for key, value in source.items():
            if isinstance(value, torch.Tensor):
                entries[key] = _Entry(
                    tuple(value.shape),
                    TYPE_NAMES.get(value.dtype, str(value.dtype)),
                    value.numel() * value.element_size(),
                )
            else:  # a bare shape counts as float32
                shape = tuple(int(d) for d in value)
                entries[key] = _Entry(shape, "F32", 4 * _numel(shape))
        return _Table(entries, metadata or {}, "state dict")
    raise TypeError(
        f"detect() takes a CheckpointReader or a mapping of key -> tensor/shape, not {type(source)}"
    )


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------- component configs


def _unet_config(t: _Table, p: str, encoder_only: bool = False) -> UNetConfig:
    """The UNet config under prefix `p`; `encoder_only` for a ControlNet's copy of the encoder half (no output
    blocks; out_channels is then in_channels)."""
    model_channels, in_channels = t.shape(f"{p}input_blocks.0.0.weight")[:2]
    res_blocks: list[int] = [0]
    widths: list[set[int]] = [set()]
    depths: list[set[int]] = [set()]
    for n in t.indices(f"{p}input_blocks.")[1:]:
        block = f"{p}input_blocks.{n}."
        if f"{block}0.op.weight" in t:
            res_blocks.append(0)
            widths.append(set())
            depths.append(set())
        elif f"{block}0.out_layers.3.weight" in t:
            res_blocks[-1] += 1
            widths[-1].add(t.shape(f"{block}0.out_layers.3.weight")[0])
            depths[-1].add(len(t.indices(f"{block}1.transformer_blocks.")))
        else:
            raise UnsupportedModelError(
                f"{t.name}: input block {block} is neither a ResBlock nor a downsampler"
            )
    for level, (w, d) in enumerate(zip(widths, depths, strict=False)):
        if len(w) != 1 or len(d) != 1 or next(iter(w)) % model_channels:
            raise UnsupportedModelError(
                f"{t.name}: UNet level {level} has block widths {sorted(w)} and transformer depths "
                f"{sorted(d)}; "
                f"one width (a multiple of {model_channels}) and one depth per level are accepted"
            )
    channel_mult = tuple(next(iter(w)) // model_channels for w in widths)
    transformer_depth = tuple(next(iter(d)) for d in depths)
    expected_outputs = sum(r + 1 for r in res_blocks)
    if not encoder_only and len(t.indices(f"{p}output_blocks.")) != expected_outputs:
        raise UnsupportedModelError(
            f"{t.name}: UNet has {len(t.indices(f'{p}output_blocks.'))} output blocks; its input blocks "
            f"({res_blocks} ResBlocks per level) call for {expected_outputs}"
        )
    to_k = t.first(p, "attn2.to_k.weight")
    proj_in = t.first(p, "proj_in.weight")
    use_linear = proj_in is not None and len(t.shape(proj_in)) == 2
    adm = t.shape(f"{p}label_emb.0.0.weight")[1] if f"{p}label_emb.0.0.weight" in t else None
    attention_widths = [
        model_channels * m for m, d in zip(channel_mult, transformer_depth, strict=False) if d
    ]
    num_heads, num_head_channels = _unet_heads(t, use_linear, attention_widths)
    return UNetConfig(
        in_channels=in_channels,
        out_channels=in_channels if encoder_only else t.shape(f"{p}out.2.weight")[0],
        model_channels=model_channels,
        channel_mult=channel_mult,
        num_res_blocks=res_blocks[0] if len(set(res_blocks)) == 1 else tuple(res_blocks),
        attention_levels=tuple(level for level, d in enumerate(transformer_depth) if d),
        transformer_depth=transformer_depth,
        transformer_depth_middle=len(t.indices(f"{p}middle_block.1.transformer_blocks.")),
        num_heads=num_heads,
        num_head_channels=num_head_channels,
        context_dim=t.shape(to_k)[1] if to_k else None,
        use_linear_in_transformer=use_linear,
        adm_in_channels=adm,
        num_classes="sequential" if adm is not None else None,
        prediction=_prediction(t),
        family="",
    )


def _unet_heads(t: _Table, use_linear: bool, widths: list[int]) -> tuple[int, int]:
    """(num_heads, num_head_channels) by the rule in the module docstring."""
    if "sluice.num_heads" in t.metadata:
        return _int_hint(t, "sluice.num_heads"), -1
    if "sluice.num_head_channels" in t.metadata:
        return -1, _int_hint(t, "sluice.num_head_channels")
    by_heads, by_channels = all(w % 8 == 0 for w in widths), all(w % 64 == 0 for w in widths)
    if use_linear and by_channels or not by_heads and by_channels:
        return -1, 64
    return (8, -1) if by_heads else (1, -1)


def _int_hint(t: _Table, key: str) -> int:
    value = t.metadata[key]
    if not value.isdigit() or int(value) == 0:
        raise UnsupportedModelError(f"{t.name}: metadata {key}={value!r}; a positive integer is accepted")
    return int(value)


def _prediction(t: _Table, default: str = "eps") -> str:
    if "v_pred" in t or "v_prediction" in t:
        return "v"
    for key in ("sluice.prediction", "modelspec.prediction_type", "prediction_type"):
        if key in t.metadata:
            value = t.metadata[key].strip().lower()
            if value in ("v", "v_prediction", "v-prediction"):
                return "v"
            if value in ("eps", "epsilon"):
                return "eps"
            raise UnsupportedModelError(
                f"{t.name}: metadata {key}={t.metadata[key]!r}; accepted: v, v_prediction, eps, epsilon"
            )
    return default


def _vae_config(t: _Table, p: str, layout: str) -> VAEConfig:
    ch, in_channels = t.shape(f"{p}encoder.conv_in.weight")[:2]
    levels = t.indices(f"{p}encoder.down.")
    ch_mult = tuple(t.shape(f"{p}encoder.down.{n}.block.0.conv2.weight")[0] // ch for n in levels)
    z_channels = t.shape(f"{p}decoder.conv_in.weight")[1]
    resolution = 256  # the LDM configs' value; shapes do not carry it
    scale = 0.13025 if layout in ("sdxl", "sdxl_refiner") else 0.18215
    if "sluice.vae_scale_factor" in t.metadata:
        scale = float(t.metadata["sluice.vae_scale_factor"])
    return VAEConfig(
        in_channels=in_channels,
        out_ch=t.shape(f"{p}decoder.conv_out.weight")[0],
        z_channels=z_channels,
        embed_dim=t.shape(f"{p}post_quant_conv.weight")[1]
        if f"{p}post_quant_conv.weight" in t
        else z_channels,
        ch=ch,
        ch_mult=ch_mult,
        num_res_blocks=len(t.indices(f"{p}encoder.down.0.block.")),
        resolution=resolution,
        attn_resolutions=tuple(
            resolution >> n for n in levels if t.first(f"{p}encoder.down.{n}.attn.", "weight")
        ),
        scale_factor=scale,
        use_quant_conv=f"{p}quant_conv.weight" in t,
    )


def _text_config(t: _Table, p: str, layout: str) -> TextEncoderConfig:
    if layout == "hf":
        vocab, width = t.shape(f"{p}embeddings.token_embedding.weight")
        positions = t.shape(f"{p}embeddings.position_embedding.weight")[0]
        layers = len(t.indices(f"{p}encoder.layers."))
        intermediate = t.shape(f"{p}encoder.layers.0.mlp.fc1.weight")[0]
        projection_key = f"{p.removesuffix('text_model.')}text_projection.weight"
        projection = t.shape(projection_key)[0] if projection_key in t else None
    else:
        vocab, width = t.shape(f"{p}token_embedding.weight")
        positions = t.shape(f"{p}positional_embedding")[0]
        layers = len(t.indices(f"{p}transformer.resblocks."))
        intermediate = t.shape(f"{p}transformer.resblocks.0.mlp.c_fc.weight")[0]
        projection = t.shape(f"{p}text_projection")[1] if f"{p}text_projection" in t else None
    kind = {768: "clip_l", 1024: "openclip_h", 1280: "openclip_g"}.get(width)
    if kind is None:  # a custom width: the role the file's layout gives it
        kind = (
            "clip_l" if layout == "hf" else ("openclip_g" if p.startswith("conditioner.") else "openclip_h")
        )
    return TextEncoderConfig(
        kind=kind,
        vocab_size=vocab,
        max_positions=positions,
        width=width,
        layers=layers,
        heads=width // 64 if width % 64 == 0 else 1,
        intermediate=intermediate,
        projection_dim=projection,
        activation="quick_gelu" if kind == "clip_l" else "gelu",
        key_prefix=p,
        layout=layout,
    )


# ---------------------------------------------------------------- components, layout, family


def _prefixes(t: _Table, suffix: str, exclude: str | None = None) -> list[str]:
    return sorted(
        k[: -len(suffix)]
        for k in t.entries
        if k.endswith(suffix) and (exclude is None or not k.endswith(exclude))
    )


def _layout(unet: UNetConfig | None, texts: list[TextEncoderConfig]) -> str:
    if texts:
        open_clip = [x for x in texts if x.layout == "open_clip" or x.kind != "clip_l"]
        if len(texts) >= 2:
            return "sdxl"
        if not open_clip:
            return "sd1"
        x = open_clip[0]
        return "sdxl_refiner" if x.key_prefix.startswith("conditioner.") or x.kind == "openclip_g" else "sd2"
    if unet is None:
        return "vae"
    if unet.adm_in_channels is not None and unet.context_dim != SD2_UNCLIP_CONTEXT:
        refiner = unet.context_dim is not None and unet.adm_in_channels == unet.context_dim + 5 * 256
        return "sdxl_refiner" if refiner else "sdxl"
    return "sd2" if unet.use_linear_in_transformer else "sd1"


def _is_canonical(
    layout: str, unet: UNetConfig | None, vae: VAEConfig | None, texts: list[TextEncoderConfig]
) -> bool:
    if layout not in CANONICAL_UNETS:
        return False
    if unet is not None:
        num_res_blocks = unet.num_res_blocks if isinstance(unet.num_res_blocks, int) else -1
        found = {k: getattr(unet, k) for k in CANONICAL_UNETS[layout]} | {"num_res_blocks": num_res_blocks}
        if found != CANONICAL_UNETS[layout] or unet.out_channels != 4:
            return False
    if vae is not None and {k: getattr(vae, k) for k in CANONICAL_VAE} != CANONICAL_VAE:
        return False
    if texts and tuple(x.kind for x in texts) != CANONICAL_TEXT_SETS[layout]:
        return False
    return all((x.width, x.layers, x.intermediate) == CANONICAL_TEXT[x.kind] for x in texts)


def _component_of(key: str, components: dict[str, str]) -> str | None:
    roots = {"diffusion": UNET_ROOTS, "vae": VAE_ROOTS, "te": TEXT_ROOTS}
    for name, prefix in components.items():
        if key.startswith(prefix) and (prefix or key.split(".", 1)[0] in roots[name]):
            return name
    return None


def _stats(
    t: _Table, components: dict[str, str]
) -> tuple[dict[str, ComponentStats], ComponentStats, list[str]]:
    stats = {name: ComponentStats() for name in components}
    unassigned, examples = ComponentStats(), []
    for key, entry in t.entries.items():
        name = _component_of(key, components)
        s = stats[name] if name else unassigned
        if name is None and len(examples) < 5:
            examples.append(key)
        s.tensors += 1
        s.parameters += _numel(entry.shape)
        s.bytes += entry.nbytes
        s.dtypes[entry.type_name] = s.dtypes.get(entry.type_name, 0) + 1
    return stats, unassigned, examples


def _unsupported(t: _Table) -> UnsupportedModelError:
    counts = list(describe_keys(list(t.entries)).items())
    found = ", ".join(f"{prefix} ({n})" for prefix, n in counts[:8]) or "no tensors"
    foreign = next(
        (name for marker, name in FOREIGN_MARKERS.items() if any(marker in k for k in t.entries)), None
    )
    guess = f"; it looks like {foreign}, which is not supported yet" if foreign else ""
    return UnsupportedModelError(
        f"{t.name} holds no SD1.x/SD2.x/SDXL component (UNet, VAE or CLIP/OpenCLIP text encoder in LDM/SGM "
        f"or HF layout); top key prefixes: {found}{guess}"
    )


def detect(
    source: CheckpointReader | Mapping[str, Any], metadata: Mapping[str, str] | None = None
) -> ModelInfo:
    """Family, components and configs of an SD-family file from names and shapes only (see module docstring).

    `source` is an open CheckpointReader or a mapping key -> tensor (meta tensors are fine) or key -> shape;
    `metadata` adds to (and overrides) the file's own metadata.
    """
    t = _as_table(source, metadata)
    from engine.models.detect_flux import detect_flux  # here: it builds on this module's table

    flux_info = detect_flux(t)
    if flux_info is not None:
        return flux_info
    unet_prefixes = [p for p in _prefixes(t, "input_blocks.0.0.weight") if f"{p}out.2.weight" in t]
    vae_prefixes = [
        p for p in _prefixes(t, "encoder.down.0.block.0.conv1.weight") if f"{p}decoder.conv_in.weight" in t
    ]
    hf_prefixes = _prefixes(t, "embeddings.token_embedding.weight")
    open_clip_prefixes = _prefixes(t, "token_embedding.weight", exclude="embeddings.token_embedding.weight")
    foreign = not unet_prefixes and any(marker in k for marker in FOREIGN_MARKERS for k in t.entries)
    if foreign or not (unet_prefixes or vae_prefixes or hf_prefixes or open_clip_prefixes):
        raise _unsupported(t)  # a DiT file's own CLIP or VAE must not pass for an SD component file

    components: dict[str, str] = {}
    unet = None
    if unet_prefixes:
        components["diffusion"] = max(unet_prefixes, key=lambda p: p == "model.diffusion_model.")
        unet = _unet_config(t, components["diffusion"])
    texts = sorted(
        [_text_config(t, p, "hf") for p in hf_prefixes]
        + [_text_config(t, p, "open_clip") for p in open_clip_prefixes],
        key=lambda x: x.key_prefix,
    )
    if texts:
        roots = {x.key_prefix.split(".", 1)[0] for x in texts}
        wrapper = next(iter(roots)) if len(roots) == 1 else ""
        components["te"] = "" if wrapper in TEXT_ROOTS or not wrapper else f"{wrapper}."
    layout = _layout(unet, texts)
    vae = None
    if vae_prefixes:
        components["vae"] = max(vae_prefixes, key=lambda p: p == "first_stage_model.")
        vae = _vae_config(t, components["vae"], layout)
    family = layout if layout == "vae" or _is_canonical(layout, unet, vae, texts) else "sd_custom"
    if unet is not None:
        unet.family = family
        if layout == "sd2" and unet.adm_in_channels is not None:  # SD2.1 unCLIP: v unless the file says
            unet.prediction = _prediction(t, default="v")
    longest_prefix_first = dict(sorted(components.items(), key=lambda item: -len(item[1])))
    stats, unassigned, examples = _stats(t, longest_prefix_first)
    return ModelInfo(
        family=family,
        layout=layout,
        components=components,
        unet=unet,
        vae=vae,
        text_encoders=texts,
        stats=stats,
        unassigned=unassigned,
        unassigned_examples=examples,
    )


def unet_encoder_config(source: CheckpointReader | Mapping[str, Any], prefix: str = "",
                        metadata: Mapping[str, str] | None = None) -> UNetConfig:
    """The UNet config of the encoder half under `prefix` (a ControlNet's copy: embedders, input blocks,
    middle block) by the UNet rules of the module docstring; family is the layout they tell (sd1, sdxl...)."""
    unet = _unet_config(_as_table(source, metadata), prefix, encoder_only=True)
    return dataclasses.replace(unet, family=_layout(unet, []))


def describe_keys(keys: Sequence[str]) -> dict[str, int]:
    """Key counts per two-level prefix (block numbers as N), most common first: what a file holds."""
    counts: dict[str, int] = defaultdict(int)
    for key in keys:
        counts[".".join("N" if part.isdigit() else part for part in key.split(".")[:2])] += 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))
