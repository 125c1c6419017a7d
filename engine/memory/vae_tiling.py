"""VAE tiling (reference/004, "VAE Tiling"): run the VAE on overlapping tiles and feather-blend them.

Tile size is absolute (latent cells) or relative: `relative_size` r is how many tiles span each dimension,
so with fractional overlap o a tile is `length / (1 + (r - 1) * (1 - o))` cells (r = 5 is about a 32-cell
tile for a 1024 px SD image). A relative size takes precedence over an absolute one. Overlapping outputs are
blended with linear feather weights that ramp from 0 to 1 across each interior overlap, so seams do not
show. Because every tile runs its own forward pass (with its own GroupNorm statistics and attention span),
a tiled decode differs slightly from the whole one; the tests state the tolerance.

`decode_with_fallback` decodes whole unless tiling is on (or auto on a GPU of at most 25 GiB), and when a
decode fails for memory (torch.cuda.OutOfMemoryError, or BudgetExceeded from a managed budget) it retries
tiled with half-size tiles, halving again down to `min_tile` cells, even when tiling is off.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.devices import GIB, memory_info
from engine.memory.ledger import BudgetExceeded

log = logging.getLogger("sluice.vae")

AUTO_TILING_MAX_GIB = 25  # edge-dit: auto enables tiling on GPUs with at most this much memory
Coder = Callable[[torch.Tensor], torch.Tensor]  # (B, C, h, w) -> (B, C', h * scale, w * scale)


@dataclass(frozen=True)
class TilingConfig:
    mode: str = "auto"  # on, off or auto (on for GPUs of at most 25 GiB)
    relative_size: float | None = None  # tiles per dimension (reference/004 default 5.0); wins over tile_size
    tile_size: int | None = None  # absolute tile side in input cells (latent cells for a decode)
    overlap: float = 0.25  # fraction of a tile shared with its neighbour, clamped to [0, 0.5]
    min_tile: int = 8  # the smallest tile side the out-of-memory retries halve down to

    def __post_init__(self) -> None:
        if self.mode not in ("on", "off", "auto"):
            raise ValueError(f"VAE tiling mode {self.mode!r}; accepted: on, off, auto")
        if self.relative_size is not None and self.relative_size < 1:
            raise ValueError(f"relative tile size {self.relative_size}; accepted: 1 or more tiles")
        if self.tile_size is not None and self.tile_size < 1:
            raise ValueError(f"tile size {self.tile_size}; accepted: 1 or more cells")

    def tile_for(self, length: int) -> int:
        """Tile side for an input dimension of `length` cells."""
        if self.relative_size is not None or self.tile_size is None:
            tiles = self.relative_size if self.relative_size is not None else 5.0
            tile = math.ceil(length / (1 + (tiles - 1) * (1 - self.clamped_overlap)))
        else:
            tile = self.tile_size
        return max(1, min(length, tile))

    @property
    def clamped_overlap(self) -> float:
        return min(0.5, max(0.0, self.overlap))


def tile_spans(length: int, tile: int, overlap: int) -> list[tuple[int, int]]:
    """(start, stop) spans of `tile` cells covering `length`, neighbours sharing `overlap` cells; the last
    span is moved back to end at `length`."""
    if tile >= length:
        return [(0, length)]
    stride = max(1, tile - overlap)
    starts = list(range(0, length - tile, stride)) + [length - tile]
    return [(start, start + tile) for start in dict.fromkeys(starts)]


def _ramp(size: int, start_ramp: int, stop_ramp: int) -> torch.Tensor:
    """1-D feather weights: linear from near 0 to 1 over the first `start_ramp` and last `stop_ramp` cells."""
    weights = torch.ones(size)
    if start_ramp:
        weights[:start_ramp] = torch.arange(1, start_ramp + 1) / (start_ramp + 1)
    if stop_ramp:
        weights[size - stop_ramp:] = torch.minimum(
            weights[size - stop_ramp:], torch.arange(stop_ramp, 0, -1) / (stop_ramp + 1))
    return weights


def run_tiled(coder: Coder, x: torch.Tensor, tile: int, overlap_fraction: float, scale: float,
              align: int = 1) -> torch.Tensor:
    """Run `coder` on overlapping tiles of x [B, C, H, W] and feather-blend the outputs (scaled by `scale`).

    `align` keeps tile sides and offsets multiples of the coder's stride (8 pixels for an encode)."""
    height, width = x.shape[-2:]
    tile_h = max(align, min(height, tile) // align * align)
    tile_w = max(align, min(width, tile) // align * align)
    overlap_h = int(tile_h * overlap_fraction) // align * align
    overlap_w = int(tile_w * overlap_fraction) // align * align
    rows, cols = tile_spans(height, tile_h, overlap_h), tile_spans(width, tile_w, overlap_w)
    out = weight_sum = None
    for top, bottom in rows:
        for left, right in cols:
            piece = coder(x[..., top:bottom, left:right]).float()  # (B, C', th * scale, tw * scale)
            if out is None:
                size = (round(height * scale), round(width * scale))
                out = torch.zeros(*piece.shape[:2], *size, device=piece.device)
                weight_sum = torch.zeros(size, device=piece.device)
            y0, y1 = round(top * scale), round(bottom * scale)
            x0, x1 = round(left * scale), round(right * scale)
            ramp_y = _ramp(y1 - y0, round(overlap_h * scale) if top else 0,
                           round(overlap_h * scale) if bottom < height else 0)
            ramp_x = _ramp(x1 - x0, round(overlap_w * scale) if left else 0,
                           round(overlap_w * scale) if right < width else 0)
            weight = (ramp_y[:, None] * ramp_x[None, :]).to(piece.device)  # (th, tw)
            out[..., y0:y1, x0:x1] += piece * weight
            weight_sum[y0:y1, x0:x1] += weight
    return out / weight_sum


def _out_of_memory(error: BaseException) -> bool:
    return isinstance(error, BudgetExceeded) or isinstance(error, torch.cuda.OutOfMemoryError)


def tiling_enabled(config: TilingConfig, device: torch.device) -> bool:
    if config.mode != "auto":
        return config.mode == "on"
    return device.type == "cuda" and memory_info(device)[0] <= AUTO_TILING_MAX_GIB * GIB


def code_with_fallback(coder: Coder, x: torch.Tensor, config: TilingConfig, scale: float, align: int = 1,
                       what: str = "decode") -> torch.Tensor:
    """`coder(x)` whole or tiled per `config`; a failure for memory retries with half-size tiles."""
    length = min(x.shape[-2:])
    tile = config.tile_for(length) if tiling_enabled(config, x.device) else None
    floor = max(align, config.min_tile)
    while True:
        try:
            if tile is None or tile >= max(x.shape[-2:]):
                return coder(x).float()
            return run_tiled(coder, x, tile, config.clamped_overlap, scale, align)
        except Exception as error:
            if not _out_of_memory(error):
                raise
            current = tile if tile is not None else max(x.shape[-2:])
            smaller = max(floor, current // 2)
            if smaller >= current:
                raise
            log.warning("VAE %s ran out of memory (%s); retrying with %d-cell tiles", what,
                        type(error).__name__, smaller)
            tile = smaller
