"""LoRA files (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") and their LyCORIS
relatives, read and matched to our models' parameters.

Layouts read:

- kohya / A1111: `lora_unet_<LDM or diffusers module, dots as underscores>.lora_down.weight`,
  `.lora_up.weight`, `.alpha`; text encoders `lora_te_` (SD1/SD2) or `lora_te1_` / `lora_te2_` (SDXL),
  in transformers' names.
- diffusers / PEFT: `unet.<diffusers module>.lora_A.weight` / `.lora_B.weight` (also `.lora.down/up`,
  `.lora_linear_layer.down/up` and the old attention-processor names), `text_encoder.`, `text_encoder_2.`;
  alpha from the safetensors metadata ("lora_adapter_metadata" or "adapter_config" JSON) when no tensor
  has it.
- LyCORIS: LoCon (convolution LoRA, optionally with a `lora_mid` core), LoHa (`hada_w1_a` ...), LoKr
  (`lokr_w1`, `lokr_w2`, each whole or factorised), full deltas (`diff`, `diff_b`).

A layer's delta is scale * (up @ down) with scale = alpha / rank (alpha / sqrt(rank) for rsLoRA). When nothing
in the file gives alpha, alpha = rank (scale 1) is assumed and logged: reading a PEFT file that keeps
`lora_alpha` only in its metadata without it would run it at the wrong strength (reference/003).
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.jsonfile import JsonInputError, load_json
from engine.models.formats import open_checkpoint
from engine.quant.modules import weight_shape

log = logging.getLogger(__name__)

_SHOWN = 10  # names listed in a log line

# (key suffix, adapter kind, tensor role), tried in order: the generic ".down.weight" comes last.
ROLE_SUFFIXES: tuple[tuple[str, str, str], ...] = (
    (".lora_down.weight", "lora", "down"), (".lora_up.weight", "lora", "up"),
    (".lora_mid.weight", "lora", "mid"),
    (".lora_A.weight", "lora", "down"), (".lora_B.weight", "lora", "up"),
    (".lora_linear_layer.down.weight", "lora", "down"), (".lora_linear_layer.up.weight", "lora", "up"),
    (".lora.down.weight", "lora", "down"), (".lora.up.weight", "lora", "up"),
    (".down.weight", "lora", "down"), (".up.weight", "lora", "up"),
    (".hada_w1_a", "loha", "w1_a"), (".hada_w1_b", "loha", "w1_b"),
    (".hada_w2_a", "loha", "w2_a"), (".hada_w2_b", "loha", "w2_b"),
    (".lokr_w1", "lokr", "w1"), (".lokr_w1_a", "lokr", "w1_a"), (".lokr_w1_b", "lokr", "w1_b"),
    (".lokr_w2", "lokr", "w2"), (".lokr_w2_a", "lokr", "w2_a"), (".lokr_w2_b", "lokr", "w2_b"),
    (".diff", "full", "diff"), (".diff_b", "full", "diff_b"),
    (".alpha", "", "alpha"),
    # Read but not supported: a layer holding one of these is reported, never applied half-way.
    (".hada_t1", "unsupported", "hada_t1"), (".hada_t2", "unsupported", "hada_t2"),
    (".lokr_t2", "unsupported", "lokr_t2"), (".dora_scale", "unsupported", "dora_scale"),
)
REQUIRED_ROLES = {"lora": ({"down", "up"}, {"down", "mid", "up"}),
                  "loha": ({"w1_a", "w1_b", "w2_a", "w2_b"},),
                  "lokr": ({"w1", "w2"}, {"w1_a", "w1_b", "w2"}, {"w1", "w2_a", "w2_b"},
                           {"w1_a", "w1_b", "w2_a", "w2_b"}),
                  "full": ({"diff"}, {"diff_b"}, {"diff", "diff_b"})}
PEFT_ADAPTER_NAME = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")  # "lora_A.default.weight" -> "lora_A.weight"
ATTENTION_PROCESSOR = re.compile(r"\.processor\.(to_[qkv]|to_out)_lora$")  # old diffusers attn processors
METADATA_CONFIG_KEYS = ("lora_adapter_metadata", "adapter_config")
COMPONENT_PREFIXES = ("unet", "text_encoder", "text_encoder_2", "transformer")


class LoraFormatError(ValueError):
    """A LoRA file that cannot be read as any of the layouts above."""


@dataclass(frozen=True)
class LoraLayer:
    """One adapted layer as the file stores it: its tensors by role, alpha and rank."""

    name: str  # the file's layer name: its keys without the role suffix
    kind: str  # "lora", "loha", "lokr" or "full"
    tensors: Mapping[str, torch.Tensor]  # role -> tensor as stored
    alpha: float | None  # None where the kind has no rank to divide by (full deltas, whole LoKr factors)
    rank: int | None
    rank_scaling: str = "linear"  # "linear": alpha / rank; "sqrt": alpha / sqrt(rank) (rsLoRA)
    keys: tuple[str, ...] = ()  # the file keys it was read from

    @property
    def scale(self) -> float:
        if self.alpha is None or not self.rank:
            return 1.0
        return self.alpha / (math.sqrt(self.rank) if self.rank_scaling == "sqrt" else self.rank)

    @property
    def has_weight_delta(self) -> bool:
        return self.kind != "full" or "diff" in self.tensors

    def weight_delta_numel(self) -> int:
        """How many elements the weight delta has, from the tensor shapes alone."""
        t = self.tensors
        if self.kind == "lora":
            return t["up"].shape[0] * math.prod(t["down"].shape[1:]) * (
                math.prod(t["mid"].shape[2:]) if "mid" in t else 1)
        if self.kind == "loha":
            return t["w1_a"].shape[0] * t["w1_b"].shape[1]
        if self.kind == "lokr":
            w1, w2 = _lokr_factor_shape(t, "w1"), _lokr_factor_shape(t, "w2")
            return math.prod(w1) * math.prod(w2)
        return t["diff"].numel() if "diff" in t else 0

    def weight_delta(self, shape: Sequence[int]) -> torch.Tensor:
        """scale * the layer's weight update as a float32 tensor of `shape` (the adapted weight's shape)."""
        t = {role: tensor.float() for role, tensor in self.tensors.items()}
        if self.kind == "lora":
            up, down = t["up"].flatten(1), t["down"]  # up (out, r), down (r, in[, kh, kw])
            if "mid" in t:  # LoCon's Tucker core: mid (r, r, kh, kw) between 1x1 down and up
                core = torch.einsum("ijhw,jk->ikhw", t["mid"], down.flatten(1))  # (r, in, kh, kw)
                delta = (up @ core.flatten(1)).reshape(up.shape[0], down.shape[1], *t["mid"].shape[2:])
            else:
                delta = up @ down.flatten(1)  # (out, in * kh * kw)
        elif self.kind == "loha":  # Hyeon-Woo et al. 2022, FedPara: (w1a @ w1b) * (w2a @ w2b)
            delta = (t["w1_a"] @ t["w1_b"]) * (t["w2_a"] @ t["w2_b"])
        elif self.kind == "lokr":  # Yeh et al. 2024, LyCORIS: kron(w1, w2)
            w1 = t["w1"] if "w1" in t else t["w1_a"] @ t["w1_b"]
            w2 = t["w2"] if "w2" in t else t["w2_a"] @ t["w2_b"]
            if w2.ndim == 4:  # a convolution: w1 (o1, i1) spreads over w2 (o2, i2, kh, kw)
                w1 = w1[:, :, None, None]
            delta = torch.kron(w1, w2)
        else:
            delta = t["diff"]
        return (delta * self.scale).reshape(tuple(shape))

    def bias_delta(self) -> torch.Tensor | None:
        return self.tensors["diff_b"].float() * self.scale if "diff_b" in self.tensors else None


def _lokr_factor_shape(t: Mapping[str, torch.Tensor], factor: str) -> tuple[int, ...]:
    if factor in t:
        return tuple(t[factor].shape)
    return (t[f"{factor}_a"].shape[0], *t[f"{factor}_b"].shape[1:])


@dataclass
class LoraFile:
    """The parsed layers of one LoRA file, before matching them to a model."""

    name: str
    layers: dict[str, LoraLayer]
    unreadable: dict[str, str] = field(default_factory=dict)  # file key -> why it is not read
    assumed_alpha: list[str] = field(default_factory=list)  # layers given alpha = rank for want of a value
    metadata: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- reading


def read_lora(path: str | os.PathLike[str]) -> LoraFile:
    """Parse a LoRA file (safetensors, torch zip or GGUF: formats.open_checkpoint)."""
    path = Path(path)
    with open_checkpoint(path) as reader:
        tensors = {key: reader.get(key) for key in reader.keys()}
        metadata = reader.metadata()
    return parse_lora(tensors, metadata, path.name)


def parse_lora(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None,
               name: str = "lora") -> LoraFile:
    """Group `tensors` into layers by key suffix and give each its alpha: the `.alpha` tensor, else the
    metadata's PEFT config (lora_alpha, alpha_pattern, use_rslora), else kohya's ss_network_alpha, else
    the rank."""
    metadata = dict(metadata or {})
    groups: dict[str, dict[str, tuple[str, str, torch.Tensor]]] = {}  # layer -> role -> (kind, key, tensor)
    unreadable: dict[str, str] = {}
    for key, tensor in tensors.items():
        normal = PEFT_ADAPTER_NAME.sub(r".\1.weight", key)
        match = next(((s, kind, role) for s, kind, role in ROLE_SUFFIXES if normal.endswith(s)), None)
        if match is None:
            unreadable[key] = "unknown tensor role"
            continue
        suffix, kind, role = match
        layer = ATTENTION_PROCESSOR.sub(lambda m: "." + (m[1] if m[1] != "to_out" else "to_out.0"),
                                        normal[: -len(suffix)])
        groups.setdefault(layer, {})[role] = (kind, key, tensor)

    configs = _peft_configs(metadata)
    kohya_alpha = _float_or_none(metadata.get("ss_network_alpha"))
    layers: dict[str, LoraLayer] = {}
    assumed: list[str] = []
    for layer_name, roles in groups.items():
        keys = tuple(key for _, key, _ in roles.values())
        kinds = {kind for kind, _, _ in roles.values() if kind}
        if "unsupported" in kinds:
            odd = sorted(role for role, (kind, _, _) in roles.items() if kind == "unsupported")
            unreadable.update({key: f"unsupported tensor role {', '.join(odd)}" for key in keys})
            continue
        if len(kinds) != 1:
            why = "only an alpha" if not kinds else f"mixed adapter kinds {sorted(kinds)}"
            unreadable.update({key: why for key in keys})
            continue
        kind = kinds.pop()
        found = set(roles) - {"alpha"}
        if found not in REQUIRED_ROLES[kind]:
            why = f"incomplete {kind} layer (has {', '.join(sorted(found))})"
            unreadable.update({key: why for key in keys})
            continue
        layer_tensors = {role: tensor for role, (_, _, tensor) in roles.items() if role != "alpha"}
        rank = _rank(kind, layer_tensors)
        alpha: float | None = None
        scaling = "linear"
        if rank is not None:
            if "alpha" in roles:
                alpha = float(roles["alpha"][2].float().item())
            else:
                alpha, scaling = _metadata_alpha(layer_name, configs, kohya_alpha)
                if alpha is None:
                    alpha = float(rank)
                    assumed.append(layer_name)
        layers[layer_name] = LoraLayer(layer_name, kind, layer_tensors, alpha, rank, scaling, keys)
    if assumed:
        log.warning("LoRA %s: %d layer(s) have no alpha (no .alpha tensor, no lora_alpha in the metadata); "
                    "assuming alpha = rank (scale 1.0): %s", name, len(assumed), _listing(assumed))
    if not layers:
        raise LoraFormatError(f"LoRA {name!r} holds no adapter layers that this engine reads "
                              f"({len(tensors)} tensors; e.g. {_listing(sorted(tensors))}); accepted: kohya "
                              f"lora_down/lora_up, PEFT lora_A/lora_B, LoHa hada_*, LoKr lokr_*, diff")
    return LoraFile(name, layers, unreadable, assumed, metadata)


def _rank(kind: str, tensors: Mapping[str, torch.Tensor]) -> int | None:
    if kind == "lora":
        return int(tensors["down"].shape[0])
    if kind == "loha":
        return int(tensors["w1_b"].shape[0])
    if kind == "lokr":  # alpha scales a LoKr only when one of its factors is itself low-rank
        for role in ("w1_b", "w2_b"):
            if role in tensors:
                return int(tensors[role].shape[0])
    return None


def _float_or_none(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _peft_configs(metadata: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """PEFT LoraConfig dicts from the metadata, by component prefix ("" for a config of the whole file).

    diffusers packs the configs of a pipeline's models as {"unet.lora_alpha": 8, "text_encoder.r": 4, ...};
    a single model's adapter stores {"lora_alpha": 8, "r": 4, ...}.
    """
    configs: dict[str, dict[str, Any]] = {}
    for meta_key in METADATA_CONFIG_KEYS:
        raw = metadata.get(meta_key)
        if not raw:
            continue
        try:
            config = load_json(raw, "the value")
        except JsonInputError as error:
            raise LoraFormatError(f"LoRA metadata {meta_key!r} is not valid JSON: {error}") from None
        if not isinstance(config, dict):
            raise LoraFormatError(f"LoRA metadata {meta_key!r} is not a JSON object: {raw[:80]!r}")
        for key, value in config.items():
            head, _, rest = key.partition(".")
            if rest and head in COMPONENT_PREFIXES:
                configs.setdefault(head, {})[rest] = value
            else:
                configs.setdefault("", {})[key] = value
    return configs


def _metadata_alpha(layer: str, configs: Mapping[str, dict[str, Any]], kohya_alpha: float | None,
                    ) -> tuple[float | None, str]:
    head, _, module = layer.partition(".")
    config = configs.get(head) if head in COMPONENT_PREFIXES else None
    if config is None:
        config, module = configs.get("", {}), (module if head in COMPONENT_PREFIXES else layer)
    scaling = "sqrt" if config.get("use_rslora") else "linear"
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if module == pattern or module.endswith("." + pattern):
            return float(value), scaling
    if config.get("lora_alpha") is not None:
        return float(config["lora_alpha"]), scaling
    return kohya_alpha, "linear"


def _listing(names: Sequence[str]) -> str:
    more = f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


# ---------------------------------------------------------------------------------------------- matching


@dataclass(frozen=True)
class LoraTarget:
    """Where a layer's update lands: a module of the UNet or of one text encoder, and its parameters."""

    component: str  # "unet" or "te"
    encoder: int  # index into TextEncoder.encoders (0 for the UNet)
    module: str  # the module's name in our model
    weight: str = "weight"  # the parameter the weight delta adds to
    bias: str = "bias"
    rows: tuple[int, int] | None = None  # the rows of a fused parameter (open_clip's q, k, v in in_proj)

    @property
    def weight_name(self) -> str:
        return f"{self.module}.{self.weight}"


@dataclass
class LoraMatch:
    """A LoRA file matched to models: (target, layer) pairs and the file keys that matched nothing."""

    lora: LoraFile
    patches: list[tuple[LoraTarget, LoraLayer]]
    unmatched: dict[str, str]  # file key -> why it is not applied

    def for_module(self, component: str, encoder: int = 0) -> list[tuple[LoraTarget, LoraLayer]]:
        return [(t, layer) for t, layer in self.patches if t.component == component and t.encoder == encoder]


RESNET_TO_DIFFUSERS = {"in_layers.0": "norm1", "in_layers.2": "conv1", "out_layers.0": "norm2",
                       "out_layers.3": "conv2", "emb_layers.1": "time_emb_proj",
                       "skip_connection": "conv_shortcut"}
FIXED_TO_DIFFUSERS = {"time_embed.0": "time_embedding.linear_1", "time_embed.2": "time_embedding.linear_2",
                      "label_emb.0.0": "add_embedding.linear_1", "label_emb.0.2": "add_embedding.linear_2",
                      "input_blocks.0.0": "conv_in", "out.0": "conv_norm_out", "out.2": "conv_out"}


def diffusers_unet_blocks(unet: nn.Module) -> dict[str, tuple[str, bool]]:
    """LDM block prefix -> (diffusers prefix, is a ResBlock) for `unet`: diffusers'
    convert_ldm_unet_checkpoint read backwards. input_blocks.n.0 = down_blocks.i.resnets.j and
    input_blocks.n.1 = down_blocks.i.attentions.j with n = 1 + (res_blocks + 1) * i + j; the output blocks
    likewise over up_blocks, which run through the levels in reverse order."""
    from engine.models.unet import ResBlock, SpatialTransformer, Upsample

    blocks = {ldm: (diffusers, False) for ldm, diffusers in FIXED_TO_DIFFUSERS.items()}

    def add(ldm: str, block: nn.Module, diffusers_block: str, j: int) -> None:
        for index, layer in enumerate(block):
            if isinstance(layer, ResBlock):
                blocks[f"{ldm}.{index}"] = (f"{diffusers_block}.resnets.{j}", True)
            elif isinstance(layer, SpatialTransformer):
                blocks[f"{ldm}.{index}"] = (f"{diffusers_block}.attentions.{j}", False)
            elif isinstance(layer, Upsample):
                blocks[f"{ldm}.{index}.conv"] = (f"{diffusers_block}.upsamplers.0.conv", False)

    level, j = 0, 0
    for n, block in enumerate(unet.input_blocks):
        if n == 0:
            continue
        if hasattr(block[0], "op"):  # a Downsample ends the level
            blocks[f"input_blocks.{n}.0.op"] = (f"down_blocks.{level}.downsamplers.0.conv", False)
            level, j = level + 1, 0
            continue
        add(f"input_blocks.{n}", block, f"down_blocks.{level}", j)
        j += 1
    resnets = 0
    for index, layer in enumerate(unet.middle_block):
        if isinstance(layer, ResBlock):
            blocks[f"middle_block.{index}"] = (f"mid_block.resnets.{resnets}", True)
            resnets += 1
        else:
            blocks[f"middle_block.{index}"] = ("mid_block.attentions.0", False)
    levels = len(unet.config.channel_mult)
    res_blocks = unet.config.num_res_blocks
    per_level = (res_blocks,) * levels if isinstance(res_blocks, int) else tuple(res_blocks)
    n = 0
    for up, level in enumerate(reversed(range(levels))):
        for j in range(per_level[level] + 1):
            add(f"output_blocks.{n}", unet.output_blocks[n], f"up_blocks.{up}", j)
            n += 1
    return blocks


def diffusers_unet_names(unet: nn.Module) -> dict[str, str]:
    """Our (LDM) module name -> its diffusers name, for every module of `unet` that has a weight."""
    blocks = diffusers_unet_blocks(unet)
    names = {}
    for name in _weighted_modules(unet):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            prefix = ".".join(parts[:cut])
            if prefix in blocks:
                diffusers, is_resnet = blocks[prefix]
                rest = ".".join(parts[cut:])
                if is_resnet:
                    rest = RESNET_TO_DIFFUSERS.get(rest, "")
                    if not rest:
                        break
                names[name] = f"{diffusers}.{rest}" if rest else diffusers
                break
    return names


def _weighted_modules(module: nn.Module) -> list[str]:
    return [name for name, sub in module.named_modules()
            if name and sub._parameters.get("weight") is not None]


def unet_aliases(unet: nn.Module) -> dict[str, LoraTarget]:
    """Every layer name a LoRA file may use for a UNet module: kohya (LDM or diffusers names with
    underscores), LDM dotted names (`diffusion_model.`), diffusers / PEFT dotted names (`unet.`, bare,
    `base_model.model.`)."""
    aliases: dict[str, LoraTarget] = {}
    diffusers = diffusers_unet_names(unet)
    for name in _weighted_modules(unet):
        target = LoraTarget("unet", 0, name)
        for ldm in ("lora_unet_" + name.replace(".", "_"), "diffusion_model." + name,
                    "model.diffusion_model." + name):
            aliases[ldm] = target
        if name in diffusers:
            d = diffusers[name]
            for alias in ("lora_unet_" + d.replace(".", "_"), "unet." + d, d, "base_model.model." + d):
                aliases[alias] = target
    return aliases


def hf_text_targets(encoder: nn.Module, index: int) -> dict[str, LoraTarget]:
    """transformers' CLIP module name -> target in `encoder`, whichever key layout it uses; open_clip's fused
    in_proj takes q, k and v as row slices [0, W), [W, 2W), [2W, 3W)."""
    if encoder.layout == "hf":
        return {name: LoraTarget("te", index, name) for name in _weighted_modules(encoder)}
    width = encoder.config.width
    targets = {"text_model.embeddings.token_embedding": LoraTarget("te", index, "token_embedding"),
               "text_model.final_layer_norm": LoraTarget("te", index, "ln_final")}
    for n in range(encoder.config.layers):
        hf, ours = f"text_model.encoder.layers.{n}", f"transformer.resblocks.{n}"
        for slot, projection in enumerate(("q_proj", "k_proj", "v_proj")):
            rows = (slot * width, (slot + 1) * width)
            targets[f"{hf}.self_attn.{projection}"] = LoraTarget(
                "te", index, f"{ours}.attn", "in_proj_weight", "in_proj_bias", rows)
        for theirs, mine in (("self_attn.out_proj", "attn.out_proj"), ("mlp.fc1", "mlp.c_fc"),
                             ("mlp.fc2", "mlp.c_proj"), ("layer_norm1", "ln_1"), ("layer_norm2", "ln_2")):
            targets[f"{hf}.{theirs}"] = LoraTarget("te", index, f"{ours}.{mine}")
    return targets


def text_aliases(encoders: Sequence[nn.Module]) -> dict[str, LoraTarget]:
    """Every layer name a LoRA file may use for the text encoders: kohya `lora_te_` (one encoder) or
    `lora_te1_` / `lora_te2_` (SDXL), diffusers `text_encoder.` / `text_encoder_2.`."""
    aliases: dict[str, LoraTarget] = {}
    for index, encoder in enumerate(encoders):
        kohya = ("lora_te_", "lora_te1_") if len(encoders) == 1 else (f"lora_te{index + 1}_",)
        dotted = "text_encoder." if index == 0 else f"text_encoder_{index + 1}."
        named = hf_text_targets(encoder, index)
        if encoder.layout == "open_clip":  # our own names too, for files written against open_clip
            named.update({name: LoraTarget("te", index, name) for name in _weighted_modules(encoder)})
        for name, target in named.items():
            for prefix in kohya:
                aliases[prefix + name.replace(".", "_")] = target
            aliases[dotted + name] = target
    return aliases


def match_lora(lora: LoraFile, unet: nn.Module | None = None, encoders: Sequence[nn.Module] = (),
               ) -> LoraMatch:
    """Match `lora`'s layers to `unet` and `encoders`; what matches nothing (or does not fit) is listed and
    logged, never silently dropped."""
    aliases = {**(unet_aliases(unet) if unet is not None else {}), **text_aliases(encoders)}
    modules = {"unet": [unet], "te": list(encoders)}
    patches: list[tuple[LoraTarget, LoraLayer]] = []
    unmatched = dict(lora.unreadable)
    for name, layer in lora.layers.items():
        target = aliases.get(name)
        if target is None:
            unmatched.update({key: "no such layer in the given models" for key in layer.keys})
            continue
        module = modules[target.component][target.encoder].get_submodule(target.module)
        problem = _fit_problem(module, target, layer)
        if problem:
            unmatched.update({key: problem for key in layer.keys})
            continue
        patches.append((target, layer))
    if unmatched:
        log.warning("LoRA %s: %d key(s) not applied: %s", lora.name, len(unmatched),
                    _listing([f"{key} ({why})" for key, why in unmatched.items()]))
    return LoraMatch(lora, patches, unmatched)


def _fit_problem(module: nn.Module, target: LoraTarget, layer: LoraLayer) -> str | None:
    shape = weight_shape(module, target.weight)  # a quantised layer's logical shape, not its bytes'
    if layer.has_weight_delta:
        rows = shape[0] if target.rows is None else target.rows[1] - target.rows[0]
        expected = rows * math.prod(shape[1:])
        if layer.weight_delta_numel() != expected:
            return (f"shape mismatch: the update has {layer.weight_delta_numel()} elements, "
                    f"{target.weight_name} {(rows, *shape[1:])} has {expected}")
    if "diff_b" in layer.tensors:
        bias = module._parameters.get(target.bias)
        size = None
        if bias is not None:
            size = bias.shape[0] if target.rows is None else target.rows[1] - target.rows[0]
        if size != layer.tensors["diff_b"].numel():
            return f"bias delta of {layer.tensors['diff_b'].numel()} for a layer with bias size {size}"
    return None
