"""The IQ4_NL and IQ4_XS quantisers of ggml (ggml-quants.c `quantize_iq4_nl`, `quantize_iq4_xs`, both through
`quantize_row_iq4_nl_impl` with 7 tries and no importance matrix: what ggml_quantize_chunk, and so
llama-quantize and stable-diffusion.cpp, write), vectorised over 32-element sub-blocks in PyTorch.

Each value is an index into the 16 non-linear levels IQ4_LEVELS. Per sub-block the C picks a scale: from the
largest magnitude, then 15 more candidates (`(itry - 127) / max`, itry -7..7), keeping the one with the best
weighted fit (weights x^2). IQ4_NL stores that scale as fp16 and re-picks each index against it; IQ4_XS
stores one fp16 super-block scale (-max_scale / 32) and a signed 6-bit multiple of it per sub-block, and
picks the indices against those. As engine.quant.kquants, every step is the C's float32 operation in the
C's order, sums element by element; ggml-quants.c built without floating-point contraction writes the same
bytes (tests/engine/quant check this). gguf-py has no quantiser for these types.
"""

from __future__ import annotations

import torch

from engine.quant.dequant import IQ4_LEVELS
from engine.quant.kquants import GROUP_MAX_EPS, _f32, _first_max, _half, _nearest, _ordered_sums, _over

TRIES = 7  # ggml's ntry: candidate scales (itry + IQ4_LEVELS[0]) / max for itry in -7..7


def _best_index(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """ggml's best_index_int8 over IQ4_LEVELS: the nearest level's index (ties to the upper one), int64.
    0 at or below the first level, 15 at or above the last; NaN gives 15 as the C's binary search does."""
    # the search's ml: how many of levels 1-14 are not above x (searchsorted gives 14 for NaN, as the C)
    lower = torch.searchsorted(levels[1:15], x.contiguous(), right=True)
    below, above = levels[lower], levels[lower + 1]
    index = torch.where(x - below < above - x, lower, lower + 1)
    return torch.where(x <= levels[0], 0, torch.where(x >= levels[15], 15, index))


def _fit(x: torch.Tensor, weight: torch.Tensor, inverse: torch.Tensor, levels: torch.Tensor,
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum w q x, sum w q^2) of x's sub-blocks (..., 32) against the levels nearest inverse * x."""
    q = levels[_best_index(inverse * x, levels)]
    wq = weight * q
    return _ordered_sums(wq * x), _ordered_sums(wq * q)


def _sub_block_scales(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """quantize_row_iq4_nl_impl's first loop: the scale of each 32-element sub-block (..., 32) -> (...,),
    0 where its largest magnitude is below GROUP_MAX_EPS."""
    weight = x * x
    signed_max = _first_max(x, x.abs()).squeeze(-1)  # the first value of largest magnitude
    zero = signed_max.abs() < _f32(GROUP_MAX_EPS)
    d = -signed_max / levels[0]
    sum_qx, sum_q2 = _fit(x, weight, _over(1, d).unsqueeze(-1), levels)
    d = sum_qx / sum_q2
    best = d * sum_qx
    for attempt in range(-TRIES, TRIES + 1):
        inverse = _over(attempt + IQ4_LEVELS[0], signed_max)
        sum_qx, sum_q2 = _fit(x, weight, inverse.unsqueeze(-1), levels)
        better = (sum_q2 > 0) & (sum_qx * sum_qx > best * sum_q2)
        d = torch.where(better, sum_qx / sum_q2, d)
        best = torch.where(better, d * sum_qx, best)
    return torch.where(zero, torch.zeros_like(d), d)


def _pack_indices(index: torch.Tensor) -> torch.Tensor:
    """(n, k, 32) indices to (n, 16k) bytes: per 32 elements, element j low and j + 16 high."""
    packed = index[..., :16] | (index[..., 16:] << 4)
    return packed.reshape(index.shape[0], -1).to(torch.uint8)


def quantize_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 32) float32 to (n, 18) IQ4_NL bytes: fp16 scale, 16 bytes of 4-bit level indices."""
    levels = torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=blocks.device)
    d = _sub_block_scales(blocks, levels)  # (n,)
    d_bytes, _ = _half(d.unsqueeze(-1))
    inverse = torch.where(d != 0, _over(1, d), torch.zeros_like(d))
    index = _best_index(inverse.unsqueeze(-1) * blocks, levels)
    return torch.cat((d_bytes, _pack_indices(index.unsqueeze(1))), dim=1)


def quantize_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 256) float32 to (n, 136) IQ4_XS bytes: fp16 super-block scale, the 2 high bits (2 bytes) and 4
    low bits (4 bytes) of eight 6-bit sub-block scales, 128 bytes of 4-bit level indices."""
    levels = torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=blocks.device)
    x = blocks.reshape(-1, 8, 32)
    scales = _sub_block_scales(x, levels)  # (n, 8)
    first_max = _first_max(scales, scales.abs())  # the C keeps the first of largest |scale|, from +0
    max_scale = torch.where(first_max.abs() > 0, first_max, torch.zeros_like(first_max))
    d = -max_scale / 32  # (n, 1); -0.0 when every sub-block is zero, as the C stores it
    d_bytes, _ = _half(d)
    inverse = torch.where(d != 0, _over(1, d), torch.zeros_like(d))
    stored = _nearest(inverse * scales).clamp(-32, 31)  # (n, 8)
    dl = d * stored
    idl = torch.where(dl != 0, _over(1, dl), torch.zeros_like(dl))
    index = _best_index(idl.unsqueeze(-1) * x, levels)  # (n, 8, 32)
    stored = stored + 32
    low = (stored[:, 0::2] & 0x0F) | ((stored[:, 1::2] & 0x0F) << 4)  # (n, 4)
    # scales_h, a little-endian uint16: the high 2 bits of scale s at bit 2s
    high = ((stored >> 4) << (2 * (torch.arange(8, device=blocks.device) % 4))).reshape(-1, 2, 4).sum(dim=-1)
    return torch.cat((d_bytes, high.to(torch.uint8), low.to(torch.uint8), _pack_indices(index)), dim=1)
