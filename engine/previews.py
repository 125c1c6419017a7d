"""Live sampling previews chosen by the workflow's settings: TAESD, the linear latent-to-RGB map, or none.

`workflow.settings["preview"] = {"method": "auto" | "latent2rgb" | "taesd" | "none", "every": N}`; auto uses
TAESD when vae_approx/ holds the checkpoint's own decoder (<checkpoint stem>_taesd_decoder.*, as the embedded
model ships) or the family's (taesd_decoder.* for SD1/SD2, taesdxl_decoder.* for SDXL), and the latent-to-RGB
projection otherwise. Previews are at most 256 px on their longer side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.models.taesd import (
    DECODER_NAMES,
    OWN_DECODER_SUFFIX,
    cached_taesd_decoder,
    find_checkpoint_decoder,
    find_taesd_decoder,
    shrink_latent,
    taesd_frame,
)
from engine.sampling.preview import latent_to_rgb_frame
from engine.settings import Settings

PREVIEW_METHODS = ("auto", "latent2rgb", "taesd", "none")
MAX_PREVIEW_SIZE = 256

# (step index, total steps, denoised model-space latent [B, C, h, w]) -> (H, W, 3) uint8, or None to skip
Previewer = Callable[[int, int, torch.Tensor], np.ndarray | None]


@dataclass(frozen=True)
class PreviewOptions:
    method: str = "auto"  # one of PREVIEW_METHODS
    every: int = 1  # preview every N-th step (and always the last one)


def preview_options(workflow_settings: Mapping[str, Any] | None) -> PreviewOptions:
    """The checked "preview" entry of a workflow's settings (defaults when absent)."""
    entry = (workflow_settings or {}).get("preview", {})
    if not isinstance(entry, Mapping):
        raise ValueError(f"settings.preview must be an object like {{'method': 'auto', 'every': 1}}; "
                         f"got {entry!r}")
    unknown = sorted(set(entry) - {"method", "every"})
    if unknown:
        raise ValueError(f"unknown settings.preview key(s) {', '.join(unknown)}; accepted: method, every")
    method = entry.get("method", "auto")
    if method not in PREVIEW_METHODS:
        raise ValueError(f"unknown preview method {method!r}; accepted: {', '.join(PREVIEW_METHODS)}")
    every = entry.get("every", 1)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"settings.preview.every must be a whole number of steps >= 1; got {every!r}")
    return PreviewOptions(method, every)


def _latent2rgb_frame(latent: torch.Tensor, family: str) -> torch.Tensor:
    """The linear projection of the first latent, area-downscaled first to at most 256 px, on its device."""
    return latent_to_rgb_frame(shrink_latent(latent[:1].float(), MAX_PREVIEW_SIZE), family)


class HostFrames:
    """Preview frames made on a GPU reach the host without the sampler waiting for them: each frame is
    copied into pinned memory behind the step's work, and a call hands back the newest frame whose copy has
    finished (so previews run a step or so behind), except the last step's, which it waits for. A wait per
    step would keep the CPU from queueing the next step while the GPU works (on the H200, SD1.5's 12.5 ms
    step took 14 ms end to end with it). Frames made on the CPU come back at once."""

    def __init__(self) -> None:
        self._pending: list[tuple[torch.cuda.Event, torch.Tensor]] = []

    def __call__(self, frame: torch.Tensor, last: bool) -> np.ndarray | None:
        if frame.device.type != "cuda":
            return frame.numpy()
        host = torch.empty(frame.shape, dtype=frame.dtype, pin_memory=True)
        host.copy_(frame, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._pending.append((copied, host))
        if last:
            copied.synchronize()
            self._pending.clear()
            return host.numpy()
        ready = None
        while self._pending and self._pending[0][0].query():
            ready = self._pending.pop(0)[1]
        return None if ready is None else ready.numpy()


def make_previewer(workflow_settings: Mapping[str, Any] | None, family: str,
                   models: Settings | None = None, checkpoint: Path | None = None) -> Previewer | None:
    """The per-step preview function for a sampler of latent `family` ("sd1", "sdxl"), or None when off.

    `models` locates vae_approx/ for TAESD; without it, auto means latent2rgb. `checkpoint` is the model's
    file: a decoder made for its VAE is preferred to the family's.
    """
    options = preview_options(workflow_settings)
    if options.method == "none":
        return None
    decoder_path = None
    if options.method in ("auto", "taesd"):
        decoder_path = find_checkpoint_decoder(models, checkpoint) or find_taesd_decoder(models, family)
    if options.method == "taesd" and decoder_path is None:
        expected = DECODER_NAMES.get(family, "a TAESD decoder")
        if checkpoint is not None:
            expected = f"{Path(checkpoint).name.split('.')[0]}{OWN_DECODER_SUFFIX} or {expected}"
        where = models.model_dirs("vae_approx")[0] if models is not None else "vae_approx/ (no models folder)"
        raise ValueError(f"preview method 'taesd' needs {expected}.safetensors for latent family {family!r} "
                         f"in {where}; TAESD decoders exist for: {', '.join(DECODER_NAMES)}")

    to_host = HostFrames()

    def previewer(step: int, total: int, denoised: torch.Tensor) -> np.ndarray | None:
        last = step == total - 1
        if step % options.every != 0 and not last:
            return None
        if decoder_path is not None:
            decoder = cached_taesd_decoder(decoder_path, denoised.device)
            return to_host(taesd_frame(decoder, denoised, MAX_PREVIEW_SIZE), last)
        return to_host(_latent2rgb_frame(denoised, family), last)

    return previewer
