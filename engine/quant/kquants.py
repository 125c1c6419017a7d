"""The K-quant quantisers (Q2_K to Q6_K) of ggml's reference C (ggml-quants.c `quantize_row_q*_K_ref`,
`make_qkx2_quants`, `make_qx_quants`, `make_q3_quants`), vectorised over sub-blocks in PyTorch.

Every step is the C's float32 operation in the C's order, including its sums, which run element by element
left to right (a loop over the 16 or 32 positions of a sub-block, each step a tensor operation over all
sub-blocks at once; never a loop over blocks). The scale searches (21 candidate scales for Q4_K, 16 for
Q5_K/Q2_K, 19 for Q6_K, 5 rounds of coordinate descent for Q3_K) run for every sub-block and keep the best
as the C does. The bytes equal the C reference's built without floating-point contraction (gcc's default on
x86-64); tests/engine/quant check them against bytes it wrote.
"""

from __future__ import annotations

import numpy as np
import torch

GROUP_MAX_EPS = 1e-15  # ggml-quants.c: a sub-block whose largest magnitude is below this is all zero


def _f32(value: float) -> float:
    """`value` rounded to float32 (a C float constant or float expression), as a Python float."""
    return float(np.float32(value))


def _over(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator in float32, one rounding (Python's `number / tensor` is torch's
    reciprocal-then-multiply, two roundings)."""
    return torch.full_like(denominator, numerator) / denominator


def _nearest(x: torch.Tensor) -> torch.Tensor:
    """nearest_int: round half to even, as an int32 tensor."""
    return torch.round(x).to(torch.int32)


def _ordered_sums(terms: torch.Tensor, from_zero: bool = True) -> torch.Tensor:
    """Sums over the last dim, left to right with float32 rounding at each step, as the C loops add: from 0
    (`s = 0; s += t[i]`) or from the first term (`s = t[0]; s += t[i]` for i > 0)."""
    columns = terms.movedim(-1, 0).contiguous()
    total = columns[0] + 0.0 if from_zero else columns[0].clone()
    for column in columns[1:]:
        total = total + column
    return total


def _first_max(values: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The value at the first position of the largest `key` along the last dim: (..., 1)."""
    return torch.gather(values, -1, key.argmax(dim=-1, keepdim=True))


def _half(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values rounded to fp16 (GGML_FP32_TO_FP16): (bytes (..., 2), the fp16 value as float32)."""
    half = values.to(torch.float16)
    return half.view(torch.uint8).reshape(*values.shape[:-1], 2), half.float()


def _pack(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., count, k) values below 2**bits to (..., k) bytes, field f at bit bits*f."""
    packed = fields[..., 0, :].to(torch.uint8)
    for f in range(1, fields.shape[-2]):
        packed = packed | (fields[..., f, :].to(torch.uint8) << (bits * f))
    return packed


def _qkx2(x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
          use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants over rows (m, n): levels L (m, n) in [0, nmax], scale (m,) and the_min (m,) with
    x ~ scale * L - the_min, searching nstep + 1 scales around the range for the least weighted error."""
    low = torch.gather(x, -1, x.argmin(dim=-1, keepdim=True)).squeeze(-1)
    high = torch.gather(x, -1, x.argmax(dim=-1, keepdim=True)).squeeze(-1)
    low = torch.where(low > 0, torch.zeros_like(low), low)
    flat = high == low
    sum_w = _ordered_sums(weights, from_zero=False)
    sum_x = _ordered_sums(weights * x, from_zero=False)

    def error(scale: torch.Tensor, levels: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        diff = scale.unsqueeze(-1) * levels + offset.unsqueeze(-1) - x
        return _ordered_sums(weights * (diff.abs() if use_mad else diff * diff))

    iscale = _over(nmax, high - low)
    scale = _over(1, iscale)
    levels = _nearest(iscale.unsqueeze(-1) * (x - low.unsqueeze(-1))).clamp(0, nmax).float()
    best_error = error(scale, levels, low)
    for step in range(nstep + 1):
        iscale = _over(_f32(_f32(_f32(rmin) + _f32(_f32(rdelta) * step)) + nmax), high - low)
        trial = _nearest(iscale.unsqueeze(-1) * (x - low.unsqueeze(-1))).clamp(0, nmax).float()
        weighted = weights * trial
        sum_l, sum_l2, sum_xl = _ordered_sums(torch.stack((weighted, weighted * trial, weighted * x)))
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        clipped = this_min > 0
        this_scale = torch.where(clipped, sum_xl / sum_l2, this_scale)
        this_min = torch.where(clipped, torch.zeros_like(this_min), this_min)
        this_error = error(this_scale, trial, this_min)
        better = (det > 0) & (this_error < best_error)
        levels = torch.where(better.unsqueeze(-1), trial, levels)
        best_error = torch.where(better, this_error, best_error)
        scale = torch.where(better, this_scale, scale)
        low = torch.where(better, this_min, low)
    levels = torch.where(flat.unsqueeze(-1), torch.zeros_like(levels), levels)
    return levels, torch.where(flat, torch.zeros_like(scale), scale), -low


def _qx(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants with rmse_type 1 (weights x^2) over rows (m, n): levels (m, n) in [0, 2*nmax) and a
    signed scale (m,) with x ~ scale * (L - nmax), the best of 19 scales."""
    largest = _first_max(x, x.abs()).squeeze(-1)
    zero = largest.abs() < GROUP_MAX_EPS
    w = x * x

    def trial(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        levels = _nearest(iscale.unsqueeze(-1) * x).clamp(-nmax, nmax - 1).float()
        weighted = w * levels
        sum_lx, sum_l2 = _ordered_sums(torch.stack((w * x * levels, weighted * levels)))
        return levels, sum_lx, sum_l2

    levels, sum_lx, sum_l2 = trial(_over(-nmax, largest))
    scale = torch.where(sum_l2 != 0, sum_lx / sum_l2, torch.zeros_like(sum_lx))
    best = scale * sum_lx
    for step in range(-9, 10):
        if step == 0:
            continue
        candidate, sum_lx, sum_l2 = trial(_over(-_f32(nmax + _f32(_f32(0.1) * step)), largest))
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        levels = torch.where(better.unsqueeze(-1), candidate, levels)
        scale = torch.where(better, sum_lx / sum_l2, scale)
        best = torch.where(better, scale * sum_lx, best)
    levels = torch.where(zero.unsqueeze(-1), torch.full_like(levels, -nmax), levels)
    return levels + nmax, torch.where(zero, torch.zeros_like(scale), scale)


def _q3(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_q3_quants with do_rmse over rows (m, n): levels (m, n) in [0, 2*nmax) and a signed scale (m,),
    refined by 5 rounds of element-by-element coordinate descent (a round without a change repeats
    identically, so running all 5 equals the C's early stop)."""
    largest = _first_max(x, x.abs()).squeeze(-1)
    zero = largest.abs() < GROUP_MAX_EPS
    w = x * x
    levels = _nearest(_over(-nmax, largest).unsqueeze(-1) * x).clamp(-nmax, nmax - 1).float()
    sum_lx, sum_l2 = _ordered_sums(torch.stack((w * x * levels, w * levels * levels)))
    for _ in range(5):
        for i in range(x.shape[-1]):
            xi, wi, li = x[:, i], w[:, i], levels[:, i]
            slx = sum_lx - wi * xi * li
            sl2 = sum_l2 - wi * li * li
            new = _nearest(xi * sl2 / slx).clamp(-nmax, nmax - 1).float()
            slx = slx + wi * xi * new
            sl2 = sl2 + wi * new * new
            accept = (sum_lx - wi * xi * li > 0) & (new != li) & (sl2 > 0) & (
                slx * slx * sum_l2 > sum_lx * sum_lx * sl2)
            levels[:, i] = torch.where(accept, new, li)
            sum_lx = torch.where(accept, slx, sum_lx)
            sum_l2 = torch.where(accept, sl2, sum_l2)
    scale = torch.where(sum_l2 > 0, sum_lx / sum_l2, torch.zeros_like(sum_lx))
    levels = torch.where(zero.unsqueeze(-1), torch.full_like(levels, -nmax), levels)
    return levels + nmax, torch.where(zero, torch.zeros_like(scale), scale)


def _positive_max(values: torch.Tensor) -> torch.Tensor:
    """max(0, the largest value) along the last dim, +0 when none is positive (the C's `if (v > m) m = v`
    from m = 0): (..., 1)."""
    largest = values.amax(dim=-1, keepdim=True)
    return torch.where(largest > 0, largest, torch.zeros_like(largest))


def _refit(x: torch.Tensor, levels: torch.Tensor, d: torch.Tensor, offset: torch.Tensor | None, low: int,
           high: int) -> torch.Tensor:
    """The final levels against the stored (fp16 and 6/4-bit) scales: nearest((x + offset) / d) clamped,
    or the search's levels where d is 0 (the C's `if (!d) continue`)."""
    shifted = x if offset is None else x + offset.unsqueeze(-1)
    refit = _nearest(shifted / d.unsqueeze(-1)).clamp(low, high).float()
    return torch.where((d == 0).unsqueeze(-1), levels, refit - low if low < 0 else refit)


def _k_scale_bytes(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins (nb, 8) to Q4_K/Q5_K's 12 bytes."""
    first = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    second = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    last = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return torch.cat((first, second, last), dim=1).to(torch.uint8)


def _q4_k_q5_k(blocks: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple[torch.Tensor, ...]:
    """What quantize_row_q4_K_ref and q5_K_ref share: (d, dmin and scale bytes (nb, 16), levels (nb, 256))."""
    x = blocks.reshape(-1, 8, 32)
    # sqrtf, correctly rounded: through float64 (torch's float32 CPU sqrt can be 1 ulp off)
    av_x = torch.sqrt((_ordered_sums(x * x) / 32).double()).float()
    weights = av_x.unsqueeze(-1) + x.abs()
    levels, scales, mins = _qkx2(x.reshape(-1, 32), weights.reshape(-1, 32), nmax, rmin, 0.1, nstep, False)
    levels, scales, mins = levels.reshape(-1, 8, 32), scales.reshape(-1, 8), mins.reshape(-1, 8)
    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    inv_scale = torch.where(max_scale > 0, _over(63, max_scale), torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, _over(63, max_min), torch.zeros_like(max_min))
    stored_scales = (_nearest(inv_scale * scales) & 0xFF).clamp(max=63)  # uint8_t, then MIN(63, .)
    stored_mins = (_nearest(inv_min * mins) & 0xFF).clamp(max=63)
    d_bytes, d = _half(max_scale / 63)
    dmin_bytes, dmin = _half(max_min / 63)
    levels = _refit(x, levels, d * stored_scales, dmin * stored_mins, 0, nmax)
    head = torch.cat((d_bytes, dmin_bytes, _k_scale_bytes(stored_scales, stored_mins)), dim=1)
    return head, levels.reshape(-1, 256).to(torch.uint8)


def quantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    head, levels = _q4_k_q5_k(blocks, 15, -1.0, 20)
    return torch.cat((head, _pack(levels.reshape(-1, 4, 2, 32), 4).reshape(-1, 128)), dim=1)


def quantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    head, levels = _q4_k_q5_k(blocks, 31, -0.5, 15)
    high = _pack((levels >> 4).reshape(-1, 8, 32), 1)  # bit k of qh[j]: element 32k + j
    low = _pack((levels & 0x0F).reshape(-1, 4, 2, 32), 4).reshape(-1, 128)
    return torch.cat((head, high, low), dim=1)


def quantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    x = blocks.reshape(-1, 16, 16)
    levels, scales = _qx(x.reshape(-1, 16), 32)
    levels, scales = levels.reshape(-1, 16, 16), scales.reshape(-1, 16)
    max_scale = _first_max(scales, scales.abs())
    zero = max_scale.abs() < GROUP_MAX_EPS
    iscale = _over(-128, max_scale)
    d_bytes, d = _half(_over(1, iscale))
    stored_scales = _nearest(iscale * scales).clamp(max=127)
    levels = _refit(x, levels, d * stored_scales, None, -32, 31).reshape(-1, 2, 4, 32).to(torch.uint8)
    low = _pack((levels & 0x0F).reshape(-1, 2, 2, 2, 32).transpose(-3, -2), 4)  # byte b: elements b, b + 64
    high = _pack(levels >> 4, 2)  # qh[l]: elements l, l + 32, l + 64, l + 96 of each half
    scale_bytes = stored_scales.to(torch.int8).view(torch.uint8)
    packed = torch.cat((low.reshape(-1, 128), high.reshape(-1, 64), scale_bytes, d_bytes), dim=1)
    return torch.where(zero, torch.zeros_like(packed), packed)


def quantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    x = blocks.reshape(-1, 16, 16)
    levels, scales = _q3(x.reshape(-1, 16), 4)
    levels, scales = levels.reshape(-1, 16, 16), scales.reshape(-1, 16)
    max_scale = _first_max(scales, scales.abs())
    present = max_scale != 0
    iscale = torch.where(present, _over(-32, max_scale), torch.ones_like(max_scale))
    stored = torch.where(present, (_nearest(iscale * scales).to(torch.int8).int()).clamp(-32, 31) + 32, 0)
    d_bytes, d = _half(torch.where(present, _over(1, iscale), torch.zeros_like(iscale)))
    levels = _refit(x, levels, d * (stored - 32), None, -4, 3).reshape(-1, 256).to(torch.uint8)
    scale_bytes = torch.cat((_pack(stored.reshape(-1, 2, 8) & 0x0F, 4),
                             _pack((stored >> 4).reshape(-1, 4, 4), 2)), dim=1)
    hmask = _pack((levels >> 2).reshape(-1, 8, 32), 1)  # bit k of hmask[j]: element 32k + j
    low = _pack((levels & 0x03).reshape(-1, 2, 4, 32), 2).reshape(-1, 64)
    return torch.cat((hmask, low, scale_bytes, d_bytes), dim=1)


def quantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    x = blocks.reshape(-1, 16, 16)
    levels, scales, mins = _qkx2(x.reshape(-1, 16), x.abs().reshape(-1, 16), 3, -0.5, 0.1, 15, True)
    levels, scales, mins = levels.reshape(-1, 16, 16), scales.reshape(-1, 16), mins.reshape(-1, 16)
    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    zeros = torch.zeros_like(max_scale)
    stored_scales = torch.where(max_scale > 0, _nearest(_over(15, max_scale) * scales), 0) & 0xFF  # uint8_t
    stored_mins = torch.where(max_min > 0, _nearest(_over(15, max_min) * mins), 0)
    scale_bytes = (stored_scales | (stored_mins << 4)) & 0xFF
    d_bytes, d = _half(torch.where(max_scale > 0, max_scale / 15, zeros))
    dmin_bytes, dmin = _half(torch.where(max_min > 0, max_min / 15, zeros))
    levels = _refit(x, levels, d * (scale_bytes & 0x0F), dmin * (scale_bytes >> 4), 0, 3)
    low = _pack(levels.reshape(-1, 2, 4, 32).to(torch.uint8), 2).reshape(-1, 64)
    return torch.cat((scale_bytes.to(torch.uint8), low, d_bytes, dmin_bytes), dim=1)
