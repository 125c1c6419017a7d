"""TAESD: madebyollin's tiny autoencoder, decoder only (github.com/madebyollin/taesd, taesd.py), for previews.

The decoder maps a latent in the diffusion model's space (raw VAE latent * scale factor) to an image in 0..1
at 8x its size. Files use the reference layout of taesd_decoder.safetensors: an nn.Sequential whose index
0 is the Clamp, so the first conv is "1.weight" and the first Block's convs "3.conv.0.weight", ...
Smaller decoders in the same layout load too: the width comes from "1.weight", the Blocks per stage from the
last key's index. A checkpoint can ship its own decoder as vae_approx/<checkpoint stem>_taesd_decoder.* (the
embedded model does: tools/train_preview_decoder.py), with its latent scale in the file's metadata
(`sluice.vae_scale_factor`).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.models.formats import open_checkpoint
from engine.settings import Settings

CHANNELS = 64
# Latent family -> the decoder file's name in vae_approx/ (any model extension) and the VAE scale factor.
DECODER_NAMES = {"sd1": "taesd_decoder", "sdxl": "taesdxl_decoder"}
LATENT_SCALES = {"sd1": 0.18215, "sdxl": 0.13025}
KEY_PREFIXES = ("taesd_decoder.", "decoder.")  # combined files (ComfyUI's, diffusers-style) nest the decoder
OWN_DECODER_SUFFIX = "_taesd_decoder"  # vae_approx/<checkpoint stem>_taesd_decoder.*: for that checkpoint
SCALE_KEY = "sluice.vae_scale_factor"  # metadata of a decoder trained for one VAE: that VAE's latent scale


class TAESDError(ValueError):
    """A TAESD decoder file that does not hold the reference decoder layout."""


class Clamp(nn.Module):
    """Soft clamp of the latent to about -3..3."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


def conv(n_in: int, n_out: int, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, bias=bias)


class Block(nn.Module):
    """Residual block: three 3x3 convs with ReLUs, added to the input, then a ReLU."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.conv = nn.Sequential(conv(n_in, n_out), nn.ReLU(), conv(n_out, n_out), nn.ReLU(),
                                  conv(n_out, n_out))
        self.skip = nn.Conv2d(n_in, n_out, 1, bias=False) if n_in != n_out else nn.Identity()
        self.fuse = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fuse(self.conv(x) + self.skip(x))


class TAESDDecoder(nn.Sequential):
    """Clamp, conv latent->width, ReLU, 3 x [`blocks` Blocks, 2x nearest upsample, conv], Block, conv
    width->3. The reference decoder has width 64 and 3 Blocks per stage."""

    def __init__(self, latent_channels: int = 4, width: int = CHANNELS, blocks: int = 3,
                 latent_scale: float | None = None):
        stages: list[nn.Module] = []
        for _ in range(3):
            stages += [*(Block(width, width) for _ in range(blocks)), nn.Upsample(scale_factor=2),
                       conv(width, width, bias=False)]
        super().__init__(Clamp(), conv(latent_channels, width), nn.ReLU(), *stages, Block(width, width),
                         conv(width, 3))
        self.latent_channels = latent_channels
        self.latent_scale = latent_scale  # the VAE's scale when trained for one VAE; None: the family's

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) model-space latent -> (B, 3, 8h, 8w) image in 0..1."""
        if latent.ndim != 4 or latent.shape[1] != self.latent_channels:
            raise ValueError(f"TAESD decoder needs a (B, {self.latent_channels}, h, w) latent; got "
                             f"{tuple(latent.shape)}")
        parameter = next(self.parameters())
        with torch.inference_mode():
            return self(latent.to(parameter.device, parameter.dtype)).float().clamp(0, 1)


def _strip_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for prefix in KEY_PREFIXES:
        if any(key.startswith(prefix) for key in state):
            return {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
    return state


def load_taesd_decoder(path: str | Path, device: str | torch.device = "cpu") -> TAESDDecoder:
    """A TAESD decoder file -> TAESDDecoder in eval mode on `device` (latent channels and width from
    "1.weight", Blocks per stage from the last layer's index, the latent scale from the metadata)."""
    path = Path(path)
    with open_checkpoint(path) as reader:
        state = _strip_prefix({key: reader.get(key) for key in reader.keys()})
        metadata = reader.metadata()
    first = state.get("1.weight")
    if first is None or first.ndim != 4 or first.shape[2:] != (3, 3):
        raise TAESDError(f"{path} is not a TAESD decoder: expected a first conv '1.weight' of shape "
                         f"(width, latent_channels, 3, 3)")
    last = max(int(key.split(".")[0]) for key in state if key.split(".")[0].isdigit())
    blocks = max(1, (last - 10) // 3)  # 3 + 3 * (blocks + 2) layers, then the Block and the output conv
    scale = float(metadata[SCALE_KEY]) if SCALE_KEY in metadata else None
    decoder = TAESDDecoder(latent_channels=first.shape[1], width=first.shape[0], blocks=blocks,
                           latent_scale=scale)
    expected = decoder.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise TAESDError(f"{path} does not match the TAESD decoder layout; "
                         f"missing: {', '.join(missing[:5]) or 'none'}; "
                         f"unexpected: {', '.join(unexpected[:5]) or 'none'}")
    wrong = [key for key in expected if expected[key].shape != state[key].shape]
    if wrong:
        raise TAESDError(f"{path}: tensor {wrong[0]} has shape {tuple(state[wrong[0]].shape)}, the TAESD "
                         f"decoder needs {tuple(expected[wrong[0]].shape)}")
    decoder.load_state_dict({key: value.float() for key, value in state.items()})
    return decoder.eval().to(device)


def find_taesd_decoder(settings: Settings | None, family: str) -> Path | None:
    """The vae_approx/ file named taesd_decoder.* (sd1) or taesdxl_decoder.* (sdxl), or None."""
    name = DECODER_NAMES.get(family)
    return None if settings is None or name is None else _find_vae_approx(settings, name)


def find_checkpoint_decoder(settings: Settings | None, checkpoint: Path | None) -> Path | None:
    """The vae_approx/ file <checkpoint stem>_taesd_decoder.*: the decoder made for that checkpoint's VAE."""
    if settings is None or checkpoint is None:
        return None
    return _find_vae_approx(settings, Path(checkpoint).name.split(".")[0] + OWN_DECODER_SUFFIX)


def _find_vae_approx(settings: Settings, stem: str) -> Path | None:
    for model in settings.list_models("vae_approx"):
        if Path(model).name.split(".")[0] == stem:
            return settings.resolve_model("vae_approx", model)
    return None


@functools.lru_cache(maxsize=2)
def _cached_decoder(path: str, mtime_ns: int, device: str) -> TAESDDecoder:
    return load_taesd_decoder(path, device)


def cached_taesd_decoder(path: Path, device: torch.device | str) -> TAESDDecoder:
    """The decoder of `path` on `device`, loaded once while the file is unchanged."""
    return _cached_decoder(str(path), os.stat(path).st_mtime_ns, str(torch.device(device)))


def shrink_latent(latent: torch.Tensor, max_side: int) -> torch.Tensor:
    """(B, C, h, w) latent area-downscaled so that its longer side is at most `max_side` (aspect kept)."""
    height, width = latent.shape[-2:]
    if max(height, width) <= max_side:
        return latent
    factor = max_side / max(height, width)
    size = (max(1, round(height * factor)), max(1, round(width * factor)))
    return F.interpolate(latent, size=size, mode="area")


def taesd_preview(decoder: TAESDDecoder, latent: torch.Tensor, max_size: int = 256) -> np.ndarray:
    """First item of a (B, C, h, w) model-space latent -> (H, W, 3) uint8 preview of at most `max_size` px."""
    return taesd_frame(decoder, latent, max_size).cpu().numpy()


def taesd_frame(decoder: TAESDDecoder, latent: torch.Tensor, max_size: int = 256) -> torch.Tensor:
    """`taesd_preview` on the decoder's device: an (H, W, 3) uint8 tensor there."""
    small = shrink_latent(latent[:1].float(), max(1, max_size // 8))  # decode at most max_size px
    image = decoder.decode(small)[0].movedim(0, -1)  # (H, W, 3)
    return image.mul(255).round().to(torch.uint8)
