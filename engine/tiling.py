"""Tiled image-to-image runs for pixel-space models (upscalers, restorers): overlap and feathered blending.

An image too large for one forward pass is cut into equal tiles that overlap by `overlap` input pixels;
each tile's output is weighted by a linear ramp across the overlap it shares with a neighbour (edges on the
image border keep weight 1) and the weighted sum is normalised, as ComfyUI's `tiled_scale` does. A run
that fails for memory restarts at half the tile size, down to a floor (ComfyUI's ImageUpscaleWithModel).
The VAE has its own tiling in engine/memory/vae_tiling.py; this module knows nothing of latents.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine import telemetry
from engine.memory.ledger import BudgetExceeded

log = logging.getLogger("sluice.tiling")

DEFAULT_TILE = 512
DEFAULT_OVERLAP = 32
MIN_TILE = 128
MEMORY_ERRORS: tuple[type[BaseException], ...] = (torch.cuda.OutOfMemoryError, BudgetExceeded)

TileFn = Callable[[torch.Tensor], torch.Tensor]  # (B, C, h, w) tile -> (B, C', h*scale, w*scale)


def tile_starts(size: int, tile: int, overlap: int) -> list[int]:
    """Start offsets of equal tiles of `tile` px covering `size` px, stepping `tile - overlap`."""
    if size <= tile:
        return [0]
    starts = list(range(0, size - tile + 1, tile - overlap))
    if starts[-1] + tile < size:
        starts.append(size - tile)  # the last tile sits flush with the border (a larger overlap)
    return starts


def _ramp(length: int, feather: int, rising: bool, falling: bool) -> torch.Tensor:
    """Per-pixel weights along one axis: linear ramps of `feather` px on the edges that meet a neighbour."""
    weights = torch.ones(length)
    ramp = (torch.arange(feather, dtype=torch.float32) + 0.5) / feather  # two ramps of one overlap sum to 1
    if feather > 0 and rising:
        weights[:feather] = torch.minimum(weights[:feather], ramp)
    if feather > 0 and falling:
        weights[-feather:] = torch.minimum(weights[-feather:], ramp.flip(0))
    return weights


def run_tiled(fn: TileFn, image: torch.Tensor, scale: int, tile: int = DEFAULT_TILE,
              overlap: int = DEFAULT_OVERLAP, check_interrupt: Callable[[], None] | None = None,
              on_tile: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """`fn` on (B, C, H, W) `image` tile by tile, blended: (B, C', H*scale, W*scale) on image's device.

    With `tile` >= both sides the result is exactly `fn(image)`.
    """
    if image.ndim != 4:
        raise ValueError(f"tiled run needs a (B, C, H, W) image; got shape {tuple(image.shape)}")
    if overlap < 0 or 2 * overlap > tile:
        raise ValueError(f"tile overlap {overlap} px must lie in 0..{tile // 2} for {tile} px tiles")
    batch, _, height, width = image.shape
    tile_h, tile_w = min(tile, height), min(tile, width)
    rows, cols = tile_starts(height, tile_h, overlap), tile_starts(width, tile_w, overlap)
    total = len(rows) * len(cols)
    if total == 1:
        if check_interrupt is not None:
            check_interrupt()
        result = fn(image).to(image.device, torch.float32)
        if on_tile is not None:
            on_tile(1, 1)
        return result
    feather = overlap * scale
    device = image.device
    output: torch.Tensor | None = None
    weight_sum = torch.zeros(1, 1, height * scale, width * scale, device=device)
    done = 0
    for row, y in enumerate(rows):
        for col, x in enumerate(cols):
            if check_interrupt is not None:
                check_interrupt()
            result = fn(image[:, :, y:y + tile_h, x:x + tile_w]).to(device, torch.float32)
            if output is None:
                output = torch.zeros(batch, result.shape[1], height * scale, width * scale, device=device)
            weights = (_ramp(tile_h * scale, feather, row > 0, row < len(rows) - 1)[:, None]
                       * _ramp(tile_w * scale, feather, col > 0, col < len(cols) - 1)[None, :]).to(device)
            region = (slice(None), slice(None), slice(y * scale, (y + tile_h) * scale),
                      slice(x * scale, (x + tile_w) * scale))
            output[region] += result * weights
            weight_sum[region] += weights
            done += 1
            if on_tile is not None:
                on_tile(done, total)
    assert output is not None
    return output / weight_sum


def run_tiled_with_retry(fn: TileFn, image: torch.Tensor, scale: int, tile: int = DEFAULT_TILE,
                         overlap: int = DEFAULT_OVERLAP, min_tile: int = MIN_TILE,
                         check_interrupt: Callable[[], None] | None = None,
                         on_tile: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """`run_tiled`, restarted at half the tile size after a memory failure (CUDA OOM or BudgetExceeded);
    a tile already at or below `min_tile` is not halved."""
    while True:
        try:
            return run_tiled(fn, image, scale, tile, min(overlap, tile // 2), check_interrupt, on_tile)
        except MEMORY_ERRORS as error:
            if tile // 2 < min_tile:
                log.error("tiles of %d px still run out of memory (floor %d px): %s", tile, min_tile, error)
                raise
            log.warning("tiles of %d px ran out of memory (%s); retrying at %d px", tile, error, tile // 2)
            telemetry.bus.publish("tile_retry", tile=tile, next_tile=tile // 2, reason=str(error))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            tile //= 2
