"""The poll kernel of copy_flags.py (Triton; imported only where a captured call polls)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["index"])  # one compiled kernel for every index, made before any capture
def _poll(flags, index):
    """Spin until flags[index] is non-zero (volatile loads go to L2: never a stale L1 line)."""
    value = tl.load(flags + index, volatile=True)
    while value == 0:
        value = tl.load(flags + index, volatile=True)


def poll(flags: torch.Tensor, index: int) -> None:
    """Queue on the current stream a one-thread kernel that returns once flags[index] != 0."""
    _poll[(1,)](flags, index, num_warps=1)
