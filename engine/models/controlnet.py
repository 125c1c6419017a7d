"""ControlNet (Zhang et al. 2023) for the SD1.x / SD2.x / SDXL UNet: a copy of the UNet's encoder half that
reads the noisy latent plus a hint image and returns residuals for the UNet's skips and middle block.

The network is the UNet's embedders, input blocks and middle block (engine/models/unet.py's UNetEncoder,
the same modules and parameter names), plus the hint encoder `input_hint_block` (3x3 convolutions with SiLU
between them, three of them of stride 2: the hint is 8x the latent's size), whose output is added after the
first input block, one 1x1 "zero convolution" per input block (`zero_convs.N.0`) and one after the middle
block (`middle_block_out.0`).

Parameter names are the ldm layout of the original files (`control_model.` stripped). Files in the diffusers
layout (`controlnet_cond_embedding.*`, `down_blocks.*`, `controlnet_down_blocks.N`, `mid_block.*`,
`controlnet_mid_block`) are read through `diffusers_names`, which maps each of our names to the file's key.
The config comes from shapes alone (`controlnet_config`): the UNet rules of engine/models/detect.py on the
encoder keys, the hint channels and the hint encoder's widths from `input_hint_block`.

Stages: "embed", "input_hint_block", each input block's layer stages as the UNet's ("input_blocks.4.0.in",
...) followed by "zero_convs.N", the middle block's stages and "middle_block_out". The state holds "h",
"emb", "context", "hint" (until added after input block 0) and "outs" (the zero convolutions' outputs).
`forward` returns ComfyUI's control dict before strength: {"output": one residual per input block, in
block order, "middle": [the middle block's residual]}.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.models.detect import UNetConfig, UnsupportedModelError, unet_encoder_config
from engine.models.staged import Stage, State, run_stages
from engine.models.unet import UNetEncoder, block_stages

LDM_PREFIX = "control_model."  # the original .pth files' prefix
DIFFUSERS_MARKER = "controlnet_cond_embedding.conv_in.weight"
LDM_MARKER = "zero_convs.0.0.weight"
UNSUPPORTED_MARKERS = {  # key -> what the file is
    "lora_controlnet": "a Control-LoRA",
    "control_add_embedding.linear_1.weight": "a ControlNet Union (ProMax)",
    "controlnet_blocks.0.weight": "a DiT (SD3 / FLUX / HunyuanDiT) ControlNet",
    "controlnet_blocks.0.linear.weight": "a FLUX (Mistoline) ControlNet",
}


@dataclass(frozen=True)
class ControlNetConfig:
    unet: UNetConfig  # the encoder half's config (its out_channels is unused)
    hint_channels: int  # channels of the hint image (3: RGB)
    hint_widths: tuple[int, ...]  # output width of each hint convolution but the last (16, 16, 32, ...)

    @property
    def hint_strides(self) -> tuple[int, ...]:
        """Each hint convolution's stride: 2 for the even ones between the first and the last (ldm's
        16-16-32s-32-96s-96-256s layout and diffusers' conv_in, (block, block strided)..., conv_out)."""
        count = len(self.hint_widths) + 1
        return tuple(2 if 0 < k < count - 1 and k % 2 == 0 else 1 for k in range(count))

    @property
    def hint_downscale(self) -> int:
        """Hint pixels per latent cell along each side (8 for every released ControlNet)."""
        return 2 ** sum(stride == 2 for stride in self.hint_strides)


class ControlNetModel(UNetEncoder):
    """forward(x, hint, timesteps, context, y) -> {"output": [residual per input block], "middle": [...]}."""

    def __init__(self, config: ControlNetConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "meta", attention_upcast: bool = False):
        super().__init__(config.unet, dtype, device, attention_upcast)
        self.control_config = config
        factory = {"dtype": dtype, "device": device}
        widths = (config.hint_channels, *config.hint_widths, config.unet.model_channels)
        layers: list[nn.Module] = []
        for k, stride in enumerate(config.hint_strides):
            if k:
                layers.append(nn.SiLU())
            layers.append(nn.Conv2d(widths[k], widths[k + 1], 3, stride=stride, padding=1, **factory))
        self.input_hint_block = nn.Sequential(*layers)  # convolutions at even indices, as in the files
        self.zero_convs = nn.ModuleList(nn.Sequential(nn.Conv2d(ch, ch, 1, **factory))
                                        for ch in self.skip_channels)
        self.middle_block_out = nn.Sequential(nn.Conv2d(self.channels, self.channels, 1, **factory))

    @property
    def hint_downscale(self) -> int:
        return self.control_config.hint_downscale

    def initial_state(self, x: torch.Tensor, hint: torch.Tensor, timesteps: torch.Tensor,
                      context: torch.Tensor, y: torch.Tensor | None = None) -> State:
        """The first stage's state from x (B, C, h, w), hint (B, hint_channels, h * hint_downscale, ...),
        timesteps (B,), context (B, L, D) and y (B, adm) for SDXL ControlNets."""
        self._check_y(y)
        expected = (x.shape[-2] * self.hint_downscale, x.shape[-1] * self.hint_downscale)
        channels = self.control_config.hint_channels
        if hint.ndim != 4 or hint.shape[1] != channels or tuple(hint.shape[-2:]) != expected:
            raise ValueError(f"ControlNet hint of shape {tuple(hint.shape)} does not suit a latent of shape "
                             f"{tuple(x.shape)}; expected (B, {channels}, "
                             f"{expected[0]}, {expected[1]})")
        return {"h": x.to(self.dtype), "hint": hint.to(self.dtype), "timesteps": timesteps,
                "context": context.to(self.dtype), "y": y, "outs": []}

    def _build_stages(self) -> list[Stage]:
        stages = [self._embed_stage(), Stage("input_hint_block", (self.input_hint_block,), self._hint)]
        for i, (block, zero_conv) in enumerate(zip(self.input_blocks, self.zero_convs, strict=True)):
            block_runs = block_stages(f"input_blocks.{i}", block)
            if i == 0:
                last = block_runs[-1]
                block_runs[-1] = Stage(last.name, last.modules, _adding_hint(last.run))
            stages += block_runs
            stages.append(Stage(f"zero_convs.{i}", (zero_conv,), _zero_conv_runner(zero_conv)))
        stages += block_stages("middle_block", self.middle_block)
        stages.append(Stage("middle_block_out", (self.middle_block_out,), self._middle_out))
        return stages

    def forward(self, x: torch.Tensor, hint: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                y: torch.Tensor | None = None) -> dict[str, list[torch.Tensor]]:
        return self.control_outputs(run_stages(self.stages(), self.initial_state(x, hint, timesteps, context,
                                                                                  y)))

    def control_outputs(self, state: State) -> dict[str, list[torch.Tensor]]:
        """The control dict of the last stage's state (ComfyUI's keys)."""
        return {"output": state["outs"], "middle": [state["middle"]]}

    def _hint(self, state: State) -> State:
        state["hint"] = self.input_hint_block(state["hint"])  # (B, model_channels, h, w)
        return state

    def _middle_out(self, state: State) -> State:
        state["middle"] = self.middle_block_out(state.pop("h"))
        return state


def _adding_hint(run: Any) -> Any:
    def run_then_add_hint(state: State) -> State:
        state = run(state)
        state["h"] = state["h"] + state.pop("hint")  # (B, model_channels, h, w)
        return state
    return run_then_add_hint


def _zero_conv_runner(zero_conv: nn.Module) -> Any:
    def run(state: State) -> State:
        state["outs"].append(zero_conv(state["h"]))
        return state
    return run


# ---------------------------------------------------------------------------------------------- detection


def controlnet_prefix(keys: Iterable[str]) -> tuple[str, str]:
    """(layout, prefix) of a ControlNet file: ("ldm", "control_model." or "") or ("diffusers", "").
    UnsupportedModelError names what the file is when it is another kind of control model."""
    keys = set(keys)
    for marker, what in UNSUPPORTED_MARKERS.items():
        if marker in keys:
            raise UnsupportedModelError(f"the file is {what}, which Sluice does not run; accepted: SD1.x, "
                                        f"SD2.x and SDXL ControlNets (ldm or diffusers layout), T2I-Adapters")
    if DIFFUSERS_MARKER in keys:
        return "diffusers", ""
    if LDM_PREFIX + LDM_MARKER in keys:
        return "ldm", LDM_PREFIX
    if LDM_MARKER in keys:
        return "ldm", ""
    raise UnsupportedModelError(f"no ControlNet found: the file has neither {LDM_MARKER!r} (ldm layout, "
                                f"optionally under {LDM_PREFIX!r}) nor {DIFFUSERS_MARKER!r} (diffusers "
                                f"layout)")


def is_controlnet(keys: Iterable[str]) -> bool:
    keys = set(keys)
    return any(k in keys for k in (DIFFUSERS_MARKER, LDM_MARKER, LDM_PREFIX + LDM_MARKER))


def controlnet_config(shapes: Mapping[str, tuple[int, ...]]) -> ControlNetConfig:
    """The config of a ControlNet from the shapes of its ldm-named tensors (prefix stripped)."""
    hint_indices = sorted(int(m.group(1)) for key in shapes
                          if (m := re.fullmatch(r"input_hint_block\.(\d+)\.weight", key)))
    if not hint_indices or hint_indices != list(range(0, 2 * len(hint_indices), 2)):
        raise UnsupportedModelError(f"ControlNet hint encoder convolutions at input_hint_block indices "
                                    f"{hint_indices}; expected 0, 2, 4, ... (ldm layout)")
    widths = [shapes[f"input_hint_block.{k}.weight"] for k in hint_indices]
    unet = unet_encoder_config(dict(shapes))
    if widths[-1][0] != unet.model_channels:
        raise UnsupportedModelError(f"the ControlNet's hint encoder ends at width {widths[-1][0]}; its UNet "
                                    f"copy starts at {unet.model_channels}")
    return ControlNetConfig(unet=unet, hint_channels=widths[0][1],
                            hint_widths=tuple(w[0] for w in widths[:-1]))


# ---------------------------------------------------------------------------------------------- diffusers

RESNET_NAMES = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
                "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
PLAIN_NAMES = {"conv_in": "input_blocks.0.0", "time_embedding.linear_1": "time_embed.0",
               "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
               "add_embedding.linear_2": "label_emb.0.2", "controlnet_mid_block": "middle_block_out.0",
               "controlnet_cond_embedding.conv_in": "input_hint_block.0"}


def diffusers_names(keys: Iterable[str]) -> dict[str, str]:
    """Our (ldm) parameter name -> the diffusers ControlNetModel key it is read from, for every key of a
    diffusers-layout file. UnsupportedModelError for a key with no ldm counterpart."""
    keys = sorted(keys)
    resnets: dict[int, set[int]] = {}
    downsamples: set[int] = set()
    hint_blocks: set[int] = set()
    for key in keys:
        if m := re.match(r"down_blocks\.(\d+)\.resnets\.(\d+)\.", key):
            resnets.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        elif m := re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.", key):
            downsamples.add(int(m.group(1)))
        elif m := re.match(r"controlnet_cond_embedding\.blocks\.(\d+)\.", key):
            hint_blocks.add(int(m.group(1)))
    first_block: dict[int, int] = {}  # down block -> the ldm input block of its first resnet
    index = 1
    for block in sorted(resnets):
        first_block[block] = index
        index += len(resnets[block]) + (block in downsamples)
    mid_attention = any(key.startswith("mid_block.attentions.0.") for key in keys)

    def ldm_module(module: str) -> str | None:
        if module in PLAIN_NAMES:
            return PLAIN_NAMES[module]
        if m := re.fullmatch(r"down_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)", module):
            block, resnet, layer = int(m.group(1)), int(m.group(2)), m.group(3)
            return f"input_blocks.{first_block[block] + resnet}.0.{RESNET_NAMES[layer]}"
        if m := re.fullmatch(r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.+)", module):
            return f"input_blocks.{first_block[int(m.group(1))] + int(m.group(2))}.1.{m.group(3)}"
        if m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv", module):
            block = int(m.group(1))
            return f"input_blocks.{first_block[block] + len(resnets[block])}.0.op"
        if m := re.fullmatch(r"mid_block\.resnets\.(\d+)\.(\w+)", module):
            position = int(m.group(1)) * (2 if mid_attention else 1)
            return f"middle_block.{position}.{RESNET_NAMES[m.group(2)]}"
        if m := re.fullmatch(r"mid_block\.attentions\.0\.(.+)", module):
            return f"middle_block.1.{m.group(1)}"
        if m := re.fullmatch(r"controlnet_down_blocks\.(\d+)", module):
            return f"zero_convs.{m.group(1)}.0"
        if m := re.fullmatch(r"controlnet_cond_embedding\.blocks\.(\d+)", module):
            return f"input_hint_block.{2 * (int(m.group(1)) + 1)}"
        if module == "controlnet_cond_embedding.conv_out":
            return f"input_hint_block.{2 * (len(hint_blocks) + 1)}"
        return None

    names = {}
    for key in keys:
        module, _, leaf = key.rpartition(".")
        try:
            ldm = ldm_module(module)
        except KeyError:
            ldm = None
        if ldm is None:
            raise UnsupportedModelError(f"diffusers ControlNet key {key!r} has no ldm counterpart; accepted: "
                                        f"the keys of a diffusers ControlNetModel of SD1.x, SD2.x or SDXL")
        names[f"{ldm}.{leaf}"] = key
    return names
