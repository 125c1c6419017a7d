"""T2I-Adapter (Mou et al. 2023): a small convolutional network that turns a hint image into one feature map
per UNet level, added to the UNet's encoder (ComfyUI's "input" control).

Three layouts, with the parameter names of the TencentARC files that ComfyUI loads:
- "full" (SD1.x / SD2.x): PixelUnshuffle(8), `conv_in`, then `body.N` ResnetBlocks (`blocks_per_level` per
  level, four levels); the first block of levels 1-3 halves the resolution (2x2 average pooling, or the
  strided convolution `down_opt.op`) and a block whose width changes starts with a 1x1 `in_conv`.
- "full_xl" (SDXL): the same with PixelUnshuffle(16), level 1 widening without downsampling and level 2
  halving the resolution (diffusers' FullAdapterXL).
- "light": PixelUnshuffle(8) and one extractor per level (`body.L.in_conv`, light ResnetBlocks
  `body.L.body.M`, `body.L.out_conv`), levels 1-3 pooled first.
Files in the diffusers layout (`adapter.conv_in`, `adapter.body.L.resnets.M.*`) are read through
`diffusers_names`. The config comes from shapes alone (`t2i_adapter_config`), with ComfyUI's rule for SDXL:
an unshuffled input width of 256 or 768 (1 or 3 hint channels at PixelUnshuffle(16)).

Stages: "conv_in" (unshuffle and, for full adapters, the first convolution), then "body.L" per level. The
state holds "x" and "features" (each level's output). `forward` returns ComfyUI's control dict: the
features under "input", one entry per UNet input block (None where nothing is added) and in the order the
UNet consumes them from the list's end; the SDXL adapter's last level goes under "middle".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.detect import UnsupportedModelError
from engine.models.staged import Stage, StagedModel, State, run_stages

KINDS = ("full", "full_xl", "light")
LEVELS = 4
XL_UNSHUFFLED_WIDTHS = (256, 768)  # ComfyUI's SDXL rule: 1 or 3 hint channels * 16 * 16
DIFFUSERS_MARKER = "adapter.body.0.resnets.0.block1.weight"


@dataclass(frozen=True)
class T2IAdapterConfig:
    kind: str  # "full" (SD1.x/SD2.x), "full_xl" (SDXL) or "light"
    in_channels: int  # channels of the hint image (1 or 3)
    channels: tuple[int, ...]  # width of each level's feature map (four levels)
    blocks_per_level: int  # ResnetBlocks (full) or light blocks per extractor (light) of each level
    kernel_size: int = 1  # full: kernel of `in_conv` and `block2` (1 in the released adapters)
    conv_downsample: bool = False  # full: a strided 3x3 convolution downsamples instead of average pooling

    @property
    def unshuffle(self) -> int:
        """Hint pixels per side folded into channels: 16 for SDXL, 8 otherwise."""
        return 16 if self.kind == "full_xl" else 8


def average_pool(x: torch.Tensor) -> torch.Tensor:
    """2x2 average pooling that pads an odd side by one (counted as zero), as the TencentARC Downsample."""
    return F.avg_pool2d(x, 2, 2, padding=(x.shape[2] % 2, x.shape[3] % 2))


class Downsample(nn.Module):
    """Halve the resolution: a strided 3x3 convolution `op`, or (conv False) average pooling."""

    def __init__(self, channels: int, conv: bool, **factory):
        super().__init__()
        self.op = nn.Conv2d(channels, channels, 3, stride=2, padding=1, **factory) if conv else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return average_pool(x) if self.op is None else self.op(x)


class ResnetBlock(nn.Module):
    """[downsample], [1x1 in_conv when the width changes], then x + block2(relu(block1(x)))."""

    def __init__(self, in_channels: int, out_channels: int, down: bool, kernel_size: int,
                 conv_downsample: bool, **factory):
        super().__init__()
        padding = kernel_size // 2
        self.down_opt = Downsample(in_channels, conv_downsample, **factory) if down else None
        self.in_conv = (nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding, **factory)
                        if in_channels != out_channels else None)
        self.block1 = nn.Conv2d(out_channels, out_channels, 3, padding=1, **factory)
        self.act = nn.ReLU()
        self.block2 = nn.Conv2d(out_channels, out_channels, kernel_size, padding=padding, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.down_opt is not None:
            x = self.down_opt(x)
        if self.in_conv is not None:
            x = self.in_conv(x)
        return x + self.block2(self.act(self.block1(x)))


class LightResnetBlock(nn.Module):
    def __init__(self, channels: int, **factory):
        super().__init__()
        self.block1 = nn.Conv2d(channels, channels, 3, padding=1, **factory)
        self.act = nn.ReLU()
        self.block2 = nn.Conv2d(channels, channels, 3, padding=1, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block2(self.act(self.block1(x)))


class Extractor(nn.Module):
    """The light adapter's level: [average pooling], 1x1 in_conv to a quarter width, light blocks, 1x1 out."""

    def __init__(self, in_channels: int, inner: int, out_channels: int, blocks: int, down: bool, **factory):
        super().__init__()
        self.down = down
        self.in_conv = nn.Conv2d(in_channels, inner, 1, **factory)
        self.body = nn.Sequential(*(LightResnetBlock(inner, **factory) for _ in range(blocks)))
        self.out_conv = nn.Conv2d(inner, out_channels, 1, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.down:
            x = average_pool(x)
        return self.out_conv(self.body(self.in_conv(x)))


class T2IAdapterModel(StagedModel):
    """forward(hint) -> ComfyUI's control dict {"input": [...], "middle": [...]} of the adapter's features."""

    def __init__(self, config: T2IAdapterConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "meta"):
        super().__init__()
        if config.kind not in KINDS:
            raise ValueError(f"unknown T2I-Adapter kind {config.kind!r}; accepted: {', '.join(KINDS)}")
        if len(config.channels) != LEVELS:
            raise ValueError(f"a T2I-Adapter has {LEVELS} levels; got channels {config.channels}")
        self.config = config
        self.dtype = dtype
        factory = {"dtype": dtype, "device": device}
        unshuffled = config.in_channels * config.unshuffle ** 2
        channels = config.channels
        self.conv_in: nn.Conv2d | None = None
        if config.kind == "light":
            self.body = nn.ModuleList(
                Extractor(unshuffled if level == 0 else channels[level - 1], channels[level] // 4,
                          channels[level], config.blocks_per_level, down=level > 0, **factory)
                for level in range(LEVELS))
        else:
            self.conv_in = nn.Conv2d(unshuffled, channels[0], 3, padding=1, **factory)
            downsampling_levels = (2,) if config.kind == "full_xl" else (1, 2, 3)
            blocks = []
            for level in range(LEVELS):
                for index in range(config.blocks_per_level):
                    first = index == 0 and level > 0
                    width_in = channels[level - 1] if first else channels[level]
                    down = first and level in downsampling_levels
                    blocks.append(ResnetBlock(width_in, channels[level], down, config.kernel_size,
                                              config.conv_downsample, **factory))
            self.body = nn.ModuleList(blocks)

    @property
    def hint_downscale(self) -> int:
        """Hint pixels per latent cell along each side, before rounding up to the unshuffle factor."""
        return 8

    def initial_state(self, hint: torch.Tensor) -> State:
        """The first stage's state from the hint (B, in_channels, H, W), H and W multiples of the unshuffle
        factor."""
        factor = self.config.unshuffle
        if hint.ndim != 4 or hint.shape[1] != self.config.in_channels or hint.shape[2] % factor or \
                hint.shape[3] % factor:
            raise ValueError(f"T2I-Adapter hint of shape {tuple(hint.shape)}; expected (B, "
                             f"{self.config.in_channels}, H, W) with H and W multiples of {factor}")
        return {"x": hint.to(self.dtype), "features": []}

    def _build_stages(self) -> list[Stage]:
        stages = [Stage("conv_in", () if self.conv_in is None else (self.conv_in,), self._conv_in)]
        per_level = 1 if self.config.kind == "light" else self.config.blocks_per_level
        for level in range(LEVELS):
            blocks = tuple(self.body[level * per_level:(level + 1) * per_level])
            stages.append(Stage(f"body.{level}", blocks, _level_runner(blocks)))
        return stages

    def forward(self, hint: torch.Tensor) -> dict[str, list[torch.Tensor | None]]:
        return self.control_outputs(run_stages(self.stages(), self.initial_state(hint)))

    def feature_blocks(self) -> list[tuple[int | str, int]]:
        """(UNet input block index, or "middle"; width) of each level's features, as control_outputs places
        them."""
        if self.config.kind == "full_xl":
            return list(zip((3, 5, 8, "middle"), self.config.channels, strict=True))
        return list(zip((2, 5, 8, 11), self.config.channels, strict=True))

    def control_outputs(self, state: State) -> dict[str, list[torch.Tensor | None]]:
        """The features placed as ComfyUI places them: for SD1.x/SD2.x after the last ResBlock of each UNet
        level (input blocks 2, 5, 8, 11); for SDXL after input blocks 3, 5 and 8 and the middle block."""
        padded: list[torch.Tensor | None] = []
        for level, feature in enumerate(state["features"]):
            if self.config.kind != "full_xl":
                padded += [None, None]
            else:
                padded += [None] * {0: 3, 2: 2}.get(level, 1)
            padded.append(feature)
        padded.reverse()
        if self.config.kind == "full_xl":
            return {"input": padded[1:], "middle": padded[:1]}
        return {"input": padded}

    def _conv_in(self, state: State) -> State:
        x = F.pixel_unshuffle(state["x"], self.config.unshuffle)  # (B, C * f * f, H / f, W / f)
        state["x"] = x if self.conv_in is None else self.conv_in(x)
        return state


def _level_runner(blocks: tuple[nn.Module, ...]) -> Any:
    def run(state: State) -> State:
        x = state["x"]
        for block in blocks:
            x = block(x)
        state["x"] = x
        state["features"].append(x)
        return state
    return run


# ---------------------------------------------------------------------------------------------- detection


def is_t2i_adapter(keys: Iterable[str]) -> bool:
    keys = set(keys)
    full = "conv_in.weight" in keys and "body.0.block1.weight" in keys
    return full or "body.0.in_conv.weight" in keys or DIFFUSERS_MARKER in keys


def t2i_adapter_config(shapes: Mapping[str, tuple[int, ...]]) -> T2IAdapterConfig:
    """The config of a T2I-Adapter from the shapes of its tensors (our names)."""
    levels = sorted({int(m.group(1)) for key in shapes if (m := re.match(r"body\.(\d+)\.", key))})
    if "body.0.out_conv.weight" in shapes:
        if len(levels) != LEVELS:
            raise UnsupportedModelError(f"a light T2I-Adapter has {LEVELS} extractors; the file has "
                                        f"{len(levels)}")
        blocks = len({m.group(1) for key in shapes if (m := re.match(r"body\.0\.body\.(\d+)\.", key))})
        unshuffled = shapes["body.0.in_conv.weight"][1]
        return T2IAdapterConfig("light", unshuffled // 64,
                                tuple(shapes[f"body.{level}.out_conv.weight"][0] for level in range(LEVELS)),
                                blocks)
    if "conv_in.weight" not in shapes or any(".skep." in key for key in shapes):
        raise UnsupportedModelError("not a T2I-Adapter Sluice reads: expected a full adapter (conv_in, "
                                    "body.N.block1/block2) without skep convolutions, or a light adapter "
                                    "(body.N.in_conv/out_conv); style and Stable Cascade adapters are not "
                                    "supported")
    if len(levels) % LEVELS:
        raise UnsupportedModelError(f"a full T2I-Adapter has {LEVELS} levels of equal block counts; the file "
                                    f"has {len(levels)} blocks")
    per_level = len(levels) // LEVELS
    unshuffled = shapes["conv_in.weight"][1]
    xl = unshuffled in XL_UNSHUFFLED_WIDTHS
    return T2IAdapterConfig(
        "full_xl" if xl else "full", unshuffled // (256 if xl else 64),
        tuple(shapes[f"body.{level * per_level}.block1.weight"][0] for level in range(LEVELS)), per_level,
        kernel_size=shapes["body.0.block2.weight"][2],
        conv_downsample=any(key.endswith("down_opt.op.weight") for key in shapes))


def diffusers_names(keys: Iterable[str]) -> dict[str, str]:
    """Our parameter name -> the diffusers T2IAdapter key it is read from (full, full_xl and light)."""
    keys = sorted(keys)
    light = any(re.match(r"adapter\.body\.\d+\.out_conv\.", key) for key in keys)
    per_level = 1 + max((int(m.group(1)) for key in keys
                         if (m := re.match(r"adapter\.body\.0\.resnets\.(\d+)\.", key))), default=0)
    names = {}
    for key in keys:
        if key.startswith("adapter.conv_in."):
            names[key.removeprefix("adapter.")] = key
        elif m := re.fullmatch(r"adapter\.body\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            level, index, rest = int(m.group(1)), int(m.group(2)), m.group(3)
            names[f"body.{level}.body.{index}.{rest}" if light
                  else f"body.{level * per_level + index}.{rest}"] = key
        elif m := re.fullmatch(r"adapter\.body\.(\d+)\.((?:in|out)_conv\..+)", key):
            level, rest = int(m.group(1)), m.group(2)
            names[f"body.{level}.{rest}" if light else f"body.{level * per_level}.{rest}"] = key
        else:
            raise UnsupportedModelError(f"diffusers T2I-Adapter key {key!r} has no counterpart; accepted: "
                                        f"the keys of a diffusers T2IAdapter (full_adapter, "
                                        f"full_adapter_xl, light_adapter)")
    return names
