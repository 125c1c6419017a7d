"""Multi-head scaled dot-product attention shared by the UNet, VAE and text encoders."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, upcast: bool = False,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax(q k^T / sqrt(d)) v over `heads` heads (Vaswani et al. 2017) with PyTorch's SDPA kernels.

    q is (B, Lq, heads * d), k and v are (B, Lk, heads * d); the result is (B, Lq, heads * d).
    `upcast` computes in float32 and casts back, which keeps fp16 models (SD2.1-v) from overflowing.
    `mask` is an additive or boolean mask broadcastable to (B, heads, Lq, Lk).
    """
    batch, q_len, width = q.shape
    if width % heads != 0:
        raise ValueError(f"attention width {width} is not divisible by heads={heads}")
    head_dim = width // heads
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    q, k, v = (t.reshape(batch, -1, heads, head_dim).transpose(1, 2) for t in (q, k, v))  # (B, heads, L, d)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, heads, Lq, d)
    return out.transpose(1, 2).reshape(batch, q_len, width).to(dtype)  # (B, Lq, heads * d)
