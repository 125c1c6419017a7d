"""GLIGEN text-box grounding for SD1 (Li et al. 2023, "GLIGEN: Open-Set Grounded Text-to-Image Generation"),
as ComfyUI's comfy/gligen.py and GLIGENTextBoxApply run it.

A GLIGEN file holds a "position net" and one gated self-attention "fuser" per transformer of the UNet it was
trained for (16 for SD1). GLIGENTextBoxApply appends `(pooled, height, width, y, x)` to an entry's
`("position", gligen, [...])` under "gligen": the text's pooled CLIP feature (the end-of-text token of the
last layer, final-normed, unprojected) and the box in latent cells. For a model call on a crop of h x w
cells and batch B, the boxes become xyxy fractions of the crop, padded with zeros to MAX_OBJECTS with a 0/1
mask, and the position net turns them into grounding tokens (B, MAX_OBJECTS, key_dim):

    objs = MLP(concat(mask * text + (1 - mask) * null_text, mask * fourier(xyxy) + (1 - mask) * null_xyxy))

Inside the UNet, after each transformer block's self-attention residual (ComfyUI's "middle_patch"), the
fuser of that transformer (counted over the UNet's transformers in execution order) adds

    x += tanh(alpha_attn) * SelfAttention(LN(concat(x, Linear(objs))))[:, :n_visual]
    x += tanh(alpha_dense) * GEGLU-FF(LN(x))

File keys: `position_net.{null_positive_feature, null_position_feature, linears.{0,2,4}}`, and per fuser
`...{input_blocks,middle_block,output_blocks}.N.....fuser.{linear, attn.to_{q,k,v}, attn.to_out.0, ff.net.0.
proj, ff.net.2, norm1, norm2, alpha_attn, alpha_dense}` (any prefix), named here `fusers.I.<rest>` in that
order. Heads: 8 when the grounding width is 768 (SD1), else 64-wide (ComfyUI's rule); metadata
`sluice.num_heads` overrides. The model is small and is loaded whole on the UNet's compute device (not a
memory-runtime module): its fusers run inside the UNet's stages.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.models.unet import CrossAttention, FeedForward

MAX_OBJECTS = 30  # grounding tokens per call (ComfyUI's max_objs)
FOURIER_FREQUENCIES = 8  # per box coordinate, sin and cos each
FOURIER_TEMPERATURE = 100.0
SD1_KEY_DIM, SD1_HEADS, HEAD_WIDTH = 768, 8, 64
BLOCK_ORDER = ("input_blocks", "middle_block", "output_blocks")
FUSER_KEY = re.compile(r"(?:^|\.)(input_blocks|middle_block|output_blocks)\.(\d+)\..*\.fuser\.(.+)$")
POSITION_PREFIX = "position_net."
_serials = itertools.count()


def fourier_embedding(boxes: torch.Tensor) -> torch.Tensor:
    """xyxy boxes (B, N, 4) -> (B, N, 64): per frequency 100^(k/8), sin then cos of the four coordinates."""
    bands = FOURIER_TEMPERATURE ** (torch.arange(FOURIER_FREQUENCIES) / FOURIER_FREQUENCIES)
    parts = []
    for band in bands:
        parts += [torch.sin(band * boxes), torch.cos(band * boxes)]
    return torch.cat(parts, dim=-1)


class PositionNet(nn.Module):
    """Grounding tokens from text features and boxes, with learned null features for empty slots."""

    def __init__(self, in_dim: int, out_dim: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        position_dim = FOURIER_FREQUENCIES * 2 * 4
        factory = {"dtype": dtype, "device": device}
        self.linears = nn.Sequential(nn.Linear(in_dim + position_dim, 512, **factory), nn.SiLU(),
                                     nn.Linear(512, 512, **factory), nn.SiLU(),
                                     nn.Linear(512, out_dim, **factory))
        self.null_positive_feature = nn.Parameter(torch.empty(in_dim, **factory))
        self.null_position_feature = nn.Parameter(torch.empty(position_dim, **factory))

    def forward(self, boxes: torch.Tensor, masks: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        """boxes (B, N, 4), masks (B, N), texts (B, N, in_dim) -> (B, N, out_dim)."""
        dtype = self.null_positive_feature.dtype
        masks = masks.to(dtype).unsqueeze(-1)  # (B, N, 1)
        texts = texts.to(dtype) * masks + (1 - masks) * self.null_positive_feature.view(1, 1, -1)
        xyxy = fourier_embedding(boxes.float()).to(dtype) * masks + (1 - masks) * self.null_position_feature
        return self.linears(torch.cat([texts, xyxy], dim=-1))


class GatedSelfAttention(nn.Module):
    """One fuser: the visual tokens attend over themselves and the grounding tokens, gated by tanh(alpha)."""

    def __init__(self, query_dim: int, key_dim: int, heads: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        if query_dim % heads:
            raise ValueError(f"a GLIGEN fuser {query_dim} wide does not split into {heads} heads")
        self.linear = nn.Linear(key_dim, query_dim, **factory)
        self.attn = CrossAttention(query_dim, query_dim, heads, query_dim // heads, False, **factory)
        self.ff = FeedForward(query_dim, **factory)
        self.norm1 = nn.LayerNorm(query_dim, **factory)
        self.norm2 = nn.LayerNorm(query_dim, **factory)
        self.alpha_attn = nn.Parameter(torch.empty((), **factory))
        self.alpha_dense = nn.Parameter(torch.empty((), **factory))

    def forward(self, x: torch.Tensor, objs: torch.Tensor) -> torch.Tensor:
        """x (B, n_visual, C), objs (B, N, key_dim) -> x (B, n_visual, C)."""
        visual = x.shape[1]
        tokens = torch.cat([x, self.linear(objs)], dim=1)  # (B, n_visual + N, C)
        x = x + torch.tanh(self.alpha_attn) * self.attn(self.norm1(tokens))[:, :visual]
        return x + torch.tanh(self.alpha_dense) * self.ff(self.norm2(x))


class GLIGENModel(nn.Module):
    """The position net and the fusers, in the UNet's transformer order."""

    def __init__(self, fusers: Sequence[tuple[int, int, int]], text_dim: int, key_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "meta"):
        """`fusers`: (query_dim, key_dim, heads) per transformer; `text_dim`: the pooled text width."""
        super().__init__()
        self.key_dim = key_dim
        self.fusers = nn.ModuleList(GatedSelfAttention(q, k, h, dtype, device) for q, k, h in fusers)
        self.position_net = PositionNet(text_dim, key_dim, dtype, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.position_net.null_positive_feature.dtype

    def objects(self, boxes: Sequence[tuple[torch.Tensor, int, int, int, int]], batch: int, height: int,
                width: int) -> torch.Tensor:
        """Grounding tokens (batch, MAX_OBJECTS, key_dim) for boxes (pooled [1, text_dim], height, width, y, x
        in cells) on a crop of height x width cells (ComfyUI's Gligen.set_position; set_empty for none)."""
        if len(boxes) > MAX_OBJECTS:
            raise ValueError(f"GLIGEN takes at most {MAX_OBJECTS} text boxes per conditioning; "
                             f"got {len(boxes)}")
        device = self.position_net.null_positive_feature.device
        xyxy = torch.zeros(MAX_OBJECTS, 4)
        masks = torch.zeros(MAX_OBJECTS)
        texts = torch.zeros(MAX_OBJECTS, self.position_net.null_positive_feature.shape[0])
        for index, (pooled, box_h, box_w, top, left) in enumerate(boxes):
            xyxy[index] = torch.tensor((left / width, top / height, (left + box_w) / width,
                                        (top + box_h) / height))
            masks[index] = 1.0
            texts[index] = pooled.reshape(-1).float()
        return self.position_net(*(t[None].repeat(batch, *([1] * t.ndim)).to(device)
                                   for t in (xyxy, masks, texts)))


@dataclass(eq=False)
class GLIGEN:
    """A loaded GLIGEN model on its compute device (ComfyUI's GLIGEN)."""

    model: GLIGENModel
    compute_device: str  # Sluice device name
    source: Path | None = None


class MiddlePatch:
    """The fusers with their grounding tokens for one crop shape: `patch(tokens, transformer_index)`, run
    by the UNet after each transformer block's self-attention. `signature` is a plain value that differs
    between patches (it keys captured CUDA graphs, which must not replay another patch's tokens)."""

    def __init__(self, model: GLIGENModel, objs: torch.Tensor):
        self.model, self.objs = model, objs
        self.signature = f"gligen#{next(_serials)}"

    def __call__(self, tokens: torch.Tensor, transformer_index: int) -> torch.Tensor:
        fusers = self.model.fusers
        if transformer_index >= len(fusers):
            raise ValueError(f"this GLIGEN model has {len(fusers)} fusers; the UNet has more transformers "
                             f"(index {transformer_index}): it was made for another UNet")
        out = fusers[transformer_index](tokens.to(self.model.dtype), self.objs.to(tokens.device))
        return out.to(tokens.dtype)


class GLIGENPosition:
    """An entry's "gligen" option as the sampler sees it: ComfyUI's ("position", model, boxes), whose middle
    patch for a crop is made once per crop shape."""

    def __init__(self, gligen: GLIGEN, boxes: Sequence[tuple[torch.Tensor, int, int, int, int]]):
        self.gligen, self.boxes = gligen, list(boxes)
        self._patches: dict[tuple[int, ...], MiddlePatch] = {}

    def middle_patch(self, x: torch.Tensor) -> MiddlePatch:
        """The patch for a model call on x (B, C, h, w)."""
        key = tuple(x.shape)
        if key not in self._patches:
            if self.gligen.model.position_net.null_positive_feature.device != x.device:
                self.gligen.model.to(x.device)  # the fusers run where the UNet does
            batch, _, height, width = x.shape
            with torch.no_grad():
                objs = self.gligen.model.objects(self.boxes, batch, height, width)
            self._patches[key] = MiddlePatch(self.gligen.model, objs)
        return self._patches[key]


def gligen_position(option: Any) -> GLIGENPosition:
    """An entry's "gligen" option, ("position", GLIGEN, boxes), as the sampler's patch source."""
    if not (isinstance(option, tuple) and len(option) == 3 and option[0] == "position"
            and isinstance(option[1], GLIGEN) and isinstance(option[2], list)):
        raise ValueError("a conditioning's gligen option must be ('position', GLIGEN, [(pooled, height, "
                         "width, y, x), ...]) as GLIGENTextBoxApply makes it")
    return GLIGENPosition(option[1], option[2])


# ---------------------------------------------------------------- file layout


def fuser_names(keys: Sequence[str]) -> dict[str, str]:
    """Our parameter name (`fusers.I.<rest>`) -> the file key, fusers numbered in the UNet's transformer
    order (input blocks, middle block, output blocks, each by block number)."""
    found: dict[tuple[int, int], dict[str, str]] = {}
    for key in keys:
        match = FUSER_KEY.search(key)
        if match:
            block = (BLOCK_ORDER.index(match.group(1)), int(match.group(2)))
            found.setdefault(block, {})[match.group(3)] = key
    names = {}
    for index, block in enumerate(sorted(found)):
        names |= {f"fusers.{index}.{rest}": key for rest, key in found[block].items()}
    return names


def gligen_names(keys: Sequence[str]) -> dict[str, str]:
    """Our parameter name -> file key for a whole GLIGEN file; ValueError for a file that is not one."""
    names = fuser_names(keys)
    names |= {key: key for key in keys if key.startswith(POSITION_PREFIX)}
    if not names or f"{POSITION_PREFIX}null_positive_feature" not in names:
        raise ValueError("not a GLIGEN file: it needs position_net.* and the UNet's *.fuser.* tensors; "
                         "accepted: GLIGEN text-box models for SD1 (gligen_sd14_textbox_pruned)")
    return names


def gligen_model(shapes: Mapping[str, tuple[int, ...]], metadata: Mapping[str, str] | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "meta") -> GLIGENModel:
    """The GLIGEN model that our parameter names' shapes describe (heads: module docstring)."""
    metadata = metadata or {}
    fusers = []
    index = 0
    while f"fusers.{index}.linear.weight" in shapes:
        query_dim, key_dim = shapes[f"fusers.{index}.linear.weight"]
        if "sluice.num_heads" in metadata:
            heads = int(metadata["sluice.num_heads"])
        else:
            heads = SD1_HEADS if key_dim == SD1_KEY_DIM else max(1, query_dim // HEAD_WIDTH)
        fusers.append((query_dim, key_dim, heads))
        index += 1
    text_dim = shapes[f"{POSITION_PREFIX}null_positive_feature"][0]
    key_dim = shapes[f"{POSITION_PREFIX}linears.4.weight"][0]
    return GLIGENModel(fusers, text_dim, key_dim, dtype, device)


def load_gligen(path: str | os.PathLike[str], dtype: torch.dtype | str | None = None, device: str = "cpu",
                ) -> GLIGEN:
    """The GLIGEN model of a file on compute device `device` (its weights there: it runs inside the UNet's
    stages). `dtype` None picks the diffusion model's default for the device."""
    from engine.devices import resolve_device
    from engine.models.formats import open_checkpoint
    from engine.models.loader import _cached, _file_key, default_dtype, parse_dtype
    from engine.models.weights import bind_weights

    path, dtype = Path(path), parse_dtype(dtype)
    compute = resolve_device(device)

    def build() -> GLIGEN:
        with open_checkpoint(path) as reader:
            names = gligen_names(reader.keys())
            stored = reader.dtype(names["position_net.linears.0.weight"]) if (
                "position_net.linears.0.weight" in names) else None
            chosen = dtype or default_dtype("diffusion", compute.torch_device, stored)
            model = gligen_model({name: reader.shape(key) for name, key in names.items()}, reader.metadata(),
                                 chosen)
            wanted = dict(model.named_parameters())
            unknown = sorted(set(names) - set(wanted))
            if unknown:
                raise ValueError(f"{path}: GLIGEN tensors this model does not use: {', '.join(unknown[:5])}")
            bind_weights(model, {name: reader.get(names[name]).to(compute.torch_device, parameter.dtype)
                                 for name, parameter in wanted.items()})
        return GLIGEN(model.eval(), compute.name, path)

    return _cached((*_file_key(path), "gligen", dtype, compute.name), build)
