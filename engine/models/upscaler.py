"""Pixel-space upscalers (ESRGAN, Real-ESRGAN Compact, SwinIR, HAT, DAT, OmniSR, SPAN, ...) via spandrel.

The file is read by our own checkpoint readers (safetensors; torch zips through the restricted unpickler),
and spandrel detects the architecture and its hyper-parameters from the state dict alone. Images are run
tile by tile (engine/tiling.py). The model is the memory runtime's module `upscaler` (aliases esrgan, hires).

spandrel (and the torchvision it imports, about a second) is imported when an upscaler is loaded, not with
this module, so the rest of Sluice starts fast and runs without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from engine.devices import device_name, resolve_device
from engine.models.formats import open_checkpoint
from engine.tiling import DEFAULT_OVERLAP, DEFAULT_TILE, MIN_TILE, run_tiled_with_retry

if TYPE_CHECKING:
    import spandrel

MEMORY_MODULE = "upscaler"
RGB_CHANNELS = 3


class UpscalerError(ValueError):
    """An upscaler file whose architecture spandrel does not know, or that is not an image-to-image model."""


class MissingPackageError(ImportError):
    """An optional package that a node needs is not installed; the message says how to install it."""


def import_spandrel() -> ModuleType:
    """The spandrel module, imported now; MissingPackageError when it is not installed."""
    try:
        import spandrel
    except ImportError as error:
        raise MissingPackageError(f"upscale models need the Python package 'spandrel', which is not "
                                  f"installed ({error}); install it with: pip install spandrel") from None
    return spandrel


def supported_architectures() -> list[str]:
    """The architecture names spandrel can detect, in its registry order."""
    return [support.architecture.name for support in import_spandrel().MAIN_REGISTRY.architectures()]


@dataclass
class UpscaleModel:
    """A loaded upscaler (ComfyUI's UPSCALE_MODEL): a spandrel image model on its compute device."""

    descriptor: spandrel.ImageModelDescriptor
    source: Path
    compute_device: str  # Sluice device name, e.g. "cpu", "cuda0"
    params_location: str = "device"  # the weights stay on the compute device

    @property
    def architecture(self) -> str:
        return self.descriptor.architecture.name

    @property
    def scale(self) -> int:
        return int(self.descriptor.scale)

    @property
    def torch_device(self) -> torch.device:
        return self.descriptor.device

    def upscale(self, image: torch.Tensor, tile: int = DEFAULT_TILE, overlap: int = DEFAULT_OVERLAP,
                min_tile: int = MIN_TILE, check_interrupt: Callable[[], None] | None = None,
                on_progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """IMAGE [B, H, W, C>=3] in 0..1 -> IMAGE [B, H*scale, W*scale, 3] float32 on the CPU, tiled."""
        if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[-1] < RGB_CHANNELS:
            shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
            raise ValueError(f"upscaling needs an IMAGE of shape (B, H, W, 3); got {shape}")
        pixels = image[..., :RGB_CHANNELS].movedim(-1, 1).float().cpu()  # (B, 3, H, W)
        if self.descriptor.input_channels == 1:
            pixels = pixels.mean(dim=1, keepdim=True)  # (B, 1, H, W) luminance for grayscale models
        elif self.descriptor.input_channels != RGB_CHANNELS:
            raise UpscalerError(f"{self.source.name}: a {self.architecture} model with "
                                f"{self.descriptor.input_channels} input channels; accepted: 1 or 3")
        device, dtype = self.torch_device, self.descriptor.dtype

        def run_tile(tile_pixels: torch.Tensor) -> torch.Tensor:
            return self.descriptor(tile_pixels.to(device, dtype)).float().cpu()

        outputs = []
        for index in range(pixels.shape[0]):
            def progress(done: int, total: int, index: int = index) -> None:
                if on_progress is not None:
                    on_progress(index * total + done, pixels.shape[0] * total)

            outputs.append(run_tiled_with_retry(run_tile, pixels[index:index + 1], self.scale, tile, overlap,
                                                min_tile, check_interrupt, progress))
        result = torch.cat(outputs).clamp(0, 1)  # (B, C', H*scale, W*scale)
        if result.shape[1] == 1:
            result = result.expand(-1, RGB_CHANNELS, -1, -1)
        return result[:, :RGB_CHANNELS].movedim(1, -1).contiguous()  # (B, H*scale, W*scale, 3)


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of `path` through our safe readers (no pickle code runs)."""
    with open_checkpoint(path) as reader:
        return {key: reader.get(key) for key in reader.keys()}


def load_upscale_model(path: str | Path, device: str = "auto") -> UpscaleModel:
    """An upscaler file -> UpscaleModel on `device` (a Sluice device name, or auto)."""
    spandrel = import_spandrel()
    path = Path(path)
    state_dict = read_state_dict(path)
    try:
        descriptor = spandrel.ModelLoader().load_from_state_dict(state_dict)
    except spandrel.UnsupportedModelError:
        raise UpscalerError(f"{path}: the tensors match no architecture spandrel knows; supported: "
                            f"{', '.join(supported_architectures())}") from None
    except (RuntimeError, KeyError, ValueError) as error:
        raise UpscalerError(f"{path}: looks like an upscaler but its tensors do not fit the detected "
                            f"architecture ({error})") from None
    if not isinstance(descriptor, spandrel.ImageModelDescriptor):
        raise UpscalerError(f"{path}: a {descriptor.architecture.name} model ({type(descriptor).__name__}) "
                            f"is not an image-to-image model; accepted: upscalers and restorers")
    compute = resolve_device(device)
    descriptor.to(compute.torch_device).eval()
    return UpscaleModel(descriptor, path, device_name(compute.torch_device))
